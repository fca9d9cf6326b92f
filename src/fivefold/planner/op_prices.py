"""Prices of single ops on one hardware profile: GEMMs, attention kernels, element-wise passes.

What fivefold.planner.compute composes into a block's time, each op priced from the
profile's kernel tables (fivefold.kernel_tables):

- GEMM (M x K times K x N): `2MKN / (peak * gemm_eff) + operand bytes / (HBM * gemm_mem_eff)`
  plus one kernel overhead (fivefold.kernel_tables.roofline_gemm_s; the two terms add, which
  reproduces the measured fall-off of narrow GEMMs, h200_measured.json: K = N = 2048 reaches
  0.58 of peak, 8192^3 0.76), times the profile's GEMM surface for the dtype where it has
  one (measured time over the roofline's near a measured shape; 1 far from all of them).
  Each distinct (shape, dtype) is priced once per surface (a cache). Which table prices a
  GEMM is decided in one place, `gemm_table`: an fp8 GEMM under rowwise scales
  (`parallel.fp8_recipe = "rowwise"`) runs at the profile's rowwise rate and surface where
  it measured them (Hopper: h200_measured.json's rowwise column), else at its fp8 ones.
- Attention: fused causal attention (FlashAttention-2, arXiv 2307.08691, and later), at the
  rate of the kernel generation the stack runs on the profile's architecture
  (fivefold.planner.stack.attention_generation, fivefold.kernel_tables.attention_rate).
  Work is counted per score element that is really computed (the causal half plus the
  diagonal tiles of 128), 4d FLOPs per score forward and 10d backward (recomputing P, then
  dV, dP, dQ, dK), plus a per-score softmax cost (`attn_score_s`: the exp throughput limit
  FlashAttention-3 names, arXiv 2407.08608 Sec. 3) and a per query row cost (`attn_row_s`:
  loading Q, rescaling and writing O and the log-sum-exp; backward 5x). Fitted to measured
  SDPA on H200 the row term explains why short sequences run at 0.45 of peak and 16k-token
  ones at 0.65. Context parallelism splits scores and rows evenly (load-balanced ring).
- Element-wise ops and norms: memory bound, bytes read and written / (HBM * mem_eff), times
  `eltwise_passes` (eager PyTorch re-reads intermediates; with `train.compile` the chains
  are fused and each tensor is read and written once).
- Unfused attention (a stack release before FlashAttention): `unfused_attention_time`;
  fivefold's own ring attention: `math_ring_attention_time`; the eager merges of torch's
  all-gather context parallelism: `torch_cp_merge_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.hardware import HardwareProfile
from fivefold.kernel_tables import FP8_ROWWISE, roofline_gemm_s

ATTN_TILE = 128  # FlashAttention's block size along both sequence axes


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def gemm_time(g: Gemm, prof: HardwareProfile, fp8: bool, act_bytes: int,
              recipe: str = "tensorwise") -> float:
    """Seconds of GEMM `g` on `prof`: its roofline times its surface (module docstring), fp8
    operands scaled by `recipe` (fivefold.parallel.fp8.recipe) when `fp8`."""
    table = gemm_table(prof, fp8, recipe, act_bytes)
    t = roofline_gemm_s(g.m, g.k, g.n, prof.peak_flops("fp8" if fp8 else table),
                        prof.hbm_GBps * 1e9, prof.eff, act_bytes, fp8, table == FP8_ROWWISE)
    surface = prof.gemm_surfaces.get(table)
    return t * surface.factor(g.m, g.k, g.n) if surface is not None else t


def gemm_table(prof: HardwareProfile, fp8: bool, recipe: str, act_bytes: int) -> str:
    """The kernel table (roofline rate and GEMM surface key) a GEMM is priced from: rowwise
    fp8 (kernel_tables.FP8_ROWWISE) where `prof` measured rowwise-scaled fp8 GEMMs
    (Efficiency.gemm_fp8_rowwise_eff), else "fp8" for any fp8 GEMM, else the compute dtype."""
    if not fp8:
        return compute_precision(act_bytes)
    measured = prof.eff.gemm_fp8_rowwise_eff is not None
    return FP8_ROWWISE if recipe == "rowwise" and measured else "fp8"


def compute_precision(act_bytes: int) -> str:
    return "fp32" if act_bytes == 4 else "bf16"


def attention_time(b: int, heads: int, seq: int, d: int, cp: int, prof: HardwareProfile,
                   ring: bool = False, precision: str = "bf16",
                   speedup: float = 1.0, fused_merge: bool = True) -> tuple[float, float]:
    """(forward s, backward s) of causal fused attention over `seq` tokens on one of cp
    ranks: 1/cp of the causal score tiles. Ulysses gives each rank heads/cp whole sequences
    (`heads` is then already divided); ring attention (`ring`) runs cp kernel steps, each
    over all seq/cp local queries, so the per-row cost is paid cp times, and merges each
    step's partial output and log-sum-exp into an fp32 accumulator (`fused_merge`; a stack
    that merges with eager ops pays `torch_cp_merge_bytes` instead). `speedup`: the rate of
    the stack's kernel generation over the profile's attention terms
    (fivefold.kernel_tables.attention_rate)."""
    e = prof.eff
    tiles = seq / ATTN_TILE
    scores = b * heads * ATTN_TILE**2 * tiles * (tiles + 1) / 2 / cp
    rows = b * heads * seq / cp * (cp if ring else 1)
    rate = prof.peak_flops("bf16" if precision == "fp8" else precision) * e.attn_eff * speedup
    merge = 0.0
    if ring and cp > 1 and fused_merge:  # read and write fp32 output and lse per extra step
        merge = eltwise_time(rows / cp * (cp - 1) * (d + 1) * 4 * 3, prof, 2 * (cp - 1), 1.0)
    score_s, row_s = e.attn_score_s / speedup, e.attn_row_s / speedup
    fwd = (scores * (4 * d / rate + score_s) + rows * row_s
           + e.kernel_overhead_s * (cp if ring else 1) + merge)
    bwd = (scores * (10 * d / rate + 2 * score_s) + 5 * rows * row_s
           + 3 * e.kernel_overhead_s * (cp if ring else 1) + 2 * merge)
    return fwd, bwd


# HBM bytes per score of Megatron-LM's unfused attention (before FlashAttention), `a` bytes
# per activation. Forward: Q K^T writes the scores (a), the fused scale-mask-softmax reads
# and writes them (2a), dropout reads them and writes its output and a one-byte mask (2a + 1),
# P V reads them (a). Backward: dO V^T writes dP (a), dV reads the dropped P (a), dropout's
# backward reads dP and the mask and writes (2a + 1), the softmax backward reads its
# gradient and output and writes dS (3a), dQ and dK read dS (2a).
UNFUSED_FWD_BYTES = (6, 1)  # (per activation byte, fixed): 6a + 1
UNFUSED_BWD_BYTES = (9, 1)  # 9a + 1


def unfused_attention_time(b: int, heads: int, seq: int, d: int, cp: int,
                           prof: HardwareProfile, act_bytes: int = 2) -> tuple[float, float]:
    """(forward s, backward s) of unfused attention on one of cp ranks: every score of the
    s x s square (the causal mask is applied after Q K^T), two batched GEMMs forward (4d
    FLOPs per score) and four backward (8d) at the profile's GEMM rate, the scores' HBM
    traffic (UNFUSED_FWD_BYTES, UNFUSED_BWD_BYTES) at its element-wise rate; four kernels
    forward, six backward."""
    e = prof.eff
    scores = b * heads * seq * seq / cp
    rate = prof.peak_flops(compute_precision(act_bytes)) * e.gemm_eff
    bw = prof.hbm_GBps * 1e9 * e.mem_eff
    fwd_b = UNFUSED_FWD_BYTES[0] * act_bytes + UNFUSED_FWD_BYTES[1]
    bwd_b = UNFUSED_BWD_BYTES[0] * act_bytes + UNFUSED_BWD_BYTES[1]
    fwd = scores * (4 * d / rate + fwd_b / bw) + 4 * e.kernel_overhead_s
    bwd = scores * (8 * d / rate + bwd_b / bw) + 6 * e.kernel_overhead_s
    return fwd, bwd


# block_attention.QUERY_CHUNK and CPU_SCORE_BYTES (that module needs torch; the planner runs
# without it; a test holds the rules equal)
RING_QUERY_CHUNK = 512
RING_CPU_SCORE_BYTES = 8 << 20


def ring_query_rows(prof: HardwareProfile, batch_heads: int, keys: int) -> int:
    """Query rows per chunk of the math ring's fp32 scores (block_attention.query_chunk_rows:
    on a CPU profile also at most RING_CPU_SCORE_BYTES of scores)."""
    if not prof.cores:
        return RING_QUERY_CHUNK
    return max(1, min(RING_QUERY_CHUNK, RING_CPU_SCORE_BYTES // (batch_heads * keys * 4)))


def diagonal_scores(rows: int, t: int) -> int:
    """Scores per head of a t x t diagonal block in chunks of `rows` query rows, each chunk
    against the keys up to its last row (block_attention.visible_keys)."""
    return sum((min(c + rows, t) - c) * min(c + rows, t) for c in range(0, t, rows))


def diagonal_masked(rows: int, t: int) -> int:
    """Masked scores per head that a t x t diagonal block in chunks of `rows` query rows still
    computes: each chunk's own square above its diagonal, rows (rows - 1) / 2."""
    return sum((r := min(c + rows, t) - c) * (r - 1) // 2 for c in range(0, t, rows))


def math_ring_attention_time(b: int, heads: int, kv_heads: int, seq: int, d: int, cp: int,
                             prof: HardwareProfile) -> tuple[float, float]:
    """(forward s, backward s) of fivefold's own ring attention on one of cp ranks
    (fivefold.parallel.context.ring_attention over block_attention's "math" kernel, the only
    one it has): explicit fp32 matmuls and eager element-wise ops, query rows a chunk at a
    time (`ring_query_rows`).

    Blocks (zigzag, T = seq/cp local tokens): the diagonal T x T, each chunk of its rows
    against the keys up to the chunk's last row (`diagonal_scores`), masked; then cp - 1
    blocks of T/2 x T (or T x T/2). Per computed score, fp32, each op's reads and writes
    (they are separate eager kernels; none is fused or compiled): forward the q k^T and p v
    matmuls (4d FLOPs), the score written (4 B), scaled (8), log-sum-exp'd (24: torch's
    logsumexp runs amax, subtract, exp and sum, 4 + 8 + 8 + 4, as its CPU profile shows),
    shifted (8), exponentiated (8) and read by p v (4): 56 bytes, 8 more on the diagonal for
    the mask; backward the five matmuls (10d FLOPs: q k^T again, p^T dout, dout v^T, ds k,
    ds^T q) and 64 bytes (the score rewritten, scaled, shifted and exponentiated, dout v^T
    written, less D, times p, p and ds read three times), 72 on the diagonal. The diagonal's
    masked scores (`diagonal_masked`) pass -inf through exp twice forward (logsumexp's, the
    shift's) and once backward, each at the profile's `masked_exp_s` more. Per block: K and
    V expanded to the query heads in fp32 (and their gradients summed back); per later step
    the fp32 output/lse merge (forward) and the dq, dk, dv accumulations (backward), about
    40 bytes per element they touch. Every op is one kernel per query chunk."""
    e = prof.eff
    t = seq / cp
    blocks = [(t, t, True)] + [(t / 2, t, False)] * (cp - 1)
    rate = prof.peak_flops("fp32") * e.gemm_eff
    bw = prof.hbm_GBps * 1e9 * e.mem_eff
    fwd = bwd = 0.0
    for tq, tk, diag in blocks:
        rows = ring_query_rows(prof, b * heads, int(tk))
        chunks = math.ceil(tq / rows)
        scores = b * heads * (diagonal_scores(rows, int(tq)) if diag else tq * tk)
        masked = b * heads * diagonal_masked(rows, int(tq)) * e.masked_exp_s if diag else 0.0
        expand = b * heads * tk * d * 4 * 2 * 2  # K and V to every head, read + write
        fwd += (scores * 4 * d / rate + (scores * (64 if diag else 56) + expand) / bw
                + 9 * chunks * e.kernel_overhead_s + 2 * masked)
        bwd += (scores * 10 * d / rate + (scores * (72 if diag else 64) + 2 * expand) / bw
                + 16 * chunks * e.kernel_overhead_s + masked)
    rows = b * heads * t * (d + 1)
    fwd += (cp - 1) * (40 * rows / 2 / bw + 8 * e.kernel_overhead_s)
    bwd += cp * (40 * (rows + b * kv_heads * t * d * 2) / bw + 6 * e.kernel_overhead_s)
    return fwd, bwd


def torch_cp_merge_bytes(out: float, kv: float, cp: int, a: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the eager element-wise work around torch 2.5/2.6's
    all-gather context parallelism (torch/distributed/tensor/experimental/_attention.py,
    `_templated_ring_attention` and its backward, `convert_to_f32` on) for one attention
    call on one rank: `out` elements of the local output (tokens x heads x head dim), `kv`
    elements of each of the local K and V (as the model passes them), cp steps, a bytes per
    activation. Counted for the rank whose steps are all whole-query (the last: the others
    update halves and are no slower), one read or write per tensor an op touches:

    forward: each step's output cast to fp32 (a + 4 per element); from the second step the
    merge `out - sigmoid(lse_b - lse) * (out - out_b)` (three fp32 ops: 12 + 8 + 12); K and
    V concatenated for the exchange before every step but the last (2a each); the result
    cast back once (4 + a).
    backward: fp32 dQ, dK, dV zeroed (4 each); K and V concatenated before every step but
    the last (2a each); dQ += step dQ each step (8 + a); dK, dV += step grads (8 + a) at the
    first step, then, the received accumulator updated in its first half (8 + a over half)
    and re-concatenated (8); the fp32 dK, dV concatenated for the next rank each step (8
    each); dQ and the final dK, dV cast back (4 + a)."""
    steps = cp - 1
    fwd = cp * (a + 4) * out + steps * 32 * out + steps * 2 * (2 * a * kv) + (4 + a) * out
    bwd = (4 * out + 8 * kv + steps * 2 * (2 * a * kv) + cp * (8 + a) * out
           + 2 * (8 + a) * kv + steps * 2 * ((8 + a) * kv / 2 + 8 * kv)
           + cp * 2 * 8 * kv + (4 + a) * (out + 2 * kv))
    return fwd, bwd


def eltwise_time(nbytes: float, prof: HardwareProfile, kernels: int, passes: float) -> float:
    e = prof.eff
    return nbytes * passes / (prof.hbm_GBps * 1e9 * e.mem_eff) + kernels * e.kernel_overhead_s
