"""Expert parallelism (fivefold.parallel.expert) against one process, on gloo ranks.

Each layout trains the tiny MoE (8 experts, top-2, both blocks MoE, the load-balancing loss
on) for 5 steps on global batches of 8 sequences in micro-batches of 2, the same
micro-batches as the one-process reference, so capacity and balancing groups agree; losses
and every parameter (experts gathered over ep) are compared at the fp32-on-CPU tolerances of
tests/parity.py (atol 1e-5 + rtol 1e-4 on parameters; losses rtol 1e-5). Capacity mode must
drop exactly the assignments the one-process run drops (equal integer counts per layer and
step), and the ledger's all-to-all bytes must equal the routing done: dispatched rows x
hidden x 4 bytes, forward and backward, dispatch and combine, as the planner predicts
from the step's recorded routing (fivefold.planner.moe_ledger).
"""

from __future__ import annotations

import pytest
import torch

from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.models.moe import MoE
from fivefold.parallel.expert import apply_expert_parallel, gather_experts
from fivefold.parallel.mesh import Mesh
from fivefold.planner.moe_ledger import predict_moe_all_to_all
from fivefold.testing import run_on_ranks
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer
from parity import assert_params_close, full_parameters, resumed_losses

CPU = Runtime(0, 1, 0, torch.device("cpu"))
STEPS = 5
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01", "parallel.micro_batch=2"]
HIDDEN = 64  # tiny_overrides' model.hidden


def train(rt: Runtime, sets: list[str], run_dir: str) -> dict:
    """5 steps: losses, per-step MoE statistics, whole parameters, this rank's last-step
    all-to-all bytes by purpose."""
    trainer = Trainer(load_config(None, sets), rt, run_dir)
    results = [trainer.train_step(s) for s in range(STEPS)]
    a2a = {}
    for r in trainer.ledger.as_dicts():
        if r["op"] == "all_to_all":
            a2a[r["purpose"]] = a2a.get(r["purpose"], 0) + r["bytes"]
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return {"losses": [r.loss for r in results], "moe": [r.moe for r in results],
            "params": params, "a2a": a2a}


def layouts_on_ranks(rt: Runtime, layouts: list[list[str]], run_dir: str,
                     empty_check: list[str] | None = None) -> tuple[list[dict], tuple | None]:
    runs = [train(rt, sets, f"{run_dir}/{i}") for i, sets in enumerate(layouts)]
    return runs, (empty_expert_rank(rt, empty_check) if empty_check else None)


def empty_expert_rank(rt: Runtime, sets: list[str]) -> tuple[float, float]:
    """Every token of both ranks routed to expert 0 (on ep rank 0): rank 1 receives no row,
    runs its experts on zero rows, and the outputs and input gradients equal the unsplit
    module's. Returns (max output error, max gradient error)."""
    cfg = load_config(None, sets)
    torch.manual_seed(0)
    whole = MoE(cfg.model)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    mesh = Mesh({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}, "cpu", Ledger())
    axes = mesh.expert_axes(2)
    part = MoE(cfg.model)
    part.load_state_dict(whole.state_dict())
    apply_expert_parallel(part, axes)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(rt.rank),
                    requires_grad=True)
    counts = [5, 0, 0, 0, 0, 0, 0, 0]
    y_ref = whole.local_experts(x, counts)
    y = part.expert_compute(x, counts)
    g_ref, = torch.autograd.grad(y_ref.sum(), x)
    g, = torch.autograd.grad(y.sum(), x)
    return (y - y_ref).abs().max().item(), (g - g_ref).abs().max().item()


@pytest.fixture(scope="module")
def moe_sets(parity_overrides):
    return parity_overrides + MOE


def reference(sets: list[str], run_dir) -> dict:
    return train(CPU, sets, str(run_dir))


def assert_same_run(run: dict, ref: dict, label: str) -> None:
    torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-5, atol=0, msg=label)
    assert_params_close(run["params"], ref["params"], label)


def test_ep4_and_ep2_with_zero_stages_match_one_process(moe_sets, tmp_path):
    """4 ranks: ep 4 (plain data parallel), and ep 2 x edp 2 with ZeRO-1, 2 and 3."""
    ref = reference(moe_sets, tmp_path / "ref")
    layouts = [moe_sets + ["parallel.ep=4"],
               moe_sets + ["parallel.ep=2", "parallel.zero_stage=1"],
               moe_sets + ["parallel.ep=2", "parallel.zero_stage=2"],
               moe_sets + ["parallel.ep=2", "parallel.zero_stage=3"]]
    per_rank = [runs for runs, _ in run_on_ranks(layouts_on_ranks, 4, layouts,
                                                 str(tmp_path / "runs"), timeout_s=600)]
    for i, label in enumerate(("ep 4", "ep 2 x dp 2 ZeRO-1", "ep 2 x dp 2 ZeRO-2",
                               "ep 2 x dp 2 ZeRO-3")):
        assert_same_run(per_rank[0][i], ref, label)
        for rank in per_rank:  # every rank dispatched something and saw the same losses
            assert rank[i]["losses"] == per_rank[0][i]["losses"]
            assert rank[i]["a2a"]["moe_dispatch"] > 0


