"""fp16 dynamic loss scaling on every layout (fivefold.train.loss_scale,
fivefold.train.updaters): data parallelism with ZeRO 0/1/2/3, tensor, context and pipeline
parallelism and offload train as the one-process fp16 run does (ZeRO-2/3 and cp in the slow
suite), their ledgers are as `predict_ledger` says, and an overflow (on dp 2, ZeRO-1) is
skipped on every rank at once.

Tolerance. The one-process fp16 run keeps fp32 parameters under fp16 autocast; the
data-parallel engine keeps fp16 compute copies beside fp32 masters and reduces fp16
gradients, so every layout here computes with parameters rounded to fp16 (relative 2^-11).
Over 5 steps at lr 1e-3 the losses agree to 2e-5 relative (measured at most 5.2e-6 on 2
shared CPU cores) and the gradient norms, measured after the scale is divided out, to 1e-3.
Parameters: Adam turns a rounding difference in a near-zero gradient into a step of up to
lr, so single elements differ by up to 4e-3 (measured); the check is per tensor, the norm of
the difference at most a tenth of the norm of the reference's own change from the initial
weights (measured at most 0.035). Offload on one rank computes what the in-memory engine
does: parameters within 1e-6 (measured equal).
"""

from __future__ import annotations

import math

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, full_parameters, train_steps

from fivefold.config import load_config
from fivefold.models.llama import build_model
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.loss_scale import INIT_SCALE
from fivefold.train.trainer import Trainer

FP16 = ["parallel.precision=fp16", f"train.steps={STEPS}"]
LAYOUTS_2 = {  # name: --set overrides on 2 ranks
    "dp 2": ["parallel.micro_batch=2"],
    "tp 2": ["parallel.tp=2"],
    "pp 2 (1f1b)": ["parallel.pp=2", "parallel.micro_batch=2"],
}
MORE_LAYOUTS_2 = {  # the slow suite's
    "dp 2, ZeRO-2": ["parallel.zero_stage=2"],
    "dp 2, ZeRO-3": ["parallel.zero_stage=3", "parallel.micro_batch=2"],
    "cp 2": ["parallel.cp=2"],
}
LOSS_REL, NORM_REL, CHANGE_FRACTION = 2e-5, 1e-3, 0.1


def _layouts(rt, overrides, layouts, tmp):
    """Per layout: (losses, grad norms, parameters, ledger totals, predicted totals); then an
    overflowing step on dp 2 ZeRO-1 (the scale raised so that fp16 gradients overflow)."""
    runs = {}
    for k, (name, sets) in enumerate(layouts.items()):
        cfg = load_config(None, overrides + FP16 + sets)
        trainer = Trainer(cfg, rt, f"{tmp}/{k}")
        results = [trainer.train_step(s) for s in range(STEPS)]
        predicted = predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank)
        comm = trainer.ledger.totals()  # before the parameters' gather adds its own
        runs[name] = ([r.loss for r in results], [r.grad_norm for r in results],
                      full_parameters(trainer), comm, predicted.totals())
    return runs, _overflow(rt, overrides + FP16 + ["parallel.zero_stage=1"], f"{tmp}/o")


def _overflow(rt, sets, tmp):
    """(grad norm, scale after, parameters unchanged, next step's norm, skipped steps)."""
    trainer = Trainer(load_config(None, sets), rt, tmp)
    before = full_parameters(trainer)
    trainer.updater.loss_scale.scale = 2.0 ** 60
    norm = trainer.train_step(0).grad_norm
    after = full_parameters(trainer)
    unchanged = all(torch.equal(after[n], q) for n, q in before.items())
    scale = trainer.updater.loss_scale.scale
    trainer.updater.loss_scale.scale = INIT_SCALE
    return norm, scale, unchanged, trainer.train_step(1).grad_norm, trainer.skipped_steps


@pytest.fixture(scope="module")
def reference(parity_overrides, tmp_path_factory):
    """The one-process fp16 run (fp32 parameters, fp16 autocast, the same loss scale) and
    the initial weights."""
    cfg = load_config(None, parity_overrides + FP16)
    initial = {n: q.detach() for n, q in
               build_model(cfg.model, cfg.train.seed, torch.device("cpu")).named_parameters()}
    return train_steps(CPU, cfg, tmp_path_factory.mktemp("r")), initial


def _assert_close_to_reference(losses, norms, params, reference, label):
    ref, initial = reference
    assert losses == pytest.approx(ref.losses, rel=LOSS_REL), label
    assert norms == pytest.approx(ref.grad_norms, rel=NORM_REL), label
    for name, q in params.items():
        off = (q - ref.params[name]).norm().item()
        moved = (ref.params[name] - initial[name]).norm().item()
        assert off <= CHANGE_FRACTION * moved, (label, name, off, moved)


@pytest.mark.parametrize("layouts", [
    LAYOUTS_2, pytest.param(MORE_LAYOUTS_2, marks=pytest.mark.slow)],
    ids=["dp-tp-pp", "zero-cp"])
def test_fp16_layouts_match_one_process(layouts, parity_overrides, reference, tmp_path):
    """Module docstring's tolerances; the ledger as predicted on every rank; one process
    start for every layout of the group and the overflow."""
    results = run_on_ranks(_layouts, 2, parity_overrides, layouts, str(tmp_path),
                           timeout_s=900)
    for name in layouts:
        whole = {}
        for rank, (runs, _) in enumerate(results):
            losses, norms, params, comm, predicted = runs[name]
            whole.update(params)  # a pipeline's stages, each once
            _assert_close_to_reference(losses, norms, params, reference, f"{name} rank {rank}")
            assert comm == predicted and comm, (name, rank)
        assert whole.keys() == reference[0].params.keys(), name
    for norm, scale, unchanged, next_norm, skipped in (overflow for _, overflow in results):
        # every rank sees the same non-finite norm, leaves the parameters, halves the scale,
        # does not count a non-finite skip, and takes the next step
        assert not math.isfinite(norm) and scale == 2.0 ** 59 and unchanged and skipped == 0
        assert math.isfinite(next_norm)


def test_fp16_offload_matches_one_process(parity_overrides, reference, tmp_path):
    """One rank with its optimizer state offloaded to the host: the in-memory one-rank
    engine's fp16 run within 1e-6, and the plain one-process run within the module's
    tolerances."""
    sets = parity_overrides + FP16 + ["parallel.zero_stage=1"]
    in_memory = train_steps(CPU, load_config(None, sets), tmp_path / "m")
    run = train_steps(CPU, load_config(None, sets + ["parallel.offload=cpu"]), tmp_path / "o")
    assert_params_close(run.params, in_memory.params, "fp16 offload", atol=1e-6, rtol=0)
    _assert_close_to_reference(run.losses, run.grad_norms, run.params, reference,
                               "fp16 offload")
