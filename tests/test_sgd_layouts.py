"""SGD (with momentum and L2 weight decay, as torch's SGD takes `train.weight_decay` on the
matrices) through the data-parallel engine on every layout of 2 ranks: DDP, ZeRO-1/2/3,
tensor, pipeline and context parallelism, each against the one-process run of torch's SGD.

Tolerance: fp32 on CPU at lr 0.5 with momentum 0.9 (SGD at the parity tests' 1e-3 would move
parameters by less than any tolerance); the layouts sum gradients in another order than one
process, so after 5 steps losses agree to 1e-5 relative and parameters to atol 1e-6 + rtol
1e-5 (SGD's update is linear in the gradient: no division turns rounding into a large
difference, as Adam's does in tests/test_data_parallel.py). Every case also asserts that the
parameters moved by far more than the tolerance, that every rank holds the same ones, that
the last step's collectives and model-state bytes (SGD's momentum, sharded like the masters)
equal the planner's prediction on every rank, and the ZeRO-1 and ZeRO-3 runs resumed from a
step-2 checkpoint (masters and momentum shards) continue bit-identically.
"""

from __future__ import annotations

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, full_parameters, resumed_losses, train_steps

from fivefold.config import load_config
from fivefold.models.llama import build_model
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

SGD = ["train.optimizer=sgd", "train.lr=0.5"]
CASES = [  # (label, overrides) on 2 ranks
    ("ddp", ["parallel.zero_stage=0"]),
    ("zero1 accumulate", ["parallel.zero_stage=1", "parallel.micro_batch=1"]),
    ("zero2", ["parallel.zero_stage=2"]),
    ("zero3 accumulate", ["parallel.zero_stage=3", "parallel.micro_batch=1"]),
    ("tp2 sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp2 1f1b", ["parallel.pp=2", "parallel.micro_batch=1"]),
    ("cp2", ["parallel.cp=2"]),
]
RESUMED = ("zero1 accumulate", "zero3 accumulate")
ATOL, RTOL = 1e-6, 1e-5


def _config(overrides, sets):
    return load_config(None, overrides + SGD + [f"train.steps={STEPS}", *sets])


def _runs(rt, overrides, tmp):
    """Per case on every rank: losses, parameters (a pipeline stage's own), the last step's
    ledger totals and model-state bytes and this rank's prediction of both; then the losses
    of the `RESUMED` cases resumed from a step-2 checkpoint."""
    out = []
    for k, (_, sets) in enumerate(CASES):
        cfg = _config(overrides, sets)
        trainer = Trainer(cfg, rt, f"{tmp}/{k}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        predicted = predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank)
        comm, states = trainer.ledger.totals(), dict(trainer.ledger.model_state_bytes)
        out.append((losses, full_parameters(trainer), comm, states, predicted.totals(),
                    predicted.model_state_bytes))  # the ledger before the gather's records
    resumed = [resumed_losses(rt, _config(overrides, sets), f"{tmp}/resume{k}", 2, STEPS)[0]
               for k, (label, sets) in enumerate(CASES) if label in RESUMED]
    return out, resumed


def test_sgd_on_every_layout_matches_one_process_and_the_ledger(parity_overrides, tmp_path):
    """Module docstring: parity within its tolerance, equal ranks, ledger as predicted,
    exact resume."""
    cfg = _config(parity_overrides, [])
    ref = train_steps(CPU, cfg, tmp_path / "ref")
    initial = {n: q.detach() for n, q in
               build_model(cfg.model, cfg.train.seed, torch.device("cpu")).named_parameters()}
    moved = max((ref.params[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 100 * ATOL, moved
    results = run_on_ranks(_runs, 2, parity_overrides, str(tmp_path / "ranks"), timeout_s=900)
    for k, (label, sets) in enumerate(CASES):
        losses = results[0][0][k][0]
        assert losses == pytest.approx(ref.losses, rel=1e-5), label
        params = {}
        for rank_results in results:
            params.update(rank_results[0][k][1])  # the pipeline's stages, each once
        assert_params_close(params, ref.params, label, atol=ATOL, rtol=RTOL)
        for rank in range(2):
            other, comm, states, want_comm, want_states = results[rank][0][k][1:]
            shared = other.keys() & params.keys()
            assert all(torch.equal(other[n], params[n]) for n in shared), (label, rank)
            assert comm == want_comm and comm, (label, rank)
            assert states == want_states and states["optimizer"] > 0, (label, rank)
    straight = [results[0][0][k][0] for k, (label, _) in enumerate(CASES) if label in RESUMED]
    assert results[0][1] == straight
