"""Optimizer offload with SGD (fivefold.memory.offload.cpu_sgd_): the host step computes what
the engine's in-memory SGD computes, and the host and disk hold SGD's smaller state.

Tolerances: against the in-memory SGD run of the same layout, exact (bit for bit: the host
runs torch's single-tensor SGD on the same reduced gradients, the L2 weight decay added to
the same elements, and a zero momentum buffer's first update is the gradient itself, as
torch's first step). Against the one-process run, the data-parallel tolerance of
tests/test_data_parallel.py: losses rel 2e-5, parameters atol 1e-5 + rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, full_parameters, resumed_losses, train_steps

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.memory import offload_bytes
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

SGD = ["train.optimizer=sgd", "train.lr=0.5", "train.weight_decay=0.1"]
NO_MOMENTUM = ("train.beta1=0.0",)


def _sets(overrides, stage, offload="none", path=None, fraction=1.0, extra=()):
    sets = overrides + SGD + [f"parallel.zero_stage={stage}", f"train.steps={STEPS}",
                              f"parallel.offload={offload}",
                              f"parallel.offload_fraction={fraction}", *extra]
    if path is not None:
        sets.append(f"parallel.offload_path='{path}'")
    return sets


def _same(run, ref) -> bool:
    return run.losses == ref.losses and run.params.keys() == ref.params.keys() and all(
        torch.equal(run.params[k], ref.params[k]) for k in ref.params)


ONE_RANK = [(0, "cpu", 1.0, ()), (1, "nvme", 1.0, ()), (2, "cpu", 0.5, ()),
            (3, "nvme", 0.5, ()), (1, "cpu", 1.0, NO_MOMENTUM), (3, "nvme", 1.0, NO_MOMENTUM)]


def test_one_rank_sgd_offload_is_exact_and_records_its_bytes(parity_overrides, tmp_path):
    """One rank, SGD with and without momentum: each offloaded run equals the in-memory SGD
    run of its ZeRO stage bit for bit; the ledger keeps no device optimizer state for the
    offloaded units; "host" holds master and gradient (8 B per offloaded element) plus, with
    cpu and momentum, the momentum (4 B); "disk" with nvme and momentum two versions of it
    (8 B), without momentum nothing; with momentum the planner predicts these rows to the
    byte. A cpu and an nvme run resumed from a step-2 checkpoint
    continue with the same losses as uninterrupted (exactly)."""
    refs = {}
    for stage, offload, fraction, extra in ONE_RANK:
        label = (stage, offload, fraction, extra)
        if (stage, extra) not in refs:
            refs[stage, extra] = train_steps(CPU, load_config(None, _sets(
                parity_overrides, stage, extra=extra)), tmp_path / f"ref{stage}{len(extra)}")
        ref = refs[stage, extra]
        name = f"{stage}-{offload}-{fraction}-{len(extra)}"
        cfg = load_config(None, _sets(parity_overrides, stage, offload, tmp_path / f"nv{name}",
                                      fraction, extra))
        trainer = Trainer(cfg, CPU, tmp_path / f"run{name}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        params = full_parameters(trainer)
        if stage == 0:  # the plain reference: decay added per parameter, not on the flat unit
            assert losses == pytest.approx(ref.losses, rel=2e-5), label
            assert_params_close(params, ref.params, label, atol=1e-5, rtol=1e-4)
        else:
            assert losses == ref.losses, label
            assert all(torch.equal(params[k], ref.params[k]) for k in ref.params), label
        engine, states = trainer.engine, trainer.ledger.model_state_bytes
        numels = [u.shard_numel for u in engine.units]
        offloaded, rest = sum(numels[:engine.offloaded]), sum(numels[engine.offloaded:])
        momentum = 0 if extra else 4
        assert states["optimizer"] == momentum * rest, label
        assert states["host"] == (8 + (momentum if offload == "cpu" else 0)) * offloaded, label
        assert states["disk"] == (2 * momentum * offloaded if offload == "nvme" else 0), label
        assert offload_bytes(offload, momentum) == (
            states["host"] / offloaded, states["disk"] / offloaded), label
        if momentum:  # the plan assumes the default momentum (planner.memory)
            plan = training_plan(cfg, 1, "cpu")
            assert predict_ledger(cfg, plan, 0).model_state_bytes == states, label
    for stage, offload in ((2, "cpu"), (1, "nvme")):
        cfg = load_config(None, _sets(parity_overrides, stage, offload, tmp_path / f"nvr{stage}"))
        resumed = resumed_losses(CPU, cfg, tmp_path / f"resume{stage}", 2, STEPS)[0]
        assert resumed == refs[stage, ()].losses, stage


def _zero1_runs(rt, overrides, tmp):
    runs = [train_steps(rt, load_config(None, _sets(overrides, 1, offload, f"{tmp}/nv{offload}")),
                        f"{tmp}/run{offload}") for offload in ("none", "cpu", "nvme")]
    return runs if rt.rank == 0 else None


@pytest.mark.slow
def test_sgd_offload_on_2_ranks_zero1_matches_in_memory_and_one_process(parity_overrides,
                                                                       tmp_path):
    """2 gloo ranks, ZeRO-1, SGD with momentum, cpu and nvme offload: exact against the
    in-memory ZeRO-1 SGD run (losses and parameters), within the data-parallel tolerance
    against the one-process run."""
    reference = train_steps(CPU, load_config(None, _sets(parity_overrides, 0)), tmp_path / "ref")
    in_memory, *offloaded = run_on_ranks(_zero1_runs, 2, parity_overrides, str(tmp_path),
                                         timeout_s=300)[0]
    for offload, run in zip(("cpu", "nvme"), offloaded):
        assert _same(run, in_memory), offload
        assert run.losses == pytest.approx(reference.losses, rel=2e-5), offload
        assert_params_close(run.params, reference.params, offload, atol=1e-5, rtol=1e-4)
