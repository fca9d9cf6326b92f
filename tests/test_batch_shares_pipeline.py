"""Unequal batch shares under a pipeline reproduce the single-process run: pp 2 x dp 2, the
replicas taking 3:1 (6 and 2 sequences of the global batch of 8) in micro-batches of 1, so
replica 0's pipeline runs 6 micro-batches per step under 1F1B and replica 1's runs 2; the
replicas meet only in the gradient sync (fivefold.batch_shares.replica_plan).

Parity tolerance: that of tests/test_data_parallel.py (fp32 on CPU, lr 1e-3, 5 steps):
losses rel 2e-5, parameters atol 1e-5 + rtol 1e-4. The split only regroups the global
batch's token sums (per replica, per micro-batch, per stage boundary); a replica running the
other's micro-batch count, dropping rows, or normalizing by its own tokens instead of the
global batch's trains on another gradient and misses by far more from the first step on.
Every rank's ledger equals `predict_ledger` of its rank: the two replicas' pipelines send
and receive different numbers of messages, so a prediction from one shared schedule fails.

One 4-rank start per test: DDP with shares 3:1 in the default suite, ZeRO-1 with shares 1:3
in the slow one.
"""

from __future__ import annotations

import pytest
from parity import CPU, STEPS, assert_ledgers_predicted, assert_params_close, full_parameters

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

LAYOUTS = {"default": ["parallel.dp_batch_shares=[3, 1]", "parallel.zero_stage=0"],
           "slow": ["parallel.dp_batch_shares=[1, 3]", "parallel.zero_stage=1"]}
PIPELINE = ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.micro_batch=1"]


def _train(rt, sets: list[str], run_dir: str) -> dict:
    """STEPS steps: losses, this stage's whole parameters, the ledger's totals."""
    trainer = Trainer(load_config(None, sets), rt, run_dir)
    losses = [trainer.train_step(s).loss for s in range(STEPS)]
    ledger = trainer.ledger  # read before the parameters' gather adds to it
    out = {"losses": losses, "bytes": ledger.totals("bytes"),
           "wire": ledger.totals("wire_bytes"), "state": ledger.model_state_bytes}
    return {**out, "params": full_parameters(trainer)}


def check_layout(base: list[str], sets: list[str], tmp) -> None:
    """The layout on 4 ranks against the one-process run in micro-batches of 1."""
    runs = run_on_ranks(_train, 4, base + PIPELINE + sets, str(tmp / "run"), timeout_s=900)
    ref = _train(CPU, base + ["parallel.micro_batch=1"], str(tmp / "ref"))
    label = " ".join(sets)
    for rank, run in enumerate(runs):
        assert run["losses"] == pytest.approx(ref["losses"], rel=2e-5), (label, rank)
    params = {**runs[0]["params"], **runs[2]["params"]}  # pp rank 0, then pp rank 1
    assert_params_close(params, ref["params"], label, atol=1e-5, rtol=1e-4)
    cfg = load_config(None, base + PIPELINE + sets)
    plan = training_plan(cfg, 4, "cpu")
    assert_ledgers_predicted([predict_ledger(cfg, plan, rank=r) for r in range(4)],
                             [(run["bytes"], run["wire"], run["state"]) for run in runs],
                             (), label)


@pytest.fixture
def base(parity_overrides) -> list[str]:
    return parity_overrides + [f"train.steps={STEPS}"]


def test_pipeline_with_batch_shares_matches_one_process_and_the_ledger(base, tmp_path):
    """pp 2 x dp 2 under 1F1B with shares 3:1 (DDP): every rank's losses, the stages'
    parameters together, and every rank's ledger (module docstring's tolerances)."""
    check_layout(base, LAYOUTS["default"], tmp_path)


@pytest.mark.slow
def test_pipeline_with_batch_shares_under_zero1_matches_one_process(base, tmp_path):
    """The same with shares 1:3 under ZeRO-1 (the large share on the second replica)."""
    check_layout(base, LAYOUTS["slow"], tmp_path)
