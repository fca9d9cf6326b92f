"""Kernel tables (fivefold.kernel_tables, fivefold.published_kernels): every GPU profile names
where its tables come from, no architecture holds another's efficiencies or tables, the H200
GEMM surfaces (bf16, fp8 tensorwise and rowwise) and attention terms reproduce
h200_measured.json, each published GEMM surface its source's points, rowwise fp8 GEMMs run on
the rowwise table where one was measured and on the fp8 one elsewhere, and unfused attention
is the stack's, priced from bytes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from fivefold.hardware import HOPPER, PROFILES, profile_from_dict
from fivefold.kernel_tables import (FP8_ROWWISE, H200_MEASURED, NEUTRAL, h200_gemm_samples,
                                    roofline_gemm_s)
from fivefold.planner.fitted import FITTED, in_training
from fivefold.planner.op_prices import (Gemm, attention_time, gemm_table, gemm_time,
                                        unfused_attention_time)
from fivefold.planner.fitted_to import FITTED_TO
from fivefold.published_kernels import (A100_BF16, B200_BF16, B200_FP8, GB200_BF16, GB200_FP8,
                                        HOPPER_CHECKS, V100_FP16)

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "h200_measured.json"
GPUS = {name: p for name, p in PROFILES.items() if not p.cores}
# the kernel-level terms a profile's tables set (the links' terms are fivefold.planner.fitted's)
KERNEL_TERMS = ("gemm_eff", "gemm_fp8_eff", "gemm_fp8_rowwise_eff", "gemm_mem_eff", "attn_eff",
                "attn_score_s", "attn_row_s", "mem_eff", "kernel_overhead_s")


def test_every_gpu_profile_names_its_architecture_and_kernel_source():
    for name, p in GPUS.items():
        assert p.architecture in ("ampere", "hopper", "blackwell", "volta"), name
        assert len(p.kernel_source) > 20, name
        if not p.kernels_measured:
            assert "no" in p.kernel_source and "measurements" in p.kernel_source, name
    assert {p.architecture for p in GPUS.values()} == {"ampere", "hopper", "blackwell", "volta"}
    assert PROFILES["cpu"].architecture == "cpu" and PROFILES["cpu"].kernels_measured


def copied_terms(pa, pb) -> list[str]:
    """Kernel terms of profile `pa` equal to `pb`'s, other than the declared neutral default
    (NEUTRAL) and the bounds (0: no such cost, 1: the full rate), and tables they share."""
    same = [t for t in KERNEL_TERMS if getattr(pa.eff, t) == getattr(pb.eff, t)
            and getattr(pa.eff, t) not in (0.0, 1.0, getattr(NEUTRAL, t))]
    same += [f"gemm surface {d}" for d, s in pa.gemm_surfaces.items()
             if any(s is o for o in pb.gemm_surfaces.values())]
    return same


PUBLISHED = {"A100-40GB": (A100_BF16,), "A100-80GB": (A100_BF16,), "V100-32GB": (V100_FP16,),
             "B200": (B200_BF16, B200_FP8), "GB200": (GB200_BF16, GB200_FP8)}


def test_each_published_gemm_surface_reproduces_its_source_points():
    """Every published point within 1% (the V100's 8192^3 and 10240^3, a third of an octave
    apart, share their surface: 0.7% each); the compute rate is the median large GEMM's."""
    for name, tables in PUBLISHED.items():
        prof = PROFILES[name]
        for table in tables:
            assert prof.gemm_surfaces[table.dtype].source == table.source
            assert table.source in prof.kernel_source
            for m, k, n, tflops in table.points:
                t = gemm_time(Gemm("g", m, k, n), prof, table.dtype == "fp8", 2)
                assert 2 * m * k * n / t / 1e12 == pytest.approx(tflops, rel=0.01), (name, m)
    assert PROFILES["B200"].eff.gemm_eff == pytest.approx((1420 + 1450) / 2 / 2250)
    assert PROFILES["GB200"].eff.gemm_fp8_eff == pytest.approx(3615.6 / 5000)


