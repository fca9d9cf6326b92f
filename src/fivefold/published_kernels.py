"""Published GEMM microbenchmarks: the GEMM tables of the GPUs not measured here, with citations.

Where fivefold has no measurement of its own (h200_measured.json, `fivefold calibrate --device
cuda`), a profile's GEMM terms come from public measurements taken on that GPU, each table with
its source, date and torch version (issue 32: "published microbenchmarks with their citation";
a profile never inherits another architecture's efficiencies):

- MAMF: stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
  comparison table": per GPU the best mean (100 iterations after 50 warm-up) of a brute-force
  search over bf16 (and fp8) `torch.matmul` shapes, with that shape (M x N x K).
  A best shape is a maximum: typical training shapes run somewhat below it.
- TORCH_PERF: zzc0721/torch-performance-test-data, issues titled "新增性能数据：<GPU>": its
  test.py times `torch.matmul` of square matrices 1024..10240 (6 warm-up, 30 timed runs) per dtype.
- AO_2427: pytorch/ao PR #2427 ("add-to-benchmarks", 2025-06-23): `benchmarks/float8/
  bench_matmul.py` on an NVIDIA B200, a bf16 nn.Linear per square shape, GPU kernel time.

Each source was checked against this repository's own H200 measurements before it was used
(HOPPER_CHECKS): TORCH_PERF's H100 entry (issue #79: bf16 8192^3 at 797.5 TFLOP/s; the H200
measured 770.7), MAMF's H100 SXM best shape (794.5; the best of the H200's 35 bf16 shapes is
that 8192^3) and its H200 fp8 best shape (1453.4; the H200's best fp8 1406.1): each within
4% of ours (tests/test_kernel_tables.py holds 5%). AO_2427 has no Hopper row.

How a table becomes a profile's GEMM terms (`published_gemm_terms`), the same rule for every
GPU and no row of calibration_runs.json read: the compute term's rate (`gemm_eff`, and
`gemm_fp8_eff` from the fp8 table) is the median measured rate over peak of the table's large
GEMMs (at least LARGE_FLOPS, where a kernel's fixed costs are a few percent); every point of
the table then enters the GEMM surface (fivefold.kernel_tables.GemmSurface), so a shape near a
published one runs as published and a shape far from all of them on that roofline. Where
several sources measured one GPU, every point of each enters (no source is chosen over another).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from fivefold.kernel_tables import Efficiency, GemmSurface, gemm_surface, roofline_gemm_s

LARGE_FLOPS = 1e11  # 2MKN of a "large" GEMM: 4096^3 and up, or MAMF's best shapes
MAMF = ("stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS "
        "comparison table")
TORCH_PERF = "zzc0721/torch-performance-test-data"


@dataclass(frozen=True)
class PublishedGemms:
    """One GPU's published GEMM measurements in one dtype: (M, K, N, TFLOP/s) per shape."""

    dtype: str
    points: tuple[tuple[int, int, int, float], ...]
    source: str

    def large_rate_tflops(self) -> float:
        """The median rate of the table's large GEMMs (module docstring)."""
        return statistics.median(tf for m, k, n, tf in self.points
                                 if 2.0 * m * k * n >= LARGE_FLOPS)


def squares(sizes: tuple[int, ...], tflops: tuple[float, ...]) -> tuple:
    return tuple((s, s, s, tf) for s, tf in zip(sizes, tflops, strict=True))


# A100 SXM4: MAMF row "NVIDIA A100 SXM", 271.2 TFLOP/s bf16 at M x N x K = 1024 x 10240 x 5120,
# torch 2.6.0+cu126 (row added 2025-01-04, commit 16c2d5a; the row does not say 40 or 80 GB:
# both SXM4 parts run the same 1410 MHz tensor clock and 312 TFLOP/s peak). TORCH_PERF has only
# a PCIe A100 per size (issue #108, a lower-power board: not used) and, in its database.md,
# the best of its five squares for an "A100 SXM4 80GB" (264.5, torch 2.8.0) and an "A100 40GB"
# (246.3, torch 2.2.0) without the size: cross-checks only.
A100_BF16 = PublishedGemms("bf16", ((1024, 5120, 10240, 271.2),),
                           f"{MAMF}: NVIDIA A100 SXM, torch 2.6.0+cu126, 2025-01-04")
# V100 SXM2: TORCH_PERF issue #140 (Tesla V100-SXM2-16GB, 2026-02-14, torch 2.7.0+cu128), fp16
# (no bf16 units: the profile's 16-bit rate is fp16's). The 16 and 32 GB SXM2 parts share the
# 125 TFLOP/s peak and 900 GB/s HBM2 (NVIDIA V100 datasheet). Issue #52 (same GPU, torch 2.8.0)
# gives only its best size, 94.8, within 3% of #140's.
V100_FP16 = PublishedGemms("bf16", squares((1024, 2048, 4096, 8192, 10240),
                                           (57.30, 78.23, 95.73, 97.36, 89.37)),
                           f"{TORCH_PERF} issue #140: Tesla V100-SXM2-16GB fp16 squares, torch "
                           "2.7.0+cu128, 2026-02-14")
