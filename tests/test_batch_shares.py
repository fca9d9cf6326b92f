"""Heterogeneous layouts reproduce the single-process run: data-parallel replicas taking
unequal shares of the global batch (`parallel.dp_batch_shares`, fivefold.batch_shares), and a
pipeline whose stages hold unequal numbers of blocks (`parallel.stage_layers`).

Parity tolerance: that of tests/test_data_parallel.py (fp32 on CPU, lr 1e-3, 5 steps):
losses and the validation loss rel 2e-5, gradient norms rel 1e-4, parameters atol 1e-5 +
rtol 1e-4. Unequal shares only change how the global batch's token sums are grouped before
they are added (per replica, per micro-batch), i.e. the order of float additions. A split
that lost or repeated rows, or averaged gradients per replica instead of per token, trains
on another batch or another gradient and misses by far more from the first step on.

Ranks start once per world size: 3 ranks run every batch-share layout in turn, 2 ranks
every uneven pipeline split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity import CPU, STEPS, assert_params_close, train_steps

from fivefold.batch_shares import dp_rank_of, replica_plan, replica_rows, replica_slice
from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.data import BatchSampler
from fivefold.train.run_header import layout_text
from fivefold.validate import validate_for_training

# (shares, zero_stage, micro_batch): 3 replicas, global batch 8; the slow set in the slow test
SHARE_LAYOUTS = {"default": [([2, 1, 1], 0, 2),  # 2, 1 and 1 micro-batches of 2
                             ([2, 1, 1], 2, None)],  # ZeRO-2: 4, 2, 2 sequences, one micro-batch
                 "slow": [([1, 2, 1], 3, None),  # ZeRO-3, the large share in the middle
                          ([2, 1, 1], 0, None),  # one micro-batch each: 4, 2 and 2 sequences
                          ([2, 1, 1], 1, 1),  # ZeRO-1: 4, 2 and 2 micro-batches of 1
                          ([1, 1, 2], 1, None)]}
STAGE_SPLITS = {"default": [[3, 1]], "slow": [[1, 3]]}  # 4 blocks on pp 2


def _share_config(overrides, shares, stage, micro):
    sets = overrides + [f"parallel.dp_batch_shares={shares}", f"parallel.zero_stage={stage}",
                        f"train.steps={STEPS}"]
    return load_config(None, sets + ([f"parallel.micro_batch={micro}"] if micro else []))


def _pipeline_config(overrides, split):
    return load_config(None, overrides + ["model.layers=4", "parallel.pp=2",
                                          f"parallel.stage_layers={split}",
                                          "parallel.micro_batch=2", f"train.steps={STEPS}"])


def _share_runs(rt, overrides, layouts, tmp):
    """Every batch-share layout on these 3 ranks; each rank's runs (rank 0's parameters are
    the gathered whole)."""
    return [train_steps(rt, _share_config(overrides, *layout), f"{tmp}/{i}", evaluate=True)
            for i, layout in enumerate(layouts)]


def _pipeline_runs(rt, overrides, splits, tmp):
    return [train_steps(rt, _pipeline_config(overrides, split), f"{tmp}/{i}", evaluate=True)
            for i, split in enumerate(splits)]


def _assert_run_matches(run, ref, label):
    assert run.losses == pytest.approx(ref.losses, rel=2e-5), label
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-4), label
    assert run.val_loss == pytest.approx(ref.val_loss, rel=2e-5), label


@pytest.fixture(scope="module")
def references(parity_overrides, tmp_path_factory):
    """The one-process Trainer: the tiny model (2 blocks), and 4 blocks in micro-batches of 2
    as the pipeline runs it."""
    steps = [f"train.steps={STEPS}"]
    four = ["model.layers=4", "parallel.micro_batch=2"]
    return {name: train_steps(CPU, load_config(None, parity_overrides + steps + sets),
                              tmp_path_factory.mktemp("ref"), evaluate=True)
            for name, sets in (("shares", []), ("pipeline", four))}


def check_batch_shares(overrides, references, layouts, tmp):
    ranks = run_on_ranks(_share_runs, 3, overrides, layouts, str(tmp), timeout_s=600)
    ref = references["shares"]
    for layout, *runs in zip(layouts, *ranks):
        label = f"shares layout {layout}"
        for run in runs:
            _assert_run_matches(run, ref, label)
        assert_params_close(runs[0].params, ref.params, label, atol=1e-5, rtol=1e-4)


def check_stage_splits(overrides, references, splits, tmp):
    ranks = run_on_ranks(_pipeline_runs, 2, overrides, splits, str(tmp), timeout_s=600)
    ref = references["pipeline"]
    for split, first, last in zip(splits, *ranks):
        label = f"stage_layers {split}"
        _assert_run_matches(first, ref, label)
        _assert_run_matches(last, ref, label)
        blocks = {n.split(".")[1] for n in first.params if n.startswith("layers.")}
        assert len(blocks) == split[0], label  # the first stage holds its share of blocks
        assert_params_close({**first.params, **last.params}, ref.params, label)


def test_batch_shares_match_one_process(parity_overrides, references, tmp_path):
    """3 replicas with shares 2:1:1: unequal accumulation under DDP, one micro-batch each
    under ZeRO-2; every rank's losses, gradient norms and validation loss, and the
    parameters, are the one-process run's (module docstring)."""
    check_batch_shares(parity_overrides, references, SHARE_LAYOUTS["default"], tmp_path)


