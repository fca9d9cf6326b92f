"""Smoke test of bench/muon.py: Muon under DDP and under ZeRO-1 on 4 gloo ranks, and the
JSON is consistent (no timing checks). ZeRO-1 keeps a quarter of Muon's momentum per rank
on 4 ranks (the ledger's optimizer bytes, up to the padding of the flat units)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# three starts of 4 ranks (about 4 min on 2 idle cores): a smoke check of the bench
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "muon.py"


def test_muon_bench_quick_writes_consistent_json(tmp_path):
    out = tmp_path / "muon.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tokens/s" in proc.stdout
    res = json.loads(out.read_text())
    c = res["config"]
    assert (c["nproc"], c["optimizer"], c["timed_steps"], c["rounds"]) == (4, "muon", 2, 1)
    sides = res["sides"]
    assert list(sides) == ["ddp", "zero-1"]
    for side in sides.values():
        assert len(side["tokens_per_s_rounds"]) == 1 and side["tokens_per_s"] > 0
        assert len(side["peak_rss_mib_per_rank"]) == 4
        assert side["peak_rss_mib"] == max(side["peak_rss_mib_per_rank"])
    r = res["ratios"]["zero-1"]
    assert r["tokens_per_s"] == pytest.approx(
        sides["zero-1"]["tokens_per_s"] / sides["ddp"]["tokens_per_s"], rel=1e-12)
    assert r["peak_rss"] == pytest.approx(
        sides["zero-1"]["peak_rss_mib"] / sides["ddp"]["peak_rss_mib"], rel=1e-12)
    assert r["optimizer_bytes"] == pytest.approx(0.25, rel=0.01)
    for key in ("processor", "cpu_count", "torch", "date", "load_average",
                "load_average_before"):
        assert key in res["machine"]
