"""Smoke test of bench/data_parallel.py: fivefold's four stages and PyTorch's DDP and FSDP2 run on
2 gloo ranks each, and the JSON is consistent (no timing checks; DeepSpeed is left out for
speed, and the deselected sides must be reported as not run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import load_config
from fivefold.models.llama import Transformer

# the bench's quick run on two ranks (about a minute on 2 cores): a smoke check of the bench
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "data_parallel.py"
SIDES = ["fivefold-0", "fivefold-1", "fivefold-2", "fivefold-3", "torch-ddp", "torch-fsdp2"]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "dp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--sides", ",".join(SIDES),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tokens/s" in proc.stdout
    return json.loads(out.read_text())


def test_every_chosen_side_ran_on_two_ranks(result):
    assert list(result["sides"]) == SIDES and result["skipped"] == {}
    c = result["config"]
    assert (c["nproc"], c["global_batch"], c["seq_len"], c["timed_steps"], c["rounds"]) == \
        (2, 8, 256, 2, 1)
    for side in result["sides"].values():
        assert len(side["tokens_per_s_rounds"]) == 1 and side["tokens_per_s"] > 0
        assert len(side["peak_rss_mib_per_rank"]) == 2
        assert side["peak_rss_mib"] == max(side["peak_rss_mib_per_rank"])
        growth = [p - b for p, b in zip(side["peak_rss_mib_per_rank"],
                                        side["base_rss_mib_per_rank"])]
        assert side["rss_growth_mib"] == max(growth) > 0
    for key in ("processor", "cpu_count", "torch", "date", "load_average"):
        assert key in result["machine"]


def test_ratios_are_the_quotients_of_the_matching_stage(result):
    sides, ratios = result["sides"], result["ratios"]
    assert {k: v["reference"] for k, v in ratios.items()} == {"torch-ddp": "fivefold-0",
                                                               "torch-fsdp2": "fivefold-3"}
    for peer, r in ratios.items():
        p, f = sides[peer], sides[r["reference"]]
        assert r["tokens_per_s"] == pytest.approx(p["tokens_per_s"] / f["tokens_per_s"],
                                                  rel=1e-12)
        assert r["peak_rss"] == pytest.approx(p["peak_rss_mib"] / f["peak_rss_mib"], rel=1e-12)
        assert r["rss_growth"] == pytest.approx(p["rss_growth_mib"] / f["rss_growth_mib"],
                                                rel=1e-12)


def test_fivefold_sides_report_the_zero_model_state_bytes(result):
    """fp32 AdamW on 2 ranks: params 4Ψ, grads 4Ψ, moments 8Ψ, halved stage by stage (the
    tiny preset's units hold even parameter counts, so no shard is padded)."""
    model = Transformer(load_config(None, ['model.preset="tiny"']).model)
    psi = sum(p.numel() for p in model.parameters())
    assert psi == 5_048_576
    expected = {0: (4, 4, 8), 1: (4, 4, 4), 2: (4, 2, 4), 3: (2, 2, 4)}
    for stage, (params, grads, optimizer) in expected.items():
        state = result["sides"][f"fivefold-{stage}"]["model_state_bytes"]
        assert (state["params"], state["grads"], state["optimizer"]) == \
            (params * psi, grads * psi, optimizer * psi)
