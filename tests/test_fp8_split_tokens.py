"""fp8 linears where a layout splits the tokens: sequence and context parallelism.

Sequence parallelism (tp 2): the column-parallel fp8 linears take the gathered sequence, so
their input scales are the whole sequence's, and keep only this rank's shard of it for
backward, gathering it again for the weight gradient (fivefold.parallel.fp8.linear, the
region's `SharedRegather`); a block saves the bytes the fp32 sequence-parallel block saves.
Context parallelism (cp 2): every amax that reduces over the tokens is all-gathered over the
cp ranks (fivefold.parallel.fp8.scaling), so each scale covers the one-process run's tokens.

Tolerances, those of tests/test_fp8.py's tp 2 and for its reasons: against the one-process
fp8 run of the same recipe, the first loss rel 1e-6 (every scale equal), losses rel 1e-4 and
each parameter within 2e-2 of its norm after 5 steps (reordered fp32 sums move values across
rounding boundaries). Measured on 2 shared CPU cores: tp 2 + sp losses within 4.0e-5 and
parameters 6.7e-3; cp 2 ring tensorwise 1.5e-7 and 2.1e-7; ring rowwise 2.8e-5 and 4.4e-3,
Ulysses rowwise 2.3e-5 and 8.9e-4. The ledger: on the CPU fp8 training communicates in fp32
outside its linears, so each rank's record equals `predict_ledger` of the fp32 config, plus
the fp8 config's predicted "fp8_amax" all-gathers (over tp and over cp), exactly; with
selective recomputation the forward's exchanges run twice. The default suite trains cp 2
ring tensorwise and counts the sp block's saved bytes; the rest is under `-m slow`.
"""

from __future__ import annotations

import pytest
from parity import CPU, STEPS, train_steps

from fivefold.config import load_config
from fivefold.memory.activation_count import SavedActivations
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

FP8 = ["parallel.precision=fp8", "train.eps=1e-6", f"train.steps={STEPS}"]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
ROWWISE = ["parallel.fp8_recipe=rowwise"]
FAST = {"cp2-ring": ["parallel.cp=2"]}  # and the sp block's saved bytes
SLOW = {"tp2-sp": SP, "cp2-ring-selective": ["parallel.cp=2", "parallel.recompute=selective"],
        "cp2-ring-rowwise": ["parallel.cp=2", *ROWWISE],
        "cp2-ulysses-rowwise": ["parallel.cp=2", "parallel.cp_mode=ulysses", *ROWWISE]}


def _ledger_totals(cfg, world, rank):
    return predict_ledger(cfg, training_plan(cfg, world, "cpu"), rank=rank).totals("bytes")


def _saved(rt, sets, tmp):
    """Per block, the bytes it saves for backward over one micro-batch on this rank."""
    trainer = Trainer(load_config(None, sets), rt, tmp)
    x, y = trainer.train_sampler.rank_batch(0)
    labels = {f"layers.{i}": block for i, block in enumerate(trainer.model.layers)}
    with SavedActivations(trainer.model, labels) as acts:
        trainer.micro_batch_loss(x, y).backward()
    return [acts.bytes_by_label[name] for name in labels]


def _on_ranks(rt, sets, layouts, tmp):
    out = {}
    for name, layout in layouts.items():
        cfg = load_config(None, sets + layout)
        run = train_steps(rt, cfg, f"{tmp}/{name}")
        trainer = Trainer(cfg, rt, f"{tmp}/{name}-ledger")
        trainer.train_step(0)
        plain = load_config(None, [s for s in sets + layout
                                   if not s.startswith("parallel.precision")])
        predicted = {k: v for k, v in _ledger_totals(plain, rt.world_size, rt.rank).items()}
        predicted.update({k: v for k, v in _ledger_totals(cfg, rt.world_size, rt.rank).items()
                          if k[2] == "fp8_amax"})
        out[name] = (run.losses, run.params, trainer.ledger.totals("bytes"), predicted)
    saved = (_saved(rt, sets + SP, f"{tmp}/saved8"),
             _saved(rt, [s for s in sets if "precision" not in s] + SP, f"{tmp}/saved32"))
    return out, saved


@pytest.mark.parametrize("layouts", [FAST, pytest.param(SLOW, marks=pytest.mark.slow)],
                         ids=["cp", "sp-rowwise-recompute"])
def test_fp8_sp_and_cp_match_the_one_process_fp8_run(layouts, parity_overrides, tmp_path):
    """Module docstring's bounds and ledger; under sp a block saves what fp32 saves."""
    sets = parity_overrides + FP8
    runs = run_on_ranks(_on_ranks, 2, sets, layouts, str(tmp_path), timeout_s=900)
    references = {}
    for name, layout in layouts.items():
        recipe = [s for s in layout if s in ROWWISE]
        key = tuple(recipe)
        if key not in references:
            references[key] = train_steps(CPU, load_config(None, sets + recipe),
                                          tmp_path / f"reference{len(references)}")
        ref = references[key]
        losses, params, _, _ = runs[0][0][name]
        assert losses[0] == pytest.approx(ref.losses[0], rel=1e-6), name
        assert losses == pytest.approx(ref.losses, rel=1e-4), name
        assert params.keys() == ref.params.keys(), name
        for k, value in ref.params.items():
            assert (params[k] - value).norm() <= 2e-2 * value.norm(), (name, k)
        for rank, (rank_runs, _) in enumerate(runs):
            recorded, predicted = rank_runs[name][2:]
            assert recorded == predicted, (name, rank)
            assert any(k[2] == "fp8_amax" for k in recorded), (name, rank)
    for rank, (_, (fp8, fp32)) in enumerate(runs):
        assert fp8 == fp32, rank
