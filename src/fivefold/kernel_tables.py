"""Kernel tables: what one GPU architecture's kernels were measured to do, and from where.

A hardware profile (fivefold.hardware) prices each op of a step from its own architecture's
tables, never from another architecture's:

- GEMMs: the roofline `2MKN / (peak * gemm_eff) + operand bytes / (HBM * gemm_mem_eff) +
  kernel_overhead_s` (`roofline_gemm_s`; the two terms add rather than max, which
  reproduces the measured fall-off of narrow GEMMs), its terms fitted to the measured shapes,
  times an efficiency surface over (M, K, N) per dtype (`GemmSurface`): at each measured
  shape the measured time over the roofline's, interpolated in log2-shape space by a
  Gaussian kernel of SIGMA octaves that fades to the roofline (factor 1) about an octave
  away from the nearest measurement (PRIOR_WEIGHT). A shape near a measured one runs as
  measured; a shape far from all of them (a narrow MoE expert GEMM) runs on the roofline.
  fp8 GEMMs have two tables where both were measured: tensorwise scales ("fp8") and
  rowwise scales (FP8_ROWWISE: one scale per row of each operand, torchao's "rowwise",
  fivefold.parallel.fp8.recipe), each with its own rate (`gemm_fp8_eff`,
  `gemm_fp8_rowwise_eff`) and surface; a profile that measured no rowwise GEMM prices them
  at its fp8 rate and surface (fivefold.planner.op_prices.gemm_table).
- attention: per kernel generation ("fa2": FlashAttention-2-class, arXiv 2307.08691; "fa3":
  FlashAttention-3-class and later, arXiv 2407.08608, cuDNN's fused attention, FlashAttention-4
  on Blackwell) the generation's rate over the profile's own attention terms (Efficiency
  attn_eff, attn_score_s, attn_row_s, fitted to the measured shapes where there are any).
  A generation an architecture has no kernel of runs as the newest older one it has
  (FlashAttention-3 needs Hopper: on Ampere an "fa3" stack runs FlashAttention-2).
  Unfused attention, before FlashAttention (which the stack says: fivefold.planner.stack
  attention_generation), is priced from the GEMM and HBM rates: no table.
- element-wise ops and copies by HBM bytes (Efficiency.mem_eff); collectives by
  fivefold.planner.comm's models.

`Efficiency` holds the scalar terms (the rooflines' rates and fixed costs, the links'
efficiencies); the GEMM surfaces and attention generations sit beside it in the profile.

`NEUTRAL` is the one architecture-neutral default a profile without kernel measurements uses;
such a profile says so in its kernel_source, and its prediction band widens
(fivefold.planner.bands). Torch-free: the planner prices without torch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

# One H200's measurements (torch 2.11, 2026-11-29), packaged; docs/reference/h200_measured.json
# is the same file (a test holds them equal).
GB = 10**9
H200_MEASURED = Path(__file__).with_name("h200_measured.json")
SIGMA = 0.25  # octaves: a measured point's weight falls to e^-8 one octave away
PRIOR_WEIGHT = math.exp(-1.0 / (2 * SIGMA**2))  # the roofline's weight: a point an octave off
# Attention kernel generations, oldest first (fivefold.planner.stack chooses one per release)
GENERATIONS = ("fa2", "fa3")
# FlashAttention-2 over FlashAttention-3 on an H100 SXM5 (Hopper), head dim 128, 16k tokens
# (arXiv 2407.08608 Figs. 5-6): causal forward 335 vs 616 TFLOP/s, backward 322 vs 561,
# weighted as a training step runs them (backward 2.5x the forward's FLOPs): 0.565. A
# Hopper measurement: only Hopper profiles' tables hold it.
FLASH2_RATE_H100 = 3.5 / (616 / 335 + 2.5 * 561 / 322)


@dataclass(frozen=True)
class Efficiency:
    """What fraction of each peak real kernels reach, and the fixed costs they pay.

    gemm_eff          large-GEMM rate / dense peak (compute term of the GEMM roofline)
    gemm_fp8_eff      the same for fp8 GEMMs, over the fp8 peak
    gemm_fp8_rowwise_eff  the same for rowwise-scaled fp8 GEMMs; None where none was
                      measured: they run at gemm_fp8_eff
    gemm_mem_eff      HBM fraction reached by a GEMM's operand traffic (its memory term)
    attn_eff          fused causal attention's matmul rate / peak (FlashAttention-2/3)
    attn_score_s      seconds per attention score element for the softmax (exp) work or,
                      unfused, the s x s memory traffic, forward; backward pays 2x
    attn_row_s        seconds per query row and head (load Q, rescale, write O), forward;
                      backward pays 5x
    mem_eff           HBM fraction reached by element-wise ops, norms, casts, the optimizer
    eltwise_passes    HBM passes over each element-wise tensor: 1 = perfectly fused kernels;
                      eager PyTorch reads and writes intermediates several times
    kernel_overhead_s fixed cost per kernel launch (tail effects, launch latency)
    comm_intra_eff    fraction of NVLink bandwidth NCCL's collectives reach (bus bandwidth)
    comm_inter_eff    the same for the inter-node network
    latency_intra_s   per-hop latency of a collective within a node
    latency_inter_s   per-hop latency across nodes
    nic_aggregation   how many of a node's NICs one collective's ring uses together: the
                      per_node ranks of a group reach per_node^a NICs' bandwidth (1 = all)
    overlap_eff       fraction of a collective that hides behind concurrent compute (the
                      rest slows the compute: shared SMs and HBM)
    masked_exp_s      extra seconds per element of an exp whose input is -inf, over an
                      ordinary one: torch's vectorized CPU exp leaves its fast path for
                      them (measured by `fivefold calibrate`; 0 where not measured). The
                      masked scores of fivefold's ring kernel pay it
                      (fivefold.planner.op_prices.math_ring_attention_time)
    reduce_scatter_eff, all_gather_eff, all_to_all_eff
                      that collective's measured bandwidth over the ring model's at the
                      all-reduce's fitted rate (fivefold.planner.comm). 1 where the
                      backend's rings do what the model says (NCCL); `fivefold calibrate`
                      measures them, and gloo's reduce-scatter on CPU ranks runs at about
                      0.3: it costs more than an all-reduce of the same input
    reserved_bytes    memory not available to tensors (CUDA context, allocator slack)
    """

    gemm_eff: float = 0.75
    gemm_fp8_eff: float = 0.65
    gemm_fp8_rowwise_eff: float | None = None
    gemm_mem_eff: float = 0.8
    attn_eff: float = 0.6
    attn_score_s: float = 0.0
    attn_row_s: float = 0.0
    mem_eff: float = 0.8
    eltwise_passes: float = 1.0
    kernel_overhead_s: float = 5e-6
    comm_intra_eff: float = 0.8
    comm_inter_eff: float = 0.8
    latency_intra_s: float = 5e-6
    latency_inter_s: float = 15e-6
    nic_aggregation: float = 1.0
    overlap_eff: float = 0.9
    masked_exp_s: float = 0.0
    reduce_scatter_eff: float = 1.0
    all_gather_eff: float = 1.0
    all_to_all_eff: float = 1.0
    reserved_bytes: int = 2 * GB

# The architecture-neutral default (one place): what a profile without kernel measurements
# (V100; Blackwell's GEMMs and element-wise ops) prices with, and a profile file without an
# "eff" entry. They are the class defaults above: round figures of a well-used datacenter
# GPU, not any architecture's measurement; such a profile says "no kernel measurements" in
# its kernel_source and its prediction band widens (fivefold.planner.bands).
NEUTRAL = Efficiency()
FP8_ROWWISE = "fp8_rowwise"  # the table key of rowwise-scaled fp8 GEMMs (module docstring)


def roofline_gemm_s(m: float, k: float, n: float, peak_flops: float, hbm_Bps: float,
                    eff, act_bytes: int, fp8: bool, rowwise: bool = False) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM on the roofline of Efficiency `eff`, `peak_flops`
    already the dtype's (fp8: fp8 operands, a `act_bytes` output; `rowwise`: rowwise scales,
    at `gemm_fp8_rowwise_eff`, which the caller has checked is measured)."""
    if fp8:
        rate = peak_flops * (eff.gemm_fp8_rowwise_eff if rowwise else eff.gemm_fp8_eff)
        nbytes = m * k + k * n + act_bytes * m * n
    else:
        rate, nbytes = peak_flops * eff.gemm_eff, act_bytes * (m * k + k * n + m * n)
    return (2.0 * m * k * n / rate + nbytes / (hbm_Bps * eff.gemm_mem_eff)
            + eff.kernel_overhead_s)