@pytest.mark.slow
def test_more_batch_shares_match_one_process(parity_overrides, references, tmp_path):
    """ZeRO-3 with shares 1:2:1, DDP with one micro-batch each, ZeRO-1 accumulating
    unequally, ZeRO-1 with shares 1:1:2."""
    check_batch_shares(parity_overrides, references, SHARE_LAYOUTS["slow"], tmp_path)


def test_uneven_stage_layers_match_one_process(parity_overrides, references, tmp_path):
    """pp 2 with 3 + 1 blocks (1F1B, 4 micro-batches of 2): every rank's losses, gradient
    norms and validation loss, and the stages' parameters together, are the one-process
    run's (module docstring's tolerances)."""
    check_stage_splits(parity_overrides, references, STAGE_SPLITS["default"], tmp_path)


@pytest.mark.slow
def test_uneven_stage_layers_other_way_match_one_process(parity_overrides, references,
                                                          tmp_path):
    """pp 2 with 1 + 3 blocks."""
    check_stage_splits(parity_overrides, references, STAGE_SPLITS["slow"], tmp_path)


def test_replica_rows_together_are_the_one_process_batch():
    """Each replica's rows of a step's global batch, in replica order, are the one-process
    batch, for even and uneven shares."""
    tokens = np.arange(4096, dtype=np.uint16) % 500
    whole, _ = BatchSampler(tokens, 16, 12, seed=7).rank_batch(3)
    for shares in (None, (2, 1, 1), (1, 4, 1), (3, 1, 1, 1)):
        dp = len(shares) if shares else 3
        parts = [BatchSampler(tokens, 16, 12, seed=7, dp_rank=r, dp_size=dp, shares=shares)
                 .rank_batch(3)[0] for r in range(dp)]
        assert [len(p) for p in parts] == replica_rows(12, dp, shares)
        assert torch.equal(torch.cat(parts), whole), shares


def test_replica_slices():
    assert replica_rows(8, 3, (2, 1, 1)) == [4, 2, 2]
    assert [replica_slice(8, 3, (1, 2, 1), r) for r in range(3)] == [(0, 2), (2, 4), (6, 2)]
    assert [replica_slice(8, 2, None, r) for r in range(2)] == [(0, 4), (4, 4)]
    with pytest.raises(ValueError, match="does not split into 5"):
        replica_slice(8, 3, (2, 2, 1), 0)


