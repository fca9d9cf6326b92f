"""GaLore with tensor parallelism, pipeline parallelism and ZeRO-3 against the one-process
GaLore run (issue 34; fivefold.memory.galore_units on the data-parallel engine).

One process start per group (`GROUPS`): on 2 gloo ranks tp 2 (wq/wk/wv's projections
summed over tp, the other matrices' rows projected locally), pp 2 (1F1B, each stage its own
GaLore states) and ZeRO-3 over dp 2 (micro-batches of one sequence, so each micro-batch's
gradient is reduce-scattered, the shards all-gathered per unit for the projection); slow:
tp 2 with sequence parallelism, also on a mixture-of-experts model (its router, a 2-D
matrix, whole on every tp rank; the 3-D experts keep AdamW), pp 2 with the randomized
refresh (its seeds by the matrix's place in the whole model), and on 4 ranks tp 2 x pp 2
and tp 2 x ZeRO-3 over dp 2.
Each against the one-process GaLore run of the same model and optimizer settings; the
ZeRO-3 run (on 4 ranks the tp 2 x ZeRO-3 one) also resumed from its step-2 checkpoint, which
must continue bit-identically (the moments' row chunks and the rest's AdamW runs are keyed
by shard).

Tolerance: tests/test_galore_dp.py's, for the same reason: after 5 steps losses rel 2e-5,
parameters atol 1e-5 + rtol 1e-4; the layouts sum gradients (and tp the projections of
column blocks) in another order, and the SVD of a gradient that differs in its last bits
moves its singular vectors by that over the singular-value gap. The subspace is refreshed at
steps 0 and 3 (gap 3) so both kinds of step are compared, the randomized case at step 0
only (gap 5; test_galore_dp.py's docstring measures why). Every case also asserts that the
parameters moved by far more than the tolerance, that the ranks holding copies of a
parameter hold the same values, and that the last step's ledger (a step without refresh)
and the model-state bytes equal `predict_ledger` on every rank, and so does the step-3
ledger (a refresh step) of every case refreshed there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity import (CPU, STEPS, assert_params_close, full_parameters, resumed_losses,
                    train_steps)

from fivefold.config import load_config
from fivefold.hardware import load_profile
from fivefold.models.llama import build_model
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.matrix_update import galore_time, matrix_update_time
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

GALORE = ["train.optimizer=galore", "train.galore_update_gap=3"]
RANDOMIZED = ["train.galore_svd=randomized", "train.galore_update_gap=5"]  # refresh: step 0
TP2, SP = "parallel.tp=2", "parallel.sequence_parallel=true"
PP2 = ["parallel.pp=2", "parallel.schedule=1f1b"]
ZERO3 = ["parallel.zero_stage=3", "parallel.micro_batch=1"]
MOE = ["model.moe.experts=4", "model.moe.expert_ffn_hidden=32"]  # router 2-D, experts 3-D

# (world size, [(label, overrides)]) per group, one process start each
GROUPS = {  # the last number: the case also resumed from a checkpoint
    "tp pp zero3": (2, [("tp2", [*GALORE, TP2]), ("pp2", [*GALORE, *PP2]),
                        ("zero3", [*GALORE, *ZERO3])], 2),
    "sp moe randomized": (2, [("tp2 sp", [*GALORE, TP2, SP]),
                              ("tp2 sp moe", [*GALORE, TP2, SP, *MOE]),
                              ("pp2 randomized", [*GALORE, *RANDOMIZED, *PP2])], None),
    "four ranks": (4, [("tp2 pp2", [*GALORE, TP2, *PP2]),
                       ("tp2 zero3 dp2", [*GALORE, TP2, *ZERO3])], 1),
}


def _reference_key(sets: list[str]) -> tuple[str, ...]:
    return tuple(s for s in sets if s.startswith(("train.", "model.")))


def _config(overrides: list[str], sets):
    return load_config(None, overrides + [f"train.steps={STEPS}", *sets])


def _runs(rt, overrides, cases, tmp, resume: int | None):
    """Every case on these ranks: (losses, this rank's whole parameters, the last step's
    ledger totals and model-state bytes, the predicted ones, and the refresh step's (step 3
    under gap 3) totals, measured and predicted); and the losses of case `resume` run again
    from its step-2 checkpoint."""
    out = []
    for k, (_, sets) in enumerate(cases):
        cfg = _config(overrides, sets)
        trainer = Trainer(cfg, rt, f"{tmp}/{k}")
        losses, refresh = [], None
        for s in range(STEPS):
            losses.append(trainer.train_step(s).loss)
            if s == 3 and cfg.train.galore_update_gap == 3:
                refresh = trainer.ledger.totals()
        plan = plan_from_config(cfg, rt.world_size, "fp32")
        predicted = predict_ledger(cfg, plan, rt.rank)
        extra = None
        if refresh is not None:
            extra = (refresh, predict_ledger(cfg, plan, rt.rank, galore_refresh=True).totals())
        comm, states = trainer.ledger.totals(), dict(trainer.ledger.model_state_bytes)
        out.append((losses, full_parameters(trainer), comm, states, predicted.totals(),
                    predicted.model_state_bytes, extra))
    resumed = None
    if resume is not None:
        resumed = resumed_losses(rt, _config(overrides, cases[resume][1]), f"{tmp}/resume",
                                 2, STEPS)[0]
    return out, resumed


@pytest.mark.parametrize("group", [
    "tp pp zero3", pytest.param("sp moe randomized", marks=pytest.mark.slow),
    pytest.param("four ranks", marks=pytest.mark.slow)])
def test_galore_tp_pp_zero3_match_one_process(group, parity_overrides, tmp_path):
    """Each case of `GROUPS[group]` against its one-process run (module docstring's
    tolerances); copies of a parameter equal bit for bit; the ledger and model-state bytes
    equal the planner's on every rank, on a step without and with refresh; a resumed run
    continues bit-identically."""
    world, cases, resume = GROUPS[group]
    outputs = run_on_ranks(_runs, world, parity_overrides, cases, str(tmp_path), resume,
                           timeout_s=600)
    results = [out for out, _ in outputs]
    if resume is not None:  # resumed at step 2: the straight run's losses, bit for bit
        assert outputs[0][1] == results[0][resume][0]
    references = {}
    for k, (label, sets) in enumerate(cases):
        key = _reference_key(sets)
        if key not in references:
            cfg = _config(parity_overrides, list(key))
            model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
            references[key] = (train_steps(CPU, cfg, tmp_path / f"ref{k}"),
                               {n: q.detach().clone() for n, q in model.named_parameters()})
        ref, initial = references[key]
        losses = results[0][k][0]
        assert losses == pytest.approx(ref.losses, rel=2e-5), label
        merged = {}
        for rank in range(world):
            params = results[rank][k][1]
            for name, value in params.items():
                if name in merged:  # a copy on both ranks: the same bits
                    assert torch.equal(merged[name], value), (label, name)
                merged[name] = value
        assert_params_close(merged, ref.params, label)
        moved = max((ref.params[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 100 * 1e-5, (label, moved)
        for rank in range(world):
            comm, states, want_comm, want_states, extra = results[rank][k][2:]
            assert comm == want_comm and comm, (label, rank)
            assert states == want_states, (label, rank)
            if extra is not None:
                assert extra[0] == extra[1], (label, rank, "refresh step")


def test_planner_prices_galore_projections_and_refresh():
    """fivefold.planner.matrix_update on the 8B preset's block 0 and an H200 profile:
    GaLore costs time, its refresh share falls as the update gap grows toward the cost of
    the projections alone, the randomized refresh is cheaper than the exact SVD on these
    4096-wide matrices, tp divides the projections, and AdamW is charged nothing there."""
    cfg = load_config(None, ["train.optimizer=galore", "model.preset=8B"])
    prof = load_profile("H200")
    train = dataclasses.replace
    t = {gap: galore_time(cfg.model, 0, 1, train(cfg.train, galore_update_gap=gap), prof)
         for gap in (1, 10, 10_000)}
    assert t[1] > t[10] > t[10_000] > 0
    randomized = galore_time(cfg.model, 0, 1, train(cfg.train, galore_update_gap=1,
                                                    galore_svd="randomized"), prof)
    assert randomized < t[1]
    tp2 = galore_time(cfg.model, 0, 2, train(cfg.train, galore_update_gap=10_000), prof)
    assert tp2 < t[10_000]
    assert matrix_update_time(cfg.model, 0, 1, train(cfg.train, optimizer="adamw"), prof) == 0
