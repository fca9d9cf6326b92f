"""Muon on every data layout (fivefold.parallel.muon_sharded) against the one-process Muon run.

Each layout trains STEPS steps on gloo ranks from the same seed and data as one process with
Muon (torch.optim.Muon on the blocks' matrices, fivefold.muon.StackedMuon on stacked experts,
AdamW elsewhere). Tolerance: losses rel 2e-5, parameters atol 1e-4 + rtol 1e-4. Muon
orthogonalizes in bf16, so the layouts' other float-sum order of the gradients (1e-7
relative) can flip a bf16 rounding of the orthogonalized update: about 4e-3 relative of an
update of lr 1e-3 times 0.2 sqrt(max(A, B)), a few 1e-5 after five steps (the same bound
tests/test_data_parallel.py states for DDP with Muon). MoE parameters get atol 3e-4: the
router's top-k turns the same float noise into larger update differences, 1.2e-4 measured
on the router with ep 1 on plain DDP, the path that existed before sharded Muon (AdamW:
6e-7). One process start per test; all but three layouts are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from parity import (CPU, STEPS, assert_params_close, full_parameters, resumed_losses,
                    train_steps)

from fivefold.config import load_config
from fivefold.muon import StackedMuon, orthogonalize
from fivefold.parallel.expert import gather_experts
from fivefold.parallel.muon_owners import assign_owners, newton_schulz_flops
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

MUON = ["train.optimizer=muon", f"train.steps={STEPS}"]
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01", "parallel.micro_batch=2"]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
FAST_2 = [([], ["parallel.zero_stage=3"]), ([], SP),
          (MOE, ["parallel.ep=2", "parallel.zero_stage=1"])]
SLOW_2 = [([], ["parallel.zero_stage=1"]),
          ([], ["parallel.zero_stage=2", "parallel.micro_batch=2"]), ([], ["parallel.tp=2"]),
          ([], ["parallel.pp=2", "parallel.zero_stage=1", "parallel.micro_batch=1"]),
          (MOE, ["parallel.ep=2"]), (MOE, ["parallel.ep=2", "parallel.zero_stage=3"])]
SLOW_4 = [([], ["parallel.zero_stage=1"] + SP),
          ([], ["parallel.zero_stage=3", "parallel.zero_group=2"]),
          ([], ["parallel.pp=2", "parallel.tp=2", "parallel.zero_stage=2",
                "parallel.micro_batch=2"]),
          (MOE, ["parallel.ep=2", "parallel.zero_stage=2"]),
          (MOE, ["parallel.ep=2", "parallel.tp=2"])]


def _runs(rt, layouts, tmp):
    """Every layout in turn: this rank's losses and whole parameters (the experts gathered
    over ep; pipeline stages hold different parameters)."""
    out = []
    for k, sets in enumerate(layouts):
        trainer = Trainer(load_config(None, sets), rt, f"{tmp}/{k}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        params = full_parameters(trainer)
        if trainer.expert_axes:
            params = gather_experts(params, trainer.expert_axes)
        out.append((losses, params))
    return out


def _check(world, overrides, layouts, tmp_path):
    """Each (model overrides, layout) on `world` ranks, in one start, against one process."""
    refs = {}
    for model, _ in layouts:
        if tuple(model) not in refs:
            refs[tuple(model)] = train_steps(CPU, load_config(None, overrides + MUON + model),
                                             tmp_path / f"ref{len(refs)}")
    runs = run_on_ranks(_runs, world, [overrides + MUON + model + sets for model, sets in layouts],
                        str(tmp_path / "runs"), timeout_s=600)
    for k, (model, sets) in enumerate(layouts):
        label, ref = f"world {world} {model + sets}", refs[tuple(model)]
        params = {}
        for rank_runs in runs:
            params.update(rank_runs[k][1])
        assert runs[0][k][0] == pytest.approx(ref.losses, rel=2e-5), label
        assert_params_close(params, ref.params, label, atol=3e-4 if model else 1e-4, rtol=1e-4)


def test_zero3_sp_and_expert_parallel_match_one_process(parity_overrides, tmp_path):
    """2 ranks: ZeRO-3, tp 2 with sequence parallelism, MoE with ep 2 x ZeRO-1."""
    _check(2, parity_overrides, FAST_2, tmp_path)


@pytest.mark.slow
def test_every_layout_on_two_ranks_matches_one_process(parity_overrides, tmp_path):
    """ZeRO-1, ZeRO-2 with accumulation, tp 2, pp 2 x ZeRO-1; MoE ep 2 at stages 0 and 3."""
    _check(2, parity_overrides, SLOW_2, tmp_path)


@pytest.mark.slow
def test_four_ranks_match_one_process(parity_overrides, tmp_path):
    """ZeRO-1 x tp 2 with sp, hierarchical ZeRO-3, pp 2 x tp 2 x ZeRO-2; MoE ep 2 with
    ZeRO-2 and with tp 2."""
    _check(4, parity_overrides, SLOW_4, tmp_path)


def test_stacked_muon_is_muon_per_expert():
    """StackedMuon on (E, A, B) equals torch.optim.Muon on each A x B slice, bit for bit."""
    torch.manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(3, 8, 12))
    slices = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(3)]
    ours = StackedMuon([stacked], lr=1e-2, weight_decay=0.1, momentum=0.9)
    theirs = torch.optim.Muon(slices, lr=1e-2, weight_decay=0.1, momentum=0.9,
                              adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(3, 8, 12)
        stacked.grad = grad.clone()
        for e, p in enumerate(slices):
            p.grad = grad[e].clone()
        ours.step()
        theirs.step()
    for e, p in enumerate(slices):
        assert torch.equal(stacked.detach()[e], p.detach()), e
    assert torch.equal(orthogonalize(torch.ones(2, 4, 4))[0], orthogonalize(torch.ones(4, 4)))


def test_owners_balance_newton_schulz_work():
    """The longest-processing-time rule: two 64 x 256 matrices and four 64 x 64 ones over two
    ranks give each rank one large and two small; every matrix has exactly one owner."""
    shapes = [(64, 64), (64, 256), (64, 64), (256, 64), (64, 64), (64, 64)]
    owners = assign_owners(shapes, 2)
    load = [sum(newton_schulz_flops(*s) for s, o in zip(shapes, owners) if o == r)
            for r in range(2)]
    assert load[0] == load[1]
    assert sorted(owners) == [0, 0, 0, 1, 1, 1]


def _straight_and_resumed(rt, layouts, tmp):
    """Per layout: the losses of 4 straight steps, and of 2 steps, a checkpoint and a new
    Trainer resumed from it for steps 3-4."""
    out = []
    for k, sets in enumerate(layouts):
        cfg = load_config(None, sets)
        trainer = Trainer(cfg, rt, f"{tmp}/s{k}")
        straight = [trainer.train_step(s).loss for s in range(4)]
        resumed, start, _ = resumed_losses(rt, cfg, f"{tmp}/r{k}", 2, 4)
        out.append((straight, resumed, start))
    return out


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_identical(parity_overrides, tmp_path):
    """The momenta and AdamW states of sharded Muon (ZeRO-2, tp 2 with sp) save and load in
    place: the resumed run's losses equal the straight run's exactly."""
    layouts = [parity_overrides + MUON + sets
               for sets in (["parallel.zero_stage=2"], SP)]
    for straight, resumed, start in run_on_ranks(_straight_and_resumed, 2, layouts,
                                                 str(tmp_path), timeout_s=600)[0]:
        assert start == 2
        assert resumed == straight


def test_planner_prices_owners_and_gathers():
    """The simulator's Muon term on 4 H100s: under ZeRO-1 the busiest owner's Newton-Schulz
    (a quarter of DDP's, to within the assignment's imbalance) plus the gather and scatter,
    which DDP (every rank orthogonalizes everything, nothing gathered) does not pay."""
    from fivefold.parallel.plan import plan_from_config
    from fivefold.planner.compute import newton_schulz_time
    from fivefold.planner.muon_cost import block_matrices, muon_step_s
    from fivefold.planner.simulate import default_precision, profile_of, shared_machine
    from fivefold.planner.step import LayoutStep

    seconds = {}
    for stage in (0, 1):
        cfg = load_config(None, [MUON[0], "cluster.gpus=4", "cluster.gpu='H100-SXM'",
                                 f"parallel.zero_stage={stage}"])
        prof = shared_machine(profile_of(cfg), 4)
        sim = LayoutStep(cfg, prof, plan_from_config(cfg, 4, default_precision(prof)))
        seconds[stage] = muon_step_s(sim, 0)
    whole = newton_schulz_time([m for i in range(cfg.model.layers)
                                for ms in block_matrices(cfg.model, sim.lay, i) for m in ms],
                               sim.prof)
    assert seconds[0] == pytest.approx(whole, rel=1e-12)
    assert whole / 4 < seconds[1] < whole / 2
