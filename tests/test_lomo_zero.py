"""LOMO with ZeRO-1/2 on 2 ranks (fivefold.memory.lomo: each gradient reduce-scattered in
backward, each rank updating its slice of the parameter and all-gathering it) against the
one-process LOMO run, with two-pass clipping and without.

Tolerance as tests/test_galore_dp.py's LOMO cases: lr 1 (SGD at 1e-3 would move parameters
by less than the tolerance), losses rel 2e-5, parameters atol 1e-6 + rtol 1e-5 (the ranks sum
the gradient in another order than one process, and the clipping norm sums the ranks'
slices). Each case also asserts that the parameters moved by far more than the tolerance,
that both ranks hold the same parameters bit for bit, and that the last step's collectives
equal the planner's prediction on every rank.
"""

from __future__ import annotations

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, full_parameters, train_steps

from fivefold.config import load_config
from fivefold.models.llama import build_model
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

LOMO = ["train.optimizer=lomo", "train.lr=1.0"]
CASES = [("zero1 clip", ["parallel.zero_stage=1"]),
         ("zero2 noclip", ["parallel.zero_stage=2", "train.grad_clip=0"])]
ATOL, RTOL = 1e-6, 1e-5


def _config(overrides, sets):
    return load_config(None, overrides + LOMO + [f"train.steps={STEPS}", *sets])


def _runs(rt, overrides, tmp):
    out = []
    for k, (_, sets) in enumerate(CASES):
        cfg = _config(overrides, sets)
        trainer = Trainer(cfg, rt, f"{tmp}/{k}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        predicted = predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank)
        out.append((losses, full_parameters(trainer), trainer.ledger.totals(),
                    predicted.totals()))
    return out


def test_lomo_with_zero_matches_one_process_and_the_ledger(parity_overrides, tmp_path):
    """Module docstring's tolerances; equal ranks; collectives as predicted."""
    results = run_on_ranks(_runs, 2, parity_overrides, str(tmp_path / "ranks"), timeout_s=600)
    for k, (label, sets) in enumerate(CASES):
        clip = [s for s in sets if s.startswith("train.")]
        cfg = _config(parity_overrides, clip)
        ref = train_steps(CPU, cfg, tmp_path / f"ref{k}")
        initial = {n: q.detach() for n, q in
                   build_model(cfg.model, cfg.train.seed, torch.device("cpu")).named_parameters()}
        moved = max((ref.params[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 100 * ATOL, (label, moved)
        losses, params = results[0][k][:2]
        assert losses == pytest.approx(ref.losses, rel=2e-5), label
        assert_params_close(params, ref.params, label, atol=ATOL, rtol=RTOL)
        for rank in range(2):
            other, comm, want = results[rank][k][1:]
            assert all(torch.equal(other[n], q) for n, q in params.items()), (label, rank)
            assert comm == want, (label, rank)
            assert {op for op, _, _ in comm} == {"reduce_scatter", "all_gather", "all_reduce"}
