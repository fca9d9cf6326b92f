"""bench/heterogeneous.py: the rows it gives each rank balance the predicted compute time,
and (slow) its smoke run trains both plans and writes a consistent JSON (no timing checks)."""

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


def test_rows_follow_the_measured_speeds(bench):
    """A rank twice as fast gets twice the rows; equal speeds the even split; the shares are
    the rows over their common divisor."""
    assert bench.best_rows([2.0, 1.0, 1.0], 12) == [6, 3, 3]
    assert bench.best_rows([1.0, 1.0, 1.0], 12) == [4, 4, 4]
    assert bench.best_rows([3.0, 1.0], 8) == [6, 2]
    assert bench.best_rows([1.0, 1.05, 0.95], 12) == [4, 4, 4]  # near-equal speeds: even
    assert bench.shares_of([6, 3, 3]) == [2, 1, 1]


@pytest.mark.slow
def test_quick_run_writes_consistent_json(bench, tmp_path):
    out = tmp_path / "het.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    u, m = res["plans"]["uniform"], res["plans"]["matched"]
    assert u["rows"] == [4, 4, 4] and sum(m["rows"]) == 12
    assert m["rows"] == bench.best_rows(res["speed_seq_per_s"], 12)
    assert res["ratio"]["tokens_per_s"] == pytest.approx(m["tokens_per_s"] / u["tokens_per_s"])
    assert len(u["rounds_s"]) == len(m["rounds_s"]) == 1