def test_ep2_dropless_and_capacity_match_one_process_and_the_ledger(moe_sets, tmp_path):
    """2 ranks: dropless ep 2, and capacity factor 1.0 with ep 2, which drops exactly the
    one-process run's assignments; the all-to-all bytes are the routing done; and a rank
    that receives no token runs."""
    capacity = moe_sets + ["model.moe.capacity_factor=1.0"]
    refs = [reference(moe_sets, tmp_path / "ref"), reference(capacity, tmp_path / "refc")]
    layouts = [moe_sets + ["parallel.ep=2"], capacity + ["parallel.ep=2"]]
    results = run_on_ranks(layouts_on_ranks, 2, layouts, str(tmp_path / "runs"),
                           moe_sets + ["parallel.ep=2"], timeout_s=600)
    per_rank = [runs for runs, _ in results]
    for i, label in enumerate(("dropless ep 2", "capacity ep 2")):
        run = per_rank[0][i]
        assert_same_run(run, refs[i], label)
        for step, ref_step in zip(run["moe"], refs[i]["moe"]):  # loads and drops exactly
            for layer, stats in step.items():
                ref_stats = ref_step[layer]
                assert stats["tokens_per_expert"] == ref_stats["tokens_per_expert"]
                assert stats["dropped_fraction"] == ref_stats["dropped_fraction"]
                assert stats["aux_loss"] == pytest.approx(ref_stats["aux_loss"], rel=1e-5)
        predicted = predict_moe_all_to_all(run["moe"][-1], HIDDEN, 4, 2, 2, 8)
        if i == 1:
            assert sum(s["dropped_fraction"] for s in run["moe"][-1].values()) > 0
        for purpose, nbytes in predicted.items():  # the ledger, summed over the 2 ranks
            assert sum(rank[i]["a2a"][purpose] for rank in per_rank) == nbytes, purpose
    out_err, grad_err = results[1][1]  # rank 1 received no row
    assert out_err < 1e-5 and grad_err < 1e-5


@pytest.mark.slow
def test_ep2_with_pp2_and_with_tp2_match_one_process(moe_sets, tmp_path):
    """4 ranks: 2 pipeline stages (1F1B), each with ep 2 over its 2 data ranks (the stages'
    parameters together are the one-process run's); and tp 2 x dp 2 with ep 2 over the dp
    ranks (the MoE layers replicated over tp); and ep 4 over 2 nodes of 2 with the
    hierarchical two-step all-to-all."""
    ref = reference(moe_sets, tmp_path / "ref")
    hierarchical = ["parallel.ep=4", "cluster.gpus_per_node=2",
                    "comm.algorithm={all_to_all = 'hierarchical'}"]
    layouts = [moe_sets + ["parallel.pp=2", "parallel.ep=2"],
               moe_sets + ["parallel.tp=2", "parallel.ep=2"], moe_sets + hierarchical]
    per_rank = [runs for runs, _ in run_on_ranks(layouts_on_ranks, 4, layouts,
                                                 str(tmp_path / "runs"), timeout_s=900)]
    torch.testing.assert_close(per_rank[0][0]["losses"], ref["losses"], rtol=1e-5, atol=0)
    params = {**per_rank[0][0]["params"], **per_rank[2][0]["params"]}  # pp ranks 0 and 1
    assert_params_close(params, ref["params"], "ep 2 x pp 2")
    assert_same_run(per_rank[0][1], ref, "ep 2 x tp 2")
    assert_same_run(per_rank[1][1], ref, "ep 2 x tp 2, tp rank 1")
    assert_same_run(per_rank[0][2], ref, "ep 4, hierarchical all-to-all")
    assert "moe_dispatch" not in per_rank[0][2]["a2a"]  # sent as the schedule's messages


def resume_ep(rt: Runtime, sets: list[str], run_dir: str) -> tuple[list[float], list[float]]:
    """(straight losses, losses saved at step 3 and resumed) of 5 steps."""
    cfg = load_config(None, sets)
    straight = train(rt, sets, f"{run_dir}/straight")["losses"]
    resumed, start, _ = resumed_losses(rt, cfg, f"{run_dir}/resumed", 3, STEPS)
    assert start == 3
    return straight, resumed


@pytest.mark.slow
def test_ep2_zero1_with_bias_resumes_exactly(moe_sets, tmp_path):
    """An ep 2 x dp 2 ZeRO-1 run with the balancing bias, checkpointed at step 3 (where the
    biases are not zero) and resumed, repeats the uninterrupted run's losses exactly (the
    biases are in the checkpoint; without them step 4 differs)."""
    sets = moe_sets + ["parallel.ep=2", "parallel.zero_stage=1",
                       "model.moe.bias_update_rate=0.01"]
    straight, resumed = run_on_ranks(resume_ep, 4, sets, str(tmp_path), timeout_s=600)[0]
    assert resumed == straight
