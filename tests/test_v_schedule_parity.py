"""ZB-V and DualPipe-V (fivefold.parallel.pipeline.schedules_v) against one process, on gloo ranks.

Each layout trains 3 optimizer steps of the tiny model (dense, or MoE with 8 experts, top-2
and the balancing loss) through `Trainer.train_step` on global batches of 8 sequences; the
reference is the single-process Trainer on the same config (the same micro-batches, so the
MoE capacity and balancing groups agree). Tolerances are tests/parity.py's fp32-on-CPU ones
at lr 1e-3: losses rel 1e-5, every parameter (gathered over the stages, dp shards and ep)
atol 1e-5 + rtol 1e-4. The V placement moves the head to pp rank 0, next to the embedding,
the tied matrix is lent through the rank's own mailbox, and the backward is split into I and
W passes: the math is the same, only the order of float additions changes.

On the same steps every rank's ledger equals `predict_ledger` of the config exactly, but for
the two all-to-alls whose size the routing decides (exact summed over the ranks, as in
tests/test_planner_ledger.py). Ranks start once per group of layouts; all but two pp 2
layouts are marked slow (several minutes on 2 shared cores).
"""

from __future__ import annotations

import pytest

from fivefold.config import load_config
from parity import MOE_ROUTED, assert_layouts_match_one_process

STEPS = 3
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01"]


def v(schedule: str, pp: int, micro: int, *extra: str) -> list[str]:
    return [f"parallel.schedule={schedule}", f"parallel.pp={pp}", "parallel.vpp=2",
            f"parallel.micro_batch={micro}", *extra]


TIED, UNTIED = "model.tied_embeddings=true", "model.tied_embeddings=false"
L4, L8 = "model.layers=4", "model.layers=8"
LAYOUTS = {  # group (world size, and "slow" for the long ones) -> (overrides, label)
    2: [(v("zbv", 2, 1, L4, TIED), "zbv pp2 dense tied, 8 micro-batches"),
        (v("dualpipev", 2, 1, L4, TIED, *MOE), "dualpipev pp2 MoE tied")],
    "2 slow": [(v("dualpipev", 2, 1, L4, UNTIED), "dualpipev pp2 dense untied, 8 micro-batches"),
               (v("zbv", 2, 2, L4, *MOE), "zbv pp2 MoE")],
    "4 dense": [(v("zbv", 4, 1, L8, TIED), "zbv pp4 dense tied"),
                (v("dualpipev", 4, 1, L8, UNTIED), "dualpipev pp4 dense untied")],
    "4 moe": [(v("dualpipev", 4, 1, L8, *MOE), "dualpipev pp4 MoE"),
        (v("zbv", 2, 1, L4, *MOE, "parallel.ep=2", "parallel.zero_stage=1"),
         "zbv pp2 x ep2 MoE, ZeRO-1"),
        (v("dualpipev", 2, 1, L4, TIED, *MOE, "parallel.ep=2", "parallel.zero_stage=0"),
         "dualpipev pp2 x ep2 MoE tied, DDP")],
    8: [(v("dualpipev", 4, 1, L8, *MOE, "parallel.ep=2", "parallel.zero_stage=1"),
         "dualpipev pp4 x ep2 MoE, ZeRO-1"),
        (v("zbv", 4, 1, L8, TIED, *MOE, "parallel.ep=2", "parallel.zero_stage=1"),
         "zbv pp4 x ep2 MoE tied, ZeRO-1")],
}


@pytest.fixture(scope="module")
def base(parity_overrides) -> list[str]:
    return parity_overrides + [f"train.steps={STEPS}"]


def _check(group, base: list[str], tmp_path) -> None:
    world = int(str(group).split()[0])
    assert_layouts_match_one_process(world, base, LAYOUTS[group], tmp_path, STEPS, MOE_ROUTED)


SLOW = [pytest.mark.slow, pytest.mark.timeout(2400)]  # minutes on 2 shared cores


@pytest.mark.parametrize("group", [2, pytest.param("2 slow", marks=SLOW),
                                   pytest.param("4 dense", marks=SLOW),
                                   pytest.param("4 moe", marks=SLOW)])
def test_v_schedules_match_one_process_and_the_ledger(group, base, tmp_path):
    """pp 2 (dense ZB-V tied, MoE DualPipe-V tied; slow: dense DualPipe-V untied, MoE ZB-V)
    and, slow, pp 4 dense and MoE and pp 2 x dp 2 with ep 2 (DDP, ZeRO-1): losses,
    parameters and every rank's ledger."""
    _check(group, base, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_v_schedules_pp4_with_ep2_match_one_process_and_the_ledger(base, tmp_path):
    """pp 4 x dp 2 with ep 2 on 8 ranks, both V schedules."""
    _check(8, base, tmp_path)


def test_zero_bubble_split_gives_moe_layers_their_gradients():
    """I then W (one rank, MoE blocks with the balancing loss) accumulates the gradients of B,
    the router's included (which a W could not compute: the layer applies the router's weight
    itself), to float rounding."""
    import torch

    from fivefold.comm import collectives as C
    from fivefold.comm.ledger import Ledger
    from fivefold.parallel.pipeline.build import build_pipeline_stage
    from fivefold.parallel.pipeline.executor import PipelineEngine
    from fivefold.parallel.pipeline.schedules import build_schedule
    from fivefold.parallel.plan import plan_from_config

    cfg = load_config(None, ["model.hidden=64", "model.heads=4", "model.kv_heads=2",
                             "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32",
                             "model.layers=2", "parallel.micro_batch=2", *MOE])
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for name in ("1f1b", "zb"):
        stage = build_pipeline_stage(cfg, plan_from_config(cfg, 1), 0, torch.device("cpu"))
        axis = C.Axis("pp", None, 1, 0, Ledger())
        PipelineEngine(stage, build_schedule(name, 1, 2), axis).train_step(
            tokens[:, :-1], tokens[:, 1:], 1e-2)
        grads.append({n: q.grad for n, q in stage.named_parameters()})
    assert any("router" in n for n in grads[0])
    for name, g in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-7, rtol=1e-5, msg=name)
