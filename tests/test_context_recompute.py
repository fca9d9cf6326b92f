"""Activation recomputation under context parallelism: parity with one process, and the
recomputed attention's exchanges in the predicted ledger.

Full and selective recomputation (fivefold.memory.recompute) rerun each block's forward in
backward, and with it the context-parallel attention's communication: the ring's key/value
passes, Ulysses' four all-to-alls, both in the hybrid. The rerun is the same computation on
the same shards, so training equals the run without recomputation; `predict_ledger` counts
the forward exchanges twice (fivefold.planner.ledger_model, `_Step.context_parallel`).

Tolerances: tests/test_context_parallel.py's (fp32 on CPU at lr 1e-3 and Adam eps 1e-6, 5
steps: losses 2e-5 relative, gradient norms 1e-4 relative, parameters 1e-5 + 1e-4 relative),
against the plain one-process run (recomputation itself changes nothing, tests/test_train.py).
The ledger: every key of every rank's bytes and wire bytes, exactly. Ring with full
recomputation on 2 ranks in the default suite; on 4 ranks (slow) Ulysses with selective, the
hybrid, ring under tp 2 with sequence parallelism, and Ulysses under a 2-stage pipeline.
"""

from __future__ import annotations

import pytest
from parity import CPU, STEPS, assert_params_close, train_steps

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

LAYOUTS = {
    2: [["parallel.cp=2", "parallel.cp_mode=ring", "parallel.recompute=full"]],
    4: [["parallel.cp=4", "parallel.cp_mode=ulysses", "parallel.recompute=selective"],
        ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2",
         "parallel.recompute=full"],
        ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=2",
         "parallel.sequence_parallel=true", "parallel.recompute=selective"],
        ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.pp=2", "parallel.micro_batch=2",
         "parallel.recompute=full"]],
}


def _config(overrides, sets):
    return load_config(None, overrides + [f"train.steps={STEPS}", *sets])


def _on_ranks(rt, overrides, layouts, tmp):
    """Per layout: the trained run, and (recorded, predicted) ledger totals of one step."""
    out = []
    for k, sets in enumerate(layouts):
        cfg = _config(overrides, sets)
        run = train_steps(rt, cfg, f"{tmp}/{k}")
        trainer = Trainer(cfg, rt, f"{tmp}/ledger{k}")
        trainer.train_step(0)
        predicted = predict_ledger(cfg, training_plan(cfg, rt.world_size, "cpu"), rank=rt.rank)
        out.append((run, [(trainer.ledger.totals(key), predicted.totals(key))
                          for key in ("bytes", "wire_bytes")]))
    return out


@pytest.fixture(scope="module")
def overrides(parity_overrides):
    return parity_overrides + ["train.eps=1e-6"]


def _check(world, overrides, tmp_path):
    reference = train_steps(CPU, _config(overrides, []), tmp_path / "reference")
    runs = run_on_ranks(_on_ranks, world, overrides, LAYOUTS[world], str(tmp_path),
                        timeout_s=900)
    for k, sets in enumerate(LAYOUTS[world]):
        label = " ".join(sets)
        params = {}
        for rank, rank_runs in enumerate(runs):
            run, ledgers = rank_runs[k]
            params.update(run.params)  # a pipeline's stages, each once
            for recorded, predicted in ledgers:
                assert recorded == predicted, (label, rank)
        run = runs[0][k][0]
        assert run.losses == pytest.approx(reference.losses, rel=2e-5), label
        assert run.grad_norms == pytest.approx(reference.grad_norms, rel=1e-4), label
        assert_params_close(params, reference.params, label, atol=1e-5, rtol=1e-4)


def test_ring_recompute_matches_one_process_and_the_ledger(overrides, tmp_path):
    """cp 2: ring with full recomputation (module docstring)."""
    _check(2, overrides, tmp_path)


@pytest.mark.slow
def test_ulysses_hybrid_sp_and_pipeline_recompute_match_one_process_and_the_ledger(
        overrides, tmp_path):
    """cp 4 Ulysses with selective; cp 4 hybrid with full; cp 2 ring x tp 2 with sequence
    parallelism, selective; cp 2 Ulysses x pp 2, full (module docstring)."""
    _check(4, overrides, tmp_path)
