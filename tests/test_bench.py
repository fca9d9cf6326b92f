"""Smoke test of bench/train_vs_plain.py: it runs and its JSON is consistent (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "train_vs_plain.py"


@pytest.mark.slow  # the bench's smoke run (25-75 s on 2 cores), not a correctness check
def test_bench_quick_writes_consistent_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tokens/s" in proc.stdout
    res = json.loads(out.read_text())
    f, p = res["fivefold"], res["plain"]
    assert f["tokens_per_s"] > 0 and p["tokens_per_s"] > 0
    assert res["ratio"]["tokens_per_s"] == pytest.approx(f["tokens_per_s"] / p["tokens_per_s"],
                                                         rel=1e-12)
    assert f["peak_rss_mib"] > 0 and p["peak_rss_mib"] > 0
    assert res["ratio"]["peak_rss"] == pytest.approx(f["peak_rss_mib"] / p["peak_rss_mib"],
                                                     rel=1e-12)
    assert res["config"]["timed_steps"] == 4 and res["config"]["rounds"] == 1
    for key in ("processor", "cpu_count", "torch", "date"):
        assert key in res["machine"]


def test_recompute_bench_quick_writes_consistent_json(tmp_path):
    """bench/recompute.py: the counted per-block saved bytes equal the planner's on every
    side, full recomputation keeps far less and selective less; the ratios are those of
    the sides."""
    out = tmp_path / "recompute.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "recompute.py"), "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for mode in ("none", "full", "selective"):
        blocks = [v for k, v in res[mode]["saved_bytes"].items() if k != "root"]
        assert blocks == [res[mode]["predicted"]["block_bytes"]] * len(blocks), mode
    saved = {mode: res[mode]["saved_bytes"]["layers.0"] for mode in ("none", "full", "selective")}
    assert saved["full"] * 10 < saved["none"] and saved["full"] < saved["selective"] < saved["none"]
    for mode in ("full", "selective"):
        assert res["ratio"][mode]["s_per_step"] == pytest.approx(
            res[mode]["s_per_step"] / res["none"]["s_per_step"], rel=1e-12)


@pytest.mark.slow  # about 90 s on 2 cores: the bench's smoke run, not a correctness check
def test_context_parallel_bench_quick_writes_consistent_json(tmp_path):
    """bench/context_parallel.py: per-rank saved bytes fall with cp and stay within 5% of the
    planner's count; each speed row's ratio is its rate over dp 4's (no timing checks)."""
    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "context_parallel.py"),
                           "--quick", "--json", str(out), "--run-dir", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    measured = {(r["cp"], r["seq_len"]): r for r in res["memory"] if r.get("trained")}
    for (cp, seq_len), row in measured.items():
        assert row["saved_mib"] == pytest.approx(row["predicted_mib"], rel=0.05), (cp, seq_len)
        if cp > 1:
            assert row["saved_mib"] < measured[(1, seq_len)]["saved_mib"] / cp * 1.05
    base = next(r for r in res["speed"] if r["side"] == "dp 4")["tokens_per_s"]
    for row in res["speed"]:
        assert row["ratio_to_dp4"] == pytest.approx(row["tokens_per_s"] / base, rel=1e-12)