# B200: AO_2427's bf16 squares (its torch version not stated) and MAMF's "NVIDIA B200 SXM" row,
# 1745.0 at 1792 x 16128 x 3072 (torch 2.7.1+cu128, added 2025-07-07, commit 176443c); fp8:
# MAMF 3432.5 at 15360 x 4096 x 3072 (2025-07-09, commit 455112c). The sources differ: AO_2427's
# 4096-8192 squares run at 1.41-1.45 PFLOP/s, MAMF's best shape at 1.75 (TORCH_PERF's
# database.md: best of its squares 1.70 on a GCP a4-highgpu-8g, torch 2.8.0, size not given).
B200_BF16 = PublishedGemms(
    "bf16", squares((1024, 1536, 2048, 3072, 4096, 6144, 8192),
                    (423, 921, 1130, 1510, 1410, 1450, 1420)) + ((1792, 3072, 16128, 1745.0),),
    "pytorch/ao PR #2427 (2025-06-23): NVIDIA B200 bf16 squares 1024-8192; "
    f"{MAMF}: NVIDIA B200 SXM, torch 2.7.1+cu128, 2025-07-07")
B200_FP8 = PublishedGemms("fp8", ((15360, 3072, 4096, 3432.5),),
                          f"{MAMF}: NVIDIA B200 SXM fp8 (float8_e4m3fn), torch 2.7.1+cu128, "
                          "2025-07-09")
# GB200: measured on a GB200 itself (its own clocks and 2.5 PFLOP/s peak), MAMF row "NVIDIA GB200
# SXM", torch 2.10.0.dev20250916+cu130, added 2025-09-17 (commit 68cd2e5): bf16 1822.0 at
# 4096 x 9728 x 2048, fp8 3615.6 at 19456 x 5120 x 1536.
GB200_BF16 = PublishedGemms("bf16", ((4096, 2048, 9728, 1822.0),),
                            f"{MAMF}: NVIDIA GB200 SXM, torch 2.10.0.dev20250916+cu130, "
                            "2025-09-17")
GB200_FP8 = PublishedGemms("fp8", ((19456, 1536, 5120, 3615.6),),
                           f"{MAMF}: NVIDIA GB200 SXM fp8 (float8_e4m3fn), torch "
                           "2.10.0.dev20250916+cu130, 2025-09-17")
# The sources' Hopper figures and what h200_measured.json measured for the same quantity
# (module docstring): (quantity, published TFLOP/s, source)
HOPPER_CHECKS = (
    ("bf16 8192^3", 797.5, f"{TORCH_PERF} issue #79: H100 80GB HBM3, torch 2.7.0+cu128, "
                           "2025-10-18"),
    ("bf16 best shape", 794.5, f"{MAMF}: H100 SXM (H200 the same), torch 2.7.0, 2025-01-05"),
    ("fp8 best shape", 1453.4, f"{MAMF}: H200 SXM fp8, torch 2.7.1, 2025-07-08"),
)


def published_gemm_terms(tables: tuple[PublishedGemms, ...], peak_tflops: dict[str, float],
                         hbm_GBps: float, base: Efficiency
                         ) -> tuple[Efficiency, dict[str, GemmSurface]]:
    """`base` with gemm_eff (and gemm_fp8_eff) read from `tables`, and a GEMM surface per
    table, read against the resulting roofline. Without an fp8 table fp8 runs at the 16-bit
    rate (no fp8 units)."""
    by_dtype = {t.dtype: t for t in tables}
    bf16 = by_dtype["bf16"].large_rate_tflops() / peak_tflops["bf16"]
    fp8 = (by_dtype["fp8"].large_rate_tflops() / peak_tflops["fp8"] if "fp8" in by_dtype
           else bf16)
    eff = dataclasses.replace(base, gemm_eff=bf16, gemm_fp8_eff=fp8)
    surfaces = {}
    for t in tables:
        peak = peak_tflops[t.dtype] * 1e12

        def model_s(m, k, n, peak=peak, fp8=t.dtype == "fp8"):
            return roofline_gemm_s(m, k, n, peak, hbm_GBps * 1e9, eff, 2, fp8)
        samples = [(m, k, n, 2.0 * m * k * n / (tf * 1e12)) for m, k, n, tf in t.points]
        surfaces[t.dtype] = gemm_surface(samples, model_s, t.source)
    return eff, surfaces