BAD = [  # (overrides, ranks, key, words of the message)
    (["parallel.dp_batch_shares=[2, 1]"], 3, "parallel.dp_batch_shares", "2 shares for dp = 3"),
    (["parallel.dp_batch_shares=[2, 1, 0]"], 3, "parallel.dp_batch_shares",
     "one positive integer per"),
    (["parallel.dp_batch_shares=[]"], 3, "parallel.dp_batch_shares", "one positive integer"),
    (["parallel.dp_batch_shares=[2, 2, 1]"], 3, "parallel.dp_batch_shares",
     "sum to 5, which does not divide parallel.global_batch = 8"),
    (["parallel.dp_batch_shares=2"], 3, "parallel.dp_batch_shares", "expected a list"),
    (["parallel.dp_batch_shares=[2, 1, 1]", "parallel.micro_batch=4"], 3,
     "parallel.micro_batch", "4 does not divide the 2/4 sequences per dp rank"),
    (["parallel.dp_batch_shares=[2, 1, 1]", "parallel.micro_batch=2", "parallel.zero_stage=2"],
     3, "parallel.micro_batch", "run [2, 1, 1] micro-batches, but ZeRO-2 reduce-scatters"),
    (["parallel.dp_batch_shares=[2, 1, 1]", "parallel.micro_batch=1", "train.optimizer=lomo"],
     3, "parallel.micro_batch", "lomo reduces gradients inside backward"),
    (["parallel.dp_batch_shares=[5, 3]", "parallel.pp=2", "parallel.schedule=interleaved",
      "parallel.micro_batch=1"], 4, "parallel.micro_batch", "3 per step (3 sequences per dp"),
]


@pytest.mark.parametrize("sets, ranks, key, words", BAD)
def test_bad_batch_shares_name_the_key(sets, ranks, key, words):
    with pytest.raises(ConfigError) as err:
        validate_for_training(load_config(None, sets + ["parallel.global_batch=8"]), ranks)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_shares_with_equal_micro_batch_counts_pass():
    """One micro-batch per replica suits every ZeRO stage; 2:1:1 shares with ZeRO-1 may
    accumulate unequally."""
    for sets in (["parallel.zero_stage=3"], ["parallel.zero_stage=1", "parallel.micro_batch=1"]):
        validate_for_training(load_config(None, sets + ["parallel.dp_batch_shares=[2, 1, 1]",
                                                        "parallel.global_batch=8"]), 3)


def test_start_line_names_each_replicas_micro_batches():
    cfg = load_config(None, ["parallel.dp_batch_shares=[2, 1, 1]", "parallel.micro_batch=2",
                             "parallel.global_batch=8"])
    assert layout_text(training_plan(cfg, 3, "cpu")).endswith(
        "ZeRO 0, batch shares 2:1:1, micro-batches 2/1/1 of 2/2/2")


def test_plan_with_shares_round_trips_through_json():
    """`parallel = "auto"` hands the ranks their plan as JSON: the shares come back as given."""
    import json

    from fivefold.parallel.plan import ParallelPlan

    plan = training_plan(load_config(None, ["parallel.dp_batch_shares=[2, 1, 1]",
                                            "parallel.global_batch=8"]), 3, "cpu")
    assert ParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.micro_batch == 4  # the largest replica's rows: one micro-batch each


def test_each_replicas_pipeline_runs_its_own_micro_batch_count():
    """pp 2 x dp 2, shares 3:1 of 8 in micro-batches of 1: replica 0's schedule runs 6
    micro-batches and replica 1's 2, so replica 0's ranks send three times replica 1's
    activation bytes (the 4-rank parity run: tests/test_batch_shares_pipeline.py)."""
    cfg = load_config(None, ["parallel.dp_batch_shares=[3, 1]", "parallel.pp=2",
                             "parallel.micro_batch=1", "parallel.global_batch=8"])
    plan = training_plan(cfg, 4, "cpu")
    assert [dp_rank_of(plan, r) for r in range(4)] == [0, 1, 0, 1]
    counts = [replica_plan(plan, d).pipeline_schedules(True)[0].micro_batches for d in (0, 1)]
    assert counts == [6, 2]
    sent = [predict_ledger(cfg, plan, rank=r).totals()["send", "pp", "pp_activations"]
            for r in (0, 1)]
    assert sent[0] == 3 * sent[1]
