"""Smoke test of bench/gpu_llama1b.py on the CPU (`--tiny`): it runs both sides and its JSON is
consistent; and without transformers it still measures fivefold and says why the baseline is
missing. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_llama1b.py"


def run_tiny(tmp_path: Path, env: dict | None = None) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "2", "--warmup", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "tokens/s" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def test_tiny_bench_both_sides(tmp_path):
    pytest.importorskip("transformers")
    res, _ = run_tiny(tmp_path)
    f, h, c = res["fivefold"], res["transformers"], res["config"]
    assert c["tokens_per_step"] == 2 * 64 and c["steps"] == 2 and c["device"] == "cpu"
    for side in (f, h):
        assert side["tokens_per_s"] > 0 and len(side["step_s"]) == 2
        assert side["tokens_per_s"] == pytest.approx(2 * 128 / sum(side["step_s"]), rel=1e-12)
        assert side["mfu"] == pytest.approx(c["flops_per_token"] * side["tokens_per_s"]
                                            / c["peak_flops"], rel=1e-12)
        assert side["peak_mem_bytes"] > 0 and side["peak_mem_kind"] == "cpu_max_rss"
        assert 5.0 < side["first_loss"] < 7.5  # about ln(512) = 6.24 at initialization
    assert f["params"] == h["params"]  # the same model on both sides
    assert res["ratio"]["tokens_per_s"] == pytest.approx(f["tokens_per_s"] / h["tokens_per_s"],
                                                         rel=1e-12)
    assert res["ratio"]["peak_mem"] == pytest.approx(f["peak_mem_bytes"] / h["peak_mem_bytes"],
                                                     rel=1e-12)
    assert res["machine"]["torch"] and res["machine"]["transformers"]


def test_without_transformers_fivefold_is_still_measured(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "transformers").mkdir(parents=True)
    (shadow / "transformers" / "__init__.py").write_text(
        "raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT / "src")])}
    res, stdout = run_tiny(tmp_path, env)
    assert res["fivefold"]["tokens_per_s"] > 0
    assert "transformers is not installed" in res["transformers"]["error"]
    assert res["ratio"] is None and res["machine"]["transformers"] is None
    assert "transformers is not installed" in stdout
