"""Hardware profiles from measurements: the H200 profile as the fit of its measurements, the
fits on synthetic timings, a time-sliced CPU, calibrate's interleaved sweeps and the
profile file's round trip. Tolerances are stated per test.
"""

from __future__ import annotations

import json

import pytest

from fivefold.hardware import PROFILES, load_profile, profile_from_dict
from fivefold.planner import calibrate as cal
from fivefold.planner import calibrate_fit

H100 = PROFILES["H100-SXM"]


def test_h200_profile_is_the_fit_of_its_measurements():
    from pathlib import Path

    ref = Path(__file__).resolve().parents[1] / "docs/reference/h200_measured.json"
    fit = calibrate_fit.fit_h200_reference(ref)
    e = PROFILES["H200"].eff
    for key in ("gemm_eff", "attn_eff", "gemm_fp8_eff", "gemm_fp8_rowwise_eff", "mem_eff"):
        assert getattr(e, key) == pytest.approx(fit[key], rel=0.01), key


# ------------------------------------------------------------------ calibrate

def test_fits_recover_known_efficiencies():
    peak, hbm = 100e12, 1e12
    truth = (0.7, 0.8, 5e-6)
    samples = [(M, K, N, 2 * M * K * N / (peak * truth[0]) + 2 * (M * K + K * N + M * N)
                / (hbm * truth[1]) + truth[2])
               for M, K, N in [(512, 512, 512), (4096, 1024, 256), (8192, 8192, 8192),
                               (1024, 4096, 4096)]]
    assert calibrate_fit.fit_gemm(samples, peak, hbm, 2) == pytest.approx(truth, rel=1e-6)
    attn = []
    for b, h, s, d in [(1, 8, 1024, 64), (2, 16, 4096, 128), (1, 4, 16384, 128)]:
        n, rows = calibrate_fit.attention_scores(b, h, s), b * h * s
        fwd = n * 4 * d / (peak * 0.6) + n * 1e-15 + rows * 2e-10
        total = fwd + n * 10 * d / (peak * 0.6) + 2 * n * 1e-15 + 5 * rows * 2e-10
        attn.append((b, h, s, d, fwd, total))
    assert calibrate_fit.fit_attention(attn, peak) == pytest.approx((0.6, 1e-15, 2e-10), rel=1e-6)


def test_a_time_sliced_cpu_is_priced_at_the_share_of_its_core_it_held():
    """Probes timed in CPU time say what a rank computes while it runs; a rank that held
    half its core over the sweeps (cpu_share 0.5) sustains half those rates: every compute
    rate halves and every per-operation time doubles; host tier and links as measured."""
    peak = 50e9
    gemms = [(M, K, N, 2 * M * K * N / peak + 1e-5)
             for M, K, N in [(256, 256, 256), (1024, 1024, 1024), (512, 256, 8192)]]
    attn = [(1, 8, 512, 32, 1e-3, 3e-3), (2, 4, 256, 32, 4e-4, 1.3e-3)]
    m = {"device": "cpu", "threads": 1, "elem_bytes": 4, "gemms": gemms, "attention": attn,
         "copy_Bps": 10e9, "op_overhead_s": 2e-6, "masked_exp_s": 1e-9,
         "host_copy_Bps": 10e9, "host_link_Bps": 5e9, "adam_elems_per_s": 1e8,
         "adam_fused_elems_per_s": None}
    args = (None, 1 << 30, 2, 1 << 30, (1e9, 1e9))
    whole = cal.profile_from_measurements("cpu", {**m, "cpu_share": 1.0}, *args)
    half = cal.profile_from_measurements("cpu", {**m, "cpu_share": 0.5}, *args)
    assert half.peak_tflops["fp32"] == pytest.approx(whole.peak_tflops["fp32"] / 2)
    assert half.hbm_GBps == pytest.approx(whole.hbm_GBps / 2)
    for term in ("kernel_overhead_s", "attn_score_s", "attn_row_s", "masked_exp_s"):
        assert getattr(half.eff, term) == pytest.approx(2 * getattr(whole.eff, term))
    assert half.host == whole.host and half.intra_node_GBps == whole.intra_node_GBps
    assert "x 0.50" in half.source


def test_calibration_sweeps_interleave_the_probes_and_run_each_ones_preparation(monkeypatch):
    """`_sweeps`: every probe once per sweep, in turn; its value the median over the sweeps
    of its timed call; a probe's `before` (the GEMMs' cache eviction) runs ahead of each
    timed call, never timed."""
    clock, log = [0.0], []
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    gemm_s = iter([9.0, 3.0, 9.0, 1.0, 9.0, 2.0])  # (warm-up, timed) per sweep

    def probe(name, seconds):
        def fn():
            log.append(name)
            clock[0] += next(seconds) if name == "gemm" else seconds

        return fn

    def evict():
        log.append("evict")
        clock[0] += 100.0

    probes = {("gemm", 8, 8, 8): (probe("gemm", gemm_s), evict),
              "copy": (probe("copy", 0.5), None)}
    t = cal._sweeps(probes, lambda: None, repeat=1, passes=3)
    assert t == {("gemm", 8, 8, 8): 2.0, "copy": 0.5}
    assert log == ["gemm", "evict", "gemm", "copy", "copy"] * 3


def test_profile_file_round_trip(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(H100.to_dict()))
    assert load_profile(str(path)) == H100
    assert profile_from_dict(H100.to_dict()) == H100


# ------------------------------------------------------------------ CLI and bad input