@dataclass(frozen=True)
class GemmSurface:
    """Measured GEMM time over the roofline's, per measured shape: points (log2 M, log2 K,
    log2 N, log of measured / roofline seconds), with the measurement they come from. Its
    hash is computed once: its factors are cached per (surface, shape)."""

    points: tuple[tuple[float, float, float, float], ...]
    source: str

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.points, self.source))

    def __hash__(self) -> int:
        return self._hash

    def factor(self, m: float, k: float, n: float) -> float:
        """The surface's time factor at shape (m, k, n): 1 far from every measurement."""
        return _factor(self, m, k, n)


@functools.lru_cache(maxsize=1 << 16)
def _factor(surface: GemmSurface, m: float, k: float, n: float) -> float:
    x = (math.log2(max(m, 1.0)), math.log2(max(k, 1.0)), math.log2(max(n, 1.0)))
    weight, total = PRIOR_WEIGHT, 0.0
    for pm, pk, pn, r in surface.points:
        w = math.exp(-((x[0] - pm) ** 2 + (x[1] - pk) ** 2 + (x[2] - pn) ** 2) / (2 * SIGMA**2))
        weight, total = weight + w, total + w * r
    return math.exp(total / weight)


def gemm_surface(samples: list[tuple[int, int, int, float]], model_s, source: str
                 ) -> GemmSurface:
    """A surface from measured (M, K, N, seconds) samples and the roofline `model_s(M, K, N)`
    they are read against."""
    return GemmSurface(tuple((math.log2(m), math.log2(k), math.log2(n),
                              math.log(t / model_s(m, k, n))) for m, k, n, t in samples),
                       source)


