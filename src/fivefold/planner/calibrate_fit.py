"""Fitting `fivefold calibrate`'s measurements to the compute model, and the rates a rank
sustains when it shares its cores.

`fit_gemm` and `fit_attention` fit the roofline terms of fivefold.planner.compute to timed
GEMMs and attention calls (least squares on relative error); `fit_h200_reference` is how the
H200 profile's curves come from docs/reference/h200_measured.json.

`slowed_profile` is a profile computing `k` times slower: every compute rate divided by `k`
(GEMM and attention peaks, memory bandwidth) and every per-operation time multiplied by `k`
(kernel overhead, attention's per-score and per-row costs, exp of -inf); the host tier and
the links stay as measured. `fivefold calibrate` uses it on a CPU whose ranks are
time-sliced: it times each probe in CPU time, what the probe takes while it runs (its wall
time would catch a scheduler slice at full speed or not, by chance), and a rank that holds
only part of its core (two ranks on one core, other jobs on the machine) sustains that part
of those rates over a training step. The CPU time the measuring process got over the wall
time of its sweeps is that part (`cpu_share`).
Torch-free, so the planner and the tests can fit without measuring.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fivefold.hardware import HardwareProfile
from fivefold.planner.op_prices import ATTN_TILE, Gemm


def _lstsq_pos(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares (relative error weighting) for a few unknowns."""
    from scipy.optimize import nnls
    import numpy as np

    a = np.array([[v / t for v in r] for r, t in zip(rows, y)])
    return list(nnls(a, np.ones(len(y)))[0])


def fit_gemm(samples: list[tuple[int, int, int, float]], peak_flops: float, hbm_Bps: float,
             elem_bytes: int) -> tuple[float, float, float]:
    """(gemm_eff, gemm_mem_eff, kernel_overhead_s) from (M, K, N, seconds) samples:
    t = 2MKN / (peak * e) + bytes / (HBM * m) + overhead, fitted linear in 1/e, 1/m."""
    rows, ts = [], []
    for M, K, N, t in samples:
        g = Gemm("g", M, K, N)
        nbytes = elem_bytes * (M * K + K * N + M * N)
        rows.append([g.flops / peak_flops, nbytes / hbm_Bps, 1.0])
        ts.append(t)
    inv_e, inv_m, overhead = _lstsq_pos(rows, ts)
    return 1.0 / max(inv_e, 1e-9), min(1.0, 1.0 / max(inv_m, 1e-9)), overhead


def attention_scores(b: int, h: int, s: int) -> float:
    tiles = s / ATTN_TILE
    return b * h * ATTN_TILE**2 * tiles * (tiles + 1) / 2


def fit_attention(samples: list[tuple[int, int, int, int, float, float]],
                  peak_flops: float) -> tuple[float, float, float]:
    """(attn_eff, attn_score_s, attn_row_s) from (b, h, s, d, forward s, forward+backward s)
    samples, by the model of fivefold.planner.compute.attention_time."""
    rows, ts = [], []
    for b, h, s, d, fwd, total in samples:
        n, r = attention_scores(b, h, s), b * h * s
        rows += [[n * 4 * d / peak_flops, n, r], [n * 14 * d / peak_flops, 3 * n, 6 * r]]
        ts += [fwd, total]
    inv_e, score, row = _lstsq_pos(rows, ts)
    return 1.0 / max(inv_e, 1e-9), score, row


def fit_h200_reference(path: str | Path) -> dict[str, float]:
    """The H200 profile's GEMM and attention terms, from h200_measured.json."""
    data = json.loads(Path(path).read_text())
    peak, hbm = 989e12, 4800e9
    gemms = [(g["M"], g["K"], g["N"], 2 * g["M"] * g["K"] * g["N"] / (g["tflops"] * 1e12))
             for g in data["gemm_table"]]
    e, m, overhead = fit_gemm(gemms, peak, hbm, 2)
    attn = []
    for a in data["attention"]:
        flops = 2 * a["b"] * a["h"] * a["s"] ** 2 * a["d"]  # the file's causal convention
        attn.append((a["b"], a["h"], a["s"], a["d"], flops / (a["fwd_tflops"] * 1e12),
                     3.5 * flops / (a["fwdbwd_tflops"] * 1e12)))
    ae, score, row = fit_attention(attn, peak)
    fp8 = data.get("fp8_gemm", [])

    def fp8_eff(column: str) -> float:  # the fp8 table's mean rate over the fp8 peak
        return sum(g[column] for g in fp8) * 1e12 / len(fp8) / 1979e12 if fp8 else float("nan")
    return {"gemm_eff": e, "gemm_mem_eff": m, "kernel_overhead_s": overhead, "attn_eff": ae,
            "attn_score_s": score, "attn_row_s": row,
            "gemm_fp8_eff": fp8_eff("fp8_tensorwise_tflops"),
            "gemm_fp8_rowwise_eff": fp8_eff("fp8_rowwise_tflops"),
            "mem_eff": data["copy_GBps_rw"] * 1e9 / hbm}




def slowed_profile(prof: HardwareProfile, k: float, why: str) -> HardwareProfile:
    """`prof` computing `k` times slower (module docstring); `why` is appended to its
    source line."""
    e = prof.eff
    eff = dataclasses.replace(e, kernel_overhead_s=e.kernel_overhead_s * k,
                              attn_score_s=e.attn_score_s * k, attn_row_s=e.attn_row_s * k,
                              masked_exp_s=e.masked_exp_s * k)
    return dataclasses.replace(prof, peak_tflops={p: v / k for p, v in prof.peak_tflops.items()},
                               hbm_GBps=prof.hbm_GBps / k, eff=eff,
                               source=f"{prof.source}; {why}")
