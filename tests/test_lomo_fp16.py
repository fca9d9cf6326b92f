"""LOMO with fp16 dynamic loss scaling (fivefold.memory.lomo, fivefold.train.loss_scale): the
loss multiplied by the scale S, each gradient multiplied by 1/S right after its reduction,
and an overflow found by the first of the two clipping passes skips the second.

* One process: LOMO in fp16 equals torch's SGD without momentum in fp16 (the synchronous
  path's loss scaling: fp32 parameters under fp16 autocast, unscale, clip, step) bit for bit:
  losses, gradient norms and parameters (the same products in the same order, S a power of
  two).
* 2 ranks, one start per group: ZeRO-1 (reduce-scatter; dp 2's all-reduce and ZeRO-2 in the
  slow suite) against the
  one-process fp16 LOMO run at lr 1 (as tests/test_lomo_zero.py: SGD at 1e-3 would move the
  parameters by less than a rounding). Under fp16 autocast a weight gradient is a matmul
  rounded to fp16 (relative 2^-11) over this rank's tokens, so the ranks' half-batch sums
  round differently from one process's whole-batch sum: losses agree to LOSS_REL relative
  and each parameter tensor to CHANGE_FRACTION of the reference's own change from the
  initial weights (the norm of the difference; tests/test_fp16_layouts.py's form): measured
  7.4e-6 and 9.0e-4 on 2 shared CPU cores, checked at 2e-5 and 1e-2. Both ranks hold equal parameters bit for bit; the ledger
  equals `predict_ledger` on every rank; the scale raised to 2^60 makes every rank skip the
  same step, leave the parameters, halve the scale and take the next step.
"""

from __future__ import annotations

import math

import pytest
import torch
from parity import CPU, STEPS, full_parameters, train_steps

from fivefold.config import ConfigError, load_config
from fivefold.models.llama import build_model
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.loss_scale import INIT_SCALE
from fivefold.train.trainer import Trainer
from fivefold.validate import validate_for_training

FP16_LOMO = ["parallel.precision=fp16", "train.optimizer=lomo", f"train.steps={STEPS}"]
LAYOUTS = {"dp 2, ZeRO-1": ["parallel.zero_stage=1"]}
MORE_LAYOUTS = {"dp 2": [], "dp 2, ZeRO-2": ["parallel.zero_stage=2"]}  # the slow suite's
LR = ["train.lr=1.0"]
LOSS_REL, CHANGE_FRACTION = 2e-5, 1e-2


def test_fp16_lomo_is_fp16_sgd_fused_into_backward(parity_overrides, tmp_path):
    sets = parity_overrides + ["parallel.precision=fp16", f"train.steps={STEPS}",
                               "train.lr=0.05"]
    lomo = train_steps(CPU, load_config(None, sets + ["train.optimizer=lomo"]), tmp_path / "l")
    sgd = train_steps(CPU, load_config(None, sets + ["train.optimizer=sgd", "train.beta1=0"]),
                      tmp_path / "s")
    assert (lomo.losses, lomo.grad_norms) == (sgd.losses, sgd.grad_norms)
    for name, q in sgd.params.items():
        assert torch.equal(lomo.params[name], q), name


def test_fp16_lomo_without_clipping_is_refused(parity_overrides):
    cfg = load_config(None, parity_overrides + FP16_LOMO + ["train.grad_clip=0"])
    with pytest.raises(ConfigError) as err:
        validate_for_training(cfg, 1)
    assert err.value.key == "train.grad_clip" and "set train.grad_clip > 0" in str(err.value)


def _on_ranks(rt, overrides, layouts, tmp):
    runs = {}
    for k, (name, sets) in enumerate(layouts.items()):
        cfg = load_config(None, overrides + FP16_LOMO + LR + sets)
        trainer = Trainer(cfg, rt, f"{tmp}/{k}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        predicted = predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank)
        runs[name] = (losses, full_parameters(trainer), trainer.ledger.totals(),
                      predicted.totals())
    trainer = Trainer(load_config(None, overrides + FP16_LOMO + LR), rt, f"{tmp}/o")
    before = full_parameters(trainer)
    trainer.updater.loss_scale.scale = 2.0 ** 60
    norm = trainer.train_step(0).grad_norm
    unchanged = all(torch.equal(full_parameters(trainer)[n], q) for n, q in before.items())
    scale = trainer.updater.loss_scale.scale
    trainer.updater.loss_scale.scale = INIT_SCALE
    overflow = (norm, scale, unchanged, trainer.train_step(1).grad_norm, trainer.skipped_steps)
    return runs, overflow


@pytest.mark.parametrize("layouts", [LAYOUTS, pytest.param(MORE_LAYOUTS, marks=pytest.mark.slow)],
                         ids=["zero1", "dp-zero2"])
def test_fp16_lomo_on_2_ranks_matches_one_process(layouts, parity_overrides, tmp_path):
    """Module docstring's tolerances; equal ranks; the ledger as predicted; one overflow."""
    cfg = load_config(None, parity_overrides + FP16_LOMO + LR)
    ref = train_steps(CPU, cfg, tmp_path / "r")
    initial = {n: q.detach() for n, q in
               build_model(cfg.model, cfg.train.seed, torch.device("cpu")).named_parameters()}
    results = run_on_ranks(_on_ranks, 2, parity_overrides, layouts, str(tmp_path / "ranks"),
                           timeout_s=600)
    for name in layouts:
        losses, params = results[0][0][name][:2]
        worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses))
        fractions = {n: ((q - ref.params[n]).norm() / (ref.params[n] - initial[n]).norm()).item()
                     for n, q in params.items()}
        assert worst_loss <= LOSS_REL, name
        assert max(fractions.values()) <= CHANGE_FRACTION, (name, fractions)
        for rank in range(2):
            other, comm, want = results[rank][0][name][1:]
            assert all(torch.equal(other[n], q) for n, q in params.items()), (name, rank)
            assert comm == want and comm, (name, rank)
    for norm, scale, unchanged, next_norm, skipped in (overflow for _, overflow in results):
        assert not math.isfinite(norm) and scale == 2.0 ** 59 and unchanged and skipped == 0
        assert math.isfinite(next_norm)