def h200_gemm_samples(path: Path = H200_MEASURED) -> dict[str, list[tuple[int, int, int, float]]]:
    """(M, K, N, seconds) per table from h200_measured.json: its 30-shape bf16 table and the
    bf16, fp8 tensorwise ("fp8") and fp8 rowwise (FP8_ROWWISE) columns of its fp8 table."""
    data = json.loads(path.read_text())

    def secs(g: dict, tflops: float) -> tuple[int, int, int, float]:
        return g["M"], g["K"], g["N"], 2 * g["M"] * g["K"] * g["N"] / (tflops * 1e12)

    bf16 = [secs(g, g["tflops"]) for g in data["gemm_table"]]
    bf16 += [secs(g, g["bf16_tflops"]) for g in data["fp8_gemm"]]
    fp8 = [secs(g, g["fp8_tensorwise_tflops"]) for g in data["fp8_gemm"]]
    rowwise = [secs(g, g["fp8_rowwise_tflops"]) for g in data["fp8_gemm"]]
    return {"bf16": bf16, "fp8": fp8, FP8_ROWWISE: rowwise}


def h200_surfaces(eff: Efficiency) -> dict[str, GemmSurface]:
    """The H200's GEMM surface per table, each read against the H200's own roofline under
    `eff` (989 TFLOP/s bf16, 1979 fp8, 4.8 TB/s: fivefold.hardware's H200 datasheet)."""
    peak = {"bf16": 989e12, "fp8": 1979e12, FP8_ROWWISE: 1979e12}
    return {table: gemm_surface(points, lambda m, k, n, t=table: roofline_gemm_s(
        m, k, n, peak[t], 4800e9, eff, 2, t != "bf16", t == FP8_ROWWISE),
        f"h200_measured.json, {table}") for table, points in h200_gemm_samples().items()}


def attention_rate(generations: tuple[tuple[str, float], ...], generation: str) -> float:
    """The rate of `generation`'s kernel over the profile's attention terms: the generation's
    own entry, else the newest older one the architecture has, else its oldest."""
    have = dict(generations)
    older = GENERATIONS[:GENERATIONS.index(generation) + 1] if generation in GENERATIONS else ()
    for gen in reversed(older):
        if gen in have:
            return have[gen]
    return generations[0][1]
