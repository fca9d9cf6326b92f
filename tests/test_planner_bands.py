"""The 80% band on a predicted step time (fivefold.planner.bands): grouping, fallbacks,
widening outside the calibrated families, coverage that never uses a row's own source, and
`simulate --json` / `plan --json` carrying `step_time_band_s`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.planner import bands


def row(gpu: str, stack: str, published: float, moe: bool = False, release: str | None = None,
        rid: str = "r") -> dict:
    train = {"stack": stack, **({"stack_release": release} if release else {})}
    model = {"layers": 2, **({"moe": {"experts": 8}} if moe else {})}
    return {"id": rid, "spec": {"model": model, "cluster": {"gpu": gpu}, "train": train},
            "published": {"step_time_s": published}}


def test_quantile_is_numpys_linear_interpolation():
    xs = [0.3, -0.1, 0.05, 0.2, -0.4, 0.0, 0.12]
    for q in (0.1, 0.5, 0.9):
        assert bands.quantile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)),
                                                      abs=1e-12)


def test_a_small_group_falls_back_to_a_wider_pool():
    residuals = [(("hopper", "dense", "megatron"), 0.01 * i) for i in range(10)]
    residuals += [(("blackwell", "dense", "megatron"), 0.5)] * 3  # 3 < MIN_ROWS rows
    groups = bands.group_bands(residuals)
    assert groups["hopper|dense|megatron"]["rows"] == 10
    key, _, _ = bands.pick(groups, ("blackwell", "dense", "megatron"), True)
    assert key == "*|dense|megatron"  # 13 rows
    key, lo, hi = bands.pick(groups, ("hopper", "dense", "megatron"), True)
    assert key == "hopper|dense|megatron"
    assert (lo, hi) == pytest.approx((0.009, 0.081))  # 10th, 90th percentile of 0..0.09


def test_outside_the_calibrated_families_the_band_widens():
    runs = [row("H100-SXM", "megatron", 1.0 + 0.02 * i, release="2024-07") for i in range(10)]
    table = bands.band_table(runs, [1.0] * 10, "test")
    fam = ("hopper", "dense", "megatron")
    assert bands.is_calibrated(table, fam, "2024-07")
    assert not bands.is_calibrated(table, fam, "2021-04")  # release before every row
    assert not bands.is_calibrated(table, ("volta", "dense", "megatron"), None)
    assert not bands.is_calibrated(table, ("hopper", "dense", "fivefold"), None)
    _, lo, hi = bands.pick(table["groups"], fam, True)
    _, wlo, whi = bands.pick(table["groups"], fam, False)
    assert whi - wlo >= bands.WIDEN * (hi - max(lo, 0.0)) - 1e-12


def test_coverage_builds_each_band_without_its_own_source():
    # source "a" is predicted 2x too slow, every other row exactly: a band built from the
    # other sources is tight around 0 and cannot hold "a"; a band that used "a" would
    runs = [row("H100-SXM", "megatron", 1.0, rid=f"b{i}") for i in range(12)]
    runs += [row("H100-SXM", "megatron", 1.0, rid=f"a{i}") for i in range(3)]
    held = [1.0 + 0.001 * i for i in range(12)] + [2.0] * 3
    sources = ["b"] * 12 + ["a"] * 3
    share, width, got = bands.coverage(runs, held, sources)
    assert all(not lo <= 1.0 <= hi for lo, hi in got[12:])
    assert share <= 12 / 15
    assert width < 0.05  # the b rows' residuals span 1.1%


def test_the_table_gives_a_band_around_the_point_estimate(tmp_path, monkeypatch):
    runs = [row("H100-SXM", "megatron", 1.0 * math.exp(0.01 * (i - 5)), release="2024-07")
            for i in range(11)]
    table = bands.band_table(runs, [1.0] * 11, "fivefold plan validate --cross")
    assert table["command"] == "fivefold plan validate --cross" and table["date"]
    path = tmp_path / "band_table.json"
    bands.write_table(table, path)
    assert bands.read_table(path) == table
    monkeypatch.setattr(bands, "TABLE", path)

    from fivefold.planner.spec import spec_config
    cfg = spec_config({"model": {"preset": "8B"}, "cluster": {"gpu": "H100-SXM", "gpus": 64},
                       "parallel": {"global_batch": 128},
                       "train": {"stack": "megatron", "stack_release": "2024-07"}})
    (lo, hi), key = bands.step_time_band(cfg, 10.0)
    assert key == "hopper|dense|megatron"
    assert lo == pytest.approx(10 * math.exp(-0.04)) and hi == pytest.approx(10 * math.exp(0.04))


def test_simulate_and_plan_json_carry_the_band(tmp_path, monkeypatch, capsys):
    runs = [row("H100-SXM", "fivefold", 1.0 * math.exp(0.02 * (i - 5))) for i in range(11)]
    path = tmp_path / "band_table.json"
    bands.write_table(bands.band_table(runs, [1.0] * 11, "test"), path)
    monkeypatch.setattr(bands, "TABLE", path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"preset": "tiny"},
                                "cluster": {"gpu": "H100-SXM", "gpus": 8},
                                "parallel": {"global_batch": 8}}))
    assert main(["simulate", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lo, hi = out["step_time_band_s"]
    assert lo < out["step_time_s"] < hi
    assert main(["simulate", str(spec)]) == 0
    assert "80% band" in capsys.readouterr().out
    assert main(["plan", str(spec), "--json", "--top", "2"]) == 0
    for est in json.loads(capsys.readouterr().out):
        lo, hi = est["step_time_band_s"]
        assert lo < est["step_time_s"] < hi


def test_a_profile_without_kernel_measurements_widens_its_band():
    """B200 and GB200 (architecture blackwell, read from the profile, not its name) have no
    measured GEMM tables: their group's band, each side's log width doubled (WIDEN)."""
    runs = [row(gpu, "megatron", 1.0 * math.exp(0.02 * (i - 5)), release="2025-11")
            for gpu in ("B200", "H100-SXM") for i in range(11)]
    table = bands.band_table(runs, [1.0] * len(runs), "test")
    assert bands.architecture_family("GB200") == "blackwell"
    assert not bands.kernels_measured("B200") and bands.kernels_measured("H100-SXM")
    fam = ("blackwell", "dense", "megatron")
    key, lo, hi = bands.pick(table["groups"], fam, True, measured=True)
    wkey, wlo, whi = bands.pick(table["groups"], fam, True, measured=False)
    assert key == "blackwell|dense|megatron" and wkey.startswith(key) and "no kernel" in wkey
    assert (wlo, whi) == pytest.approx((bands.WIDEN * lo, bands.WIDEN * hi))
