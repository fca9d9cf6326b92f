"""ZeRO++'s hpZ (arXiv 2306.10209, Sec. 3.2) under a pipeline schedule, against one process.

pp 2 x dp 2 with ZeRO-3 and hpZ on 4 gloo ranks, cluster.gpus_per_node = 2 (each shard group's
backward all-gathers run on its own intra-node subgroup, "dp_shard.intra"), trains 5 steps
under interleaved 1F1B (vpp 2; 4 micro-batches per step, so forwards and backwards of other
micro-batches fall between a block's first forward and its last backward). Slow: the same
under 1F1B, ZB (its I and W passes), GPipe and 1F1B with full recomputation, and pp 2 x dp 4
on 8 ranks under 1F1B, where the node group (2 ranks) is half the shard group. hpZ changes no
arithmetic (the node-local copy holds the very values the forward gathered), so the tolerances
are tests/test_pipeline_parity.py's: losses rel 2e-5, parameters atol 1e-5 + rtol 1e-4
(tests/parity.py). Every rank's ledger of the first step equals `predict_ledger`: every
backward gather of a block (ledger_pipeline.zero3_block_gathers) runs inside the node, which
holds only when the secondary shard lives from the step's first forward of the block to its
last backward (fivefold.parallel.grad_sync.GatherAndFree).
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from parity import CPU, STEPS, assert_ledgers_predicted, assert_params_close, full_parameters

HPZ = ["parallel.pp=2", "parallel.zero_stage=3", "parallel.hpz=true",
       "cluster.gpus_per_node=2", "parallel.micro_batch=1"]  # 4 micro-batches per dp rank
INTERLEAVED = [["parallel.schedule=interleaved", "parallel.vpp=2"]]
MORE_SCHEDULES = [["parallel.schedule=1f1b"], ["parallel.schedule=zb"], ["parallel.schedule=gpipe"],
                  ["parallel.schedule=1f1b", "parallel.recompute=full"]]


def _train(rt, sets: list[str]) -> dict:
    """5 steps: losses, whole parameters, the first step's ledger."""
    trainer = Trainer(load_config(None, sets), rt, "unused")
    losses = [trainer.train_step(0).loss]
    ledger = (trainer.ledger.totals("bytes"), trainer.ledger.totals("wire_bytes"),
              trainer.ledger.model_state_bytes)
    losses += [trainer.train_step(s).loss for s in range(1, STEPS)]
    return {"losses": losses, "params": full_parameters(trainer), "ledger": ledger}


def _layouts(rt, layouts: list[list[str]]) -> list[dict]:
    return [_train(rt, sets) for sets in layouts]


def _check(base: list[str], world: int, schedules: list[list[str]]) -> None:
    ref = _train(CPU, base)
    layouts = [base + HPZ + s for s in schedules]
    per_rank = run_on_ranks(_layouts, world, layouts, timeout_s=600)
    for i, sets in enumerate(layouts):
        label = f"{world} ranks " + " ".join(schedules[i])
        last_stage = per_rank[-1][i]  # the loss is the last stage's
        torch.testing.assert_close(last_stage["losses"], ref["losses"], rtol=2e-5, atol=0,
                                   msg=label)
        params = {}
        for rank in per_rank:
            params.update(rank[i]["params"])
        assert params.keys() == ref["params"].keys(), label
        assert_params_close(params, ref["params"], label)
        cfg = load_config(None, sets)
        plan = training_plan(cfg, world, "cpu")
        assert_ledgers_predicted([predict_ledger(cfg, plan, rank=r) for r in range(world)],
                                 [rank[i]["ledger"] for rank in per_rank], (), label)
        used = {d for rank in per_rank for _, d, _ in rank[i]["ledger"][0]}
        assert "dp_shard.intra" in used, (label, used)


def test_pp2_dp2_zero3_hpz_matches_one_process(parity_overrides):
    _check(parity_overrides + ["model.layers=4"], 4, INTERLEAVED)


@pytest.mark.slow
def test_pp2_dp2_zero3_hpz_other_schedules_match_one_process(parity_overrides):
    _check(parity_overrides + ["model.layers=4"], 4, MORE_SCHEDULES)


@pytest.mark.slow
def test_pp2_dp4_zero3_hpz_matches_one_process(parity_overrides):
    _check(parity_overrides + ["model.layers=4"], 8, [["parallel.schedule=1f1b"]])
