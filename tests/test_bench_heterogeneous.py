"""bench/heterogeneous.py: the planner side (bench/het_plan.py) gives a rank twice as fast
twice the rows and predicts the split faster than the uniform plan, and (slow) its smoke run
calibrates, plans, trains both plans and writes a consistent JSON (no timing checks)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "heterogeneous.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield importlib.import_module("heterogeneous")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_planner_splits_by_the_groups_profiles(bench, tmp_path):
    """Group `slow` is the CPU profile with its compute rates halved (as --emulate 2 makes
    it): the planner's shares are 6, 3, 3 sequences (a rank twice as fast, twice the rows,
    within one sequence), its predicted step below the uniform plan's, which the slow group
    decides."""
    import het_plan
    from fivefold.hardware import PROFILES

    cpu = PROFILES["cpu"]
    slow = het_plan.scaled_profile(cpu, 2.0)
    assert slow.peak_tflops["fp32"] == pytest.approx(cpu.peak_tflops["fp32"] / 2)
    assert slow.eff.kernel_overhead_s == pytest.approx(2 * cpu.eff.kernel_overhead_s)
    groups = [{"name": "fast", "gpus": 1, "profile": het_plan._write(cpu, tmp_path / "f.json")},
              {"name": "slow", "gpus": 2, "profile": het_plan._write(slow, tmp_path / "s.json")}]
    plan = het_plan.planned(groups, 12, "tiny", 3)
    u, p = plan["uniform"], plan["planned"]
    assert u["rows"] == [4, 4, 4] and u["kind"] == "uniform"
    assert p["kind"] == "dp-split" and sum(p["rows"]) == 12 and p["rows"][1] == p["rows"][2]
    assert abs(p["rows"][0] - 2 * p["rows"][1]) <= 1
    assert p["predicted_step_s"] < u["predicted_step_s"]
    assert u["predicted_step_s"] == pytest.approx(max(g["step_time_s"] for g in u["groups"]))


@pytest.mark.slow
def test_quick_run_writes_consistent_json(bench, tmp_path):
    out = tmp_path / "het.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    u, m = res["plans"]["uniform"], res["plans"]["planned"]
    assert u["rows"] == [4, 4, 4] and sum(m["rows"]) == 12
    assert [g["name"] for g in res["groups"]] == ["fast", "slow"]
    for p in (u, m):
        assert p["predicted_error"] == pytest.approx(p["predicted_step_s"] / p["step_s"] - 1)
    assert res["ratio"]["tokens_per_s"] == pytest.approx(m["tokens_per_s"] / u["tokens_per_s"])
    assert len(u["rounds_s"]) == len(m["rounds_s"]) == 1

