"""Expert tensor parallelism halves each rank's expert model state and expert FLOPs
(fivefold.expert_grid, fivefold.parallel.expert_tensor), in the ledger's model-state bytes
and in a FLOP count.

The comparison is MoE Parallel Folding's (arXiv 2504.14960, Sec. 3): the same ep and the same
global batch, etp 2 x ep 2 on 4 ranks against ep 2 on 2 ranks, so each etp group computes
what one ep rank of the etp 1 layout computes, split in two. The tiny MoE of
tests/test_expert_tensor.py (8 experts of width 32, top-2, both blocks MoE, a shared expert).

- Planner, default suite: `predict_ledger`'s model-state bytes per rank (params, grads,
  master, optimizer: what the engine records, fivefold.parallel.data_parallel
  `record_model_state`), the expert units' part (fivefold.planner.memory `stage_units`)
  exactly half under etp 2, at ZeRO 0 and 1, with the etp ranks over dp or over tp.
- Runtime, slow (a 2-rank and a 4-rank process start, one step each, ZeRO 0, dp only so that
  the dense units are the same in both): every rank's recorded model-state bytes equal the
  prediction, so the recorded totals differ by exactly half the etp 1 expert part; and
  FlopCounterMode around a forward and backward of the rank's experts on the rows they got
  (the SwiGLU in its "loop" form, which the counter sees) counts exactly half the FLOPs of the
  matching etp 1 ep rank. Routing at step 0 is the same in both layouts (the same tokens and
  weights), so the rows are; the counts are integers and compared exactly.
"""

from __future__ import annotations

import pytest

from fivefold.config import load_config
from fivefold.parallel.plan import plan_from_config, training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.ledger_pipeline import stage_layers_of_rank
from fivefold.planner.memory import model_state_bytes, stage_units
from fivefold.testing import run_on_ranks
from fivefold.train.dist import Runtime
from test_expert_tensor import SETS, counted_expert_step

STATE_KEYS = ("params", "grads", "master", "optimizer", "total")
EP2 = ["parallel.ep=2"]  # on 2 ranks
ETP2_EP2 = ["parallel.etp=2", "parallel.ep=2"]  # on 4 ranks


@pytest.fixture(scope="module")
def sets(parity_overrides):
    return parity_overrides + SETS


def expert_state_bytes(cfg, plan, rank: int) -> dict[str, int]:
    """The planner's model-state bytes of rank `rank`'s expert units alone."""
    layers, first, last = stage_layers_of_rank(cfg, plan, plan.pp_rank_of(rank))
    units = [u for u in stage_units(cfg.model, plan, layers, first, last, etp=plan.etp)
             if u.expert]
    assert units, "the experts are units of their own on the experts' grid"
    return model_state_bytes(units, plan)


@pytest.mark.parametrize("extra", [[], ["parallel.zero_stage=1"]], ids=["zero0", "zero1"])
@pytest.mark.parametrize("etp_over", [[], ["parallel.tp=2"]], ids=["over dp", "over tp"])
def test_the_planner_halves_each_ranks_expert_model_state(sets, extra, etp_over):
    """predict_ledger's model-state bytes: the expert units' part of every rank of etp 2 x
    ep 2 on 4 ranks is exactly half that of ep 2 on 2 ranks, in every entry."""
    one = load_config(None, sets + EP2 + extra)
    two = load_config(None, sets + ETP2_EP2 + etp_over + extra)
    plan_one, plan_two = plan_from_config(one, 2, "fp32"), plan_from_config(two, 4, "fp32")
    whole = expert_state_bytes(one, plan_one, 0)
    assert whole["total"] > 0
    for rank in range(4):
        half = expert_state_bytes(two, plan_two, rank)
        assert {k: 2 * half[k] for k in STATE_KEYS} == {k: whole[k] for k in STATE_KEYS}, rank
        predicted = predict_ledger(two, plan_two, rank).model_state_bytes
        assert predicted["total"] > half["total"]  # the dense units besides


def expert_work(rt: Runtime, sets: list[str], run_dir: str) -> dict:
    """One step: the ledger's model-state bytes, and the FLOPs of a forward and backward of
    this rank's expert SwiGLUs (test_expert_tensor.counted_expert_step); this rank's place
    in the experts' grid."""
    trainer, flops = counted_expert_step(rt, sets, run_dir, backward=True)
    axes = trainer.expert_axes
    return {"state": trainer.ledger.model_state_bytes, "flops": flops,
            "ep_rank": axes.ep.rank, "etp_rank": axes.etp.rank}


@pytest.mark.slow
def test_etp2_halves_the_recorded_expert_model_state_and_flops(sets, tmp_path):
    """ep 2 on 2 ranks against etp 2 x ep 2 on 4 ranks (dp only, ZeRO 0): every rank's
    recorded model-state bytes are predict_ledger's; the totals differ by exactly half the
    etp 1 expert part (the dense units are the same); each etp rank's expert forward and
    backward FLOPs are exactly half its ep rank's under etp 1."""
    runs = {}
    for world, grid in ((2, EP2), (4, ETP2_EP2)):
        cfg = load_config(None, sets + grid + ["model.moe.expert_matmul='loop'"])
        plan = training_plan(cfg, world, "cpu")
        work = run_on_ranks(expert_work, world, sets + grid, str(tmp_path / str(world)),
                            timeout_s=600)
        for rank, w in enumerate(work):
            assert w["state"] == predict_ledger(cfg, plan, rank).model_state_bytes, (world, rank)
        runs[world] = (cfg, plan, work)
    cfg, plan, whole = runs[2]
    expert_whole = expert_state_bytes(cfg, plan, 0)
    by_ep = {w["ep_rank"]: w for w in whole}
    assert sorted(by_ep) == [0, 1]
    for w in runs[4][2]:
        etp1 = by_ep[w["ep_rank"]]
        for key in STATE_KEYS:
            assert 2 * (etp1["state"][key] - w["state"][key]) == expert_whole[key], key
        assert w["etp_rank"] in (0, 1)
        assert 2 * w["flops"] == etp1["flops"] > 0