def test_the_published_sources_agree_with_our_h200_measurements():
    """Each source's Hopper figure within 5% of what h200_measured.json measured for it."""
    data = json.loads(H200_MEASURED.read_text())
    bf16 = [g["tflops"] for g in data["gemm_table"]] + [g["bf16_tflops"] for g in data["fp8_gemm"]]
    ours = {"bf16 8192^3": next(g["bf16_tflops"] for g in data["fp8_gemm"]
                                if g["M"] == g["K"] == g["N"] == 8192),
            "bf16 best shape": max(bf16),
            "fp8 best shape": max(g["fp8_tensorwise_tflops"] for g in data["fp8_gemm"])}
    for quantity, published, source in HOPPER_CHECKS:
        assert published == pytest.approx(ours[quantity], rel=0.05), source


def test_no_architecture_holds_another_architectures_efficiencies():
    profs = list(GPUS.values())
    for i, pa in enumerate(profs):
        for pb in profs[i + 1:]:
            if pa.architecture != pb.architecture:
                assert pa.eff is not pb.eff and not copied_terms(pa, pb), (pa.name, pb.name)
                tables = {s.source for s in pa.gemm_surfaces.values()}
                assert not tables & {s.source for s in pb.gemm_surfaces.values()}, pa.name
    # GB200 is measured on a GB200, not read from the B200's tables
    b200, gb200 = PROFILES["B200"], PROFILES["GB200"]
    assert not ({s.source for s in b200.gemm_surfaces.values()}
                & {s.source for s in gb200.gemm_surfaces.values()})
    # the check catches the copy it is for: Blackwell with Hopper's terms (as before issue 32)
    copy = dataclasses.replace(PROFILES["B200"], eff=HOPPER,
                               gemm_surfaces=PROFILES["H200"].gemm_surfaces)
    assert len(copied_terms(copy, PROFILES["H200"])) >= 5


def test_the_packaged_measurements_are_the_reference_file():
    assert json.loads(H200_MEASURED.read_text()) == json.loads(REFERENCE.read_text())


def test_the_h200_gemm_surface_reproduces_the_measured_shapes():
    """Every one of the 35 bf16 and the 5 fp8 measured shapes, tensorwise and rowwise, within
    6% (the worst, 16384 x 8192 x 32000 at 597 TFLOP/s, sits between neighbours measured at
    711-721: 5.8%), 1% on average; far from every measurement the surface is the roofline."""
    h200 = PROFILES["H200"]
    errors = []
    for table, fp8, recipe in (("bf16", False, ""), ("fp8", True, "tensorwise"),
                               (FP8_ROWWISE, True, "rowwise")):
        for m, k, n, t in h200_gemm_samples()[table]:
            errors.append(abs(gemm_time(Gemm("g", m, k, n), h200, fp8, 2, recipe) / t - 1))
    assert len(errors) == 45
    assert max(errors) < 0.06 and sum(errors) / len(errors) < 0.01
    far = Gemm("narrow", 64, 2048, 1536)  # a narrow MoE expert GEMM
    assert gemm_time(far, h200, False, 2) == pytest.approx(
        roofline_gemm_s(64, 2048, 1536, 989e12, 4800e9, h200.eff, 2, False), rel=1e-3)


def test_rowwise_fp8_gemms_are_priced_from_the_rowwise_measurements():
    """`parallel.fp8_recipe = "rowwise"`: on the Hopper profiles a GEMM is priced from
    h200_measured.json's rowwise column, its roofline at gemm_fp8_rowwise_eff (the column's
    mean rate over the fp8 peak) times the rowwise surface: at each of the 5 measured shapes
    within 1% of the measured seconds and of the measured rowwise / tensorwise ratio
    (0.89-0.99). A Blackwell profile, with no rowwise table, prices it as tensorwise (equal
    to the float) and says so in its kernel_source."""
    h200 = PROFILES["H200"]
    samples = h200_gemm_samples()
    for (m, k, n, t), (*_, t_tensor) in zip(samples[FP8_ROWWISE], samples["fp8"], strict=True):
        g, surface = Gemm("g", m, k, n), h200.gemm_surfaces[FP8_ROWWISE]
        roofline = roofline_gemm_s(m, k, n, 1979e12, 4800e9, h200.eff, 2, True, rowwise=True)
        rowwise = gemm_time(g, h200, True, 2, "rowwise")
        assert rowwise == pytest.approx(roofline * surface.factor(m, k, n), rel=1e-12)
        assert rowwise == pytest.approx(t, rel=0.01)
        assert rowwise / gemm_time(g, h200, True, 2) == pytest.approx(t / t_tensor, rel=0.01)
    assert h200.eff.gemm_fp8_rowwise_eff == pytest.approx(
        sum(2 * m * k * n / t for m, k, n, t in samples[FP8_ROWWISE]) / 5 / 1979e12, rel=1e-3)
    for name in ("H100-SXM", "H100-96GB-500W", "H800"):
        assert gemm_table(PROFILES[name], True, "rowwise", 2) == FP8_ROWWISE, name
    sustained = in_training(h200).eff  # a training step sustains the same share of it
    assert sustained.gemm_fp8_rowwise_eff == pytest.approx(0.641 * FITTED.sustained)
    g = Gemm("g", 16384, 4096, 14336)
    for name in ("B200", "GB200"):
        prof = PROFILES[name]
        assert gemm_table(prof, True, "rowwise", 2) == "fp8"
        assert gemm_time(g, prof, True, 2, "rowwise") == gemm_time(g, prof, True, 2)
        assert "rowwise" in prof.kernel_source and prof.eff.gemm_fp8_rowwise_eff is None
    assert gemm_table(h200, False, "rowwise", 2) == "bf16"  # the recipe reaches fp8 GEMMs only


def test_the_h200_attention_terms_reproduce_the_measured_sdpa_shapes():
    """Forward and forward+backward of the 4 causal SDPA shapes within 8% (the file counts
    2bhs^2d forward FLOPs and 3.5x that forward+backward)."""
    h200 = PROFILES["H200"]
    for a in json.loads(H200_MEASURED.read_text())["attention"]:
        fwd, bwd = attention_time(a["b"], a["h"], a["s"], a["d"], 1, h200)
        flops = 2 * a["b"] * a["h"] * a["s"] ** 2 * a["d"]
        assert fwd == pytest.approx(flops / (a["fwd_tflops"] * 1e12), rel=0.08)
        assert fwd + bwd == pytest.approx(3.5 * flops / (a["fwdbwd_tflops"] * 1e12), rel=0.08)


def test_unfused_attention_is_priced_from_gemm_rate_and_score_bytes():
    """Megatron-LM 2021's attention: the full s x s square, 4d / 8d FLOPs per score at the
    GEMM rate and 13 / 19 bytes per 16-bit score at the element-wise rate; on A100-80GB about
    8 ps of traffic per score forward, near the 7.8 ps once fitted to arXiv 2104.04473's rows
    (no longer a profile term: A100's attn_score_s is 0)."""
    a100 = PROFILES["A100-80GB"]
    assert a100.eff.attn_score_s == 0.0
    b, h, s, d = 2, 16, 2048, 128
    fwd, bwd = unfused_attention_time(b, h, s, d, 1, a100)
    scores = b * h * s * s
    rate, bw = 312e12 * a100.eff.gemm_eff, 2039e9 * a100.eff.mem_eff
    assert fwd == pytest.approx(scores * (4 * d / rate + 13 / bw) + 4 * a100.eff.kernel_overhead_s)
    assert bwd == pytest.approx(scores * (8 * d / rate + 19 / bw) + 6 * a100.eff.kernel_overhead_s)
    assert 13 / bw == pytest.approx(8e-12, rel=0.01)
    # A100's GEMM rate is published (MAMF), no longer fitted to those rows
    assert not any(kind == "hardware" for kind, _ in FITTED_TO)
    assert a100.eff.gemm_eff == pytest.approx(271.2 / 312)


def test_a_profile_round_trips_through_its_json_form():
    h100 = PROFILES["H100-SXM"]
    back = profile_from_dict(json.loads(json.dumps(h100.to_dict())))
    assert (back.architecture, back.kernel_source, back.kernels_measured) == (
        h100.architecture, h100.kernel_source, h100.kernels_measured)
    assert back.attention_generations == h100.attention_generations
    g = Gemm("g", 8192, 4096, 14336)
    assert gemm_time(g, back, False, 2) == pytest.approx(gemm_time(g, h100, False, 2))
    assert math.isclose(gemm_time(g, back, True, 2), gemm_time(g, h100, True, 2))
