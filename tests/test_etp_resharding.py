"""Checkpoints on the experts' tensor-parallel grid resume under other layouts and export to
transformers (fivefold.train.expert_checkpoint, fivefold.train.reshard,
fivefold.train.checkpoint_export).

The tiny MoE of tests/test_moe_resharding.py (4 experts of width 32, top-2, both blocks MoE,
the balancing loss on), with routing biases where the old layout is ep 2 and without them
where it is etp 2 x ep 2 (which `fivefold convert` exports: Mixtral routes without them).
Each old layout trains steps 1-3 and saves; each new layout resumes from a copy of that
checkpoint, saves what it loaded, and trains step 4.

Default suite, 2 gloo ranks, one process start:

  ep 2 (dp 2), ZeRO-1 -> etp 2 x ep 1 (dp 2), ZeRO-1

and the etp checkpoint that the first resume saved resumes in one process (the plain Trainer
and torch's AdamW).

Slow, 4 gloo ranks, one process start:

  ep 2 x edp 2, ZeRO-1           -> etp 2 x ep 2 over tp 2 x dp 2, ZeRO-1
                                 -> etp 2 x ep 2 over dp 4, ZeRO-3
  etp 2 x ep 2 over dp 4, ZeRO-1 -> ep 2 x edp 2, ZeRO-1
                                 -> ep 4, ZeRO-1
                                 -> tp 2 with ep 2 folded, ZeRO-1
  ep 2 x edp 2, ZeRO-1           -> tp 2 folded into the experts' grid (ep 1, edp 4), ZeRO-1

and `fivefold convert` of the etp 2 x ep 2 checkpoint.

Tolerances. Resharding is a copy of rows and columns: every weight, AdamW moment and step
count, and every routing bias, read back whole from the checkpoint the new layout saves right
after loading, equals the old checkpoint's bit for bit (torch.equal). The resumed loss of step
4 equals the one-process run's within rel 2e-5, tests/test_moe_resharding.py's tolerance (fp32
on CPU, lr 1e-3; the layouts' sums in steps 1-3 run in another float order). The converted
Mixtral folder's logits in transformers equal fivefold's on the checkpoint's weights within
rtol 1e-4, atol 1e-5 (tests/test_hf.py's tolerance).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fivefold.config import load_config
from fivefold.testing import run_on_ranks
from fivefold.train.checkpoint import step_dir
from fivefold.train.checkpoint_export import read_expert_biases, read_training_state
from fivefold.train.trainer import Trainer

from parity import CPU, assert_hf_export_matches, assert_state_equal
from test_moe_resharding import (BIAS, LOSS_REL, MOE, SAVE_AT, STEPS,
                                assert_resumes_in_one_process)

ZERO1 = ["parallel.zero_stage=1"]
EP2 = ["parallel.ep=2"] + ZERO1
ETP2 = ["parallel.etp=2"] + ZERO1
ETP2_EP2 = ["parallel.etp=2", "parallel.ep=2"]
MODEL_KEYS = {"ep2": BIAS, "etp2 x ep2": []}  # by old layout
TWO_RANKS = {"old": {"ep2": EP2}, "changes": {"ep2 -> etp2": ("ep2", ETP2)}}
FOUR_RANKS = {"old": {"ep2": EP2, "etp2 x ep2": ETP2_EP2 + ZERO1},
              "changes": {
                  "ep2 -> etp2 x ep2 over tp2 x dp2": ("ep2", ETP2_EP2 + ["parallel.tp=2"]
                                                       + ZERO1),
                  "ep2 -> etp2 x ep2 ZeRO-3": ("ep2", ETP2_EP2 + ["parallel.zero_stage=3"]),
                  "etp2 x ep2 -> ep2": ("etp2 x ep2", EP2),
                  "etp2 x ep2 -> ep4": ("etp2 x ep2", ["parallel.ep=4"] + ZERO1),
                  "etp2 x ep2 -> tp2 x ep2 folded": ("etp2 x ep2", ["parallel.tp=2"] + EP2),
                  "ep2 -> tp2 folded": ("ep2", ["parallel.tp=2"] + ZERO1)}}


def _on_ranks(rt, sets, layouts, tmp):
    """Old layouts: 3 steps and a checkpoint each; then per change the resumed layout's saved
    state and its losses from the step it resumed at."""
    for old, layout in layouts["old"].items():
        trainer = Trainer(load_config(None, sets + MODEL_KEYS[old] + layout), rt,
                          f"{tmp}/{old}")
        for s in range(SAVE_AT):
            trainer.train_step(s)
        trainer._save(SAVE_AT)
    out = {}
    for k, (name, (old, new)) in enumerate(layouts["changes"].items()):
        if rt.rank == 0:
            shutil.copytree(step_dir(f"{tmp}/{old}", SAVE_AT), step_dir(f"{tmp}/{k}", SAVE_AT))
        dist.barrier()
        resumed = Trainer(load_config(None, sets + MODEL_KEYS[old] + new), rt, f"{tmp}/{k}")
        start = resumed._resume()
        resumed.run_dir = resumed.run_dir.with_name(f"{k}.loaded")
        resumed._save(start)
        out[name] = (start, [resumed.train_step(s).loss for s in range(start, STEPS)])
    return out


@pytest.fixture(scope="module")
def sets(parity_overrides):
    return parity_overrides + MOE


class OneProcess(dict):
    """The one-process Trainer's losses of 4 straight steps, by old layout's model keys,
    trained when a test first asks for them."""

    def __init__(self, sets: list[str], tmp_path_factory):
        super().__init__()
        self.sets, self.tmp = sets, tmp_path_factory

    def __missing__(self, old: str) -> list[float]:
        trainer = Trainer(load_config(None, self.sets + MODEL_KEYS[old]), CPU,
                          self.tmp.mktemp("plain"))
        self[old] = [trainer.train_step(s).loss for s in range(STEPS)]
        return self[old]


@pytest.fixture(scope="module")
def one_process(sets, tmp_path_factory):
    return OneProcess(sets, tmp_path_factory)


def check_resharded(tmp, layouts: dict, results: list, sets: list[str], one_process: dict):
    """Every change holds, right after resuming, the old checkpoint's whole experts, dense
    weights, AdamW moments, step counts and routing biases bit for bit (the experts' moments
    not empty, the biases not zero); its step-4 loss is the one-process run's within rel
    2e-5 on every rank."""
    cfg = load_config(None, sets).model
    for k, (name, (old, _)) in enumerate(layouts["changes"].items()):
        saved, loaded = step_dir(tmp / old, SAVE_AT), step_dir(tmp / f"{k}.loaded", SAVE_AT)
        want = read_training_state(saved, cfg)
        assert_state_equal(read_training_state(loaded, cfg), want, name)
        assert want[0]["layers.0.mlp.w1"].shape == (4, 32, 64), name  # whole experts
        assert all(want[1][f"layers.{i}.mlp.w{j}"]["exp_avg"].abs().flatten(1).sum(1).min() > 0
                   for i in range(2) for j in (1, 2, 3)), name  # every expert was trained
        biases, loaded_biases = read_expert_biases(saved), read_expert_biases(loaded)
        assert biases.keys() == loaded_biases.keys() == ({"layers.0", "layers.1"}
                                                         if MODEL_KEYS[old] else set()), name
        for block, bias in biases.items():
            assert bias.abs().sum() > 0 and torch.equal(loaded_biases[block], bias), name
        start, after = results[0][name]
        assert start == SAVE_AT, name
        assert after == pytest.approx(one_process[old][SAVE_AT:], rel=LOSS_REL), name
    assert all(r == results[0] for r in results[1:])


def unit_keys(step) -> set[str]:
    """The checkpoint's master-weight keys (fivefold.train.checkpoint_export)."""
    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    return {key for key in meta if key.startswith("master.")}


def test_an_ep_checkpoint_resumes_under_etp_and_in_one_process(sets, one_process, tmp_path):
    """2 ranks: ep 2 -> etp 2, bit for bit; then the checkpoint etp 2 saved (its experts in
    etp units) resumes in one process: the plain model, its routing biases and torch's AdamW
    hold exactly its tensors, and step 4 is the one-process run's."""
    results = run_on_ranks(_on_ranks, 2, sets, TWO_RANKS, str(tmp_path), timeout_s=600)
    check_resharded(tmp_path, TWO_RANKS, results, sets, one_process)
    saved = step_dir(tmp_path / "0.loaded", SAVE_AT)  # written by etp 2
    assert {"master.layers.1.experts0of1x0of2.shard0of1",
            "master.layers.1.experts0of1x1of2.shard0of1"} <= unit_keys(saved)
    assert_resumes_in_one_process(saved, sets, tmp_path / "plain", one_process["ep2"],
                                  "etp 2 -> one process")


@pytest.fixture(scope="module")
def four_ranks(sets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etp_reshard")
    return tmp, run_on_ranks(_on_ranks, 4, sets, FOUR_RANKS, str(tmp), timeout_s=1200)


@pytest.mark.slow
def test_etp_checkpoints_reshard_exactly_on_4_ranks(four_ranks, sets, one_process):
    """4 ranks: ep 2 -> etp 2 x ep 2 (over tp 2 x dp 2, and over dp 4 with ZeRO-3), etp 2 x
    ep 2 -> ep 2, ep 4 and tp 2 x ep 2 folded, ep 2 -> tp 2 folded: bit for bit, and step 4
    the one-process run's."""
    tmp, results = four_ranks
    assert {"master.layers.0.experts1of2x1of2.shard0of1"} <= unit_keys(
        step_dir(tmp / "etp2 x ep2", SAVE_AT))
    check_resharded(tmp, FOUR_RANKS, results, sets, one_process)


@pytest.mark.slow
def test_convert_of_an_etp_checkpoint_loads_in_transformers(four_ranks, sets, tmp_path):
    """`fivefold convert` of the etp 2 x ep 2 checkpoint: a Mixtral folder whose per-expert
    tensors are the whole experts (both etp column halves), whose logits in transformers
    equal fivefold's on the checkpoint's weights (rtol 1e-4, atol 1e-5)."""
    tmp, _ = four_ranks
    pre, tensors = assert_hf_export_matches(step_dir(tmp / "etp2 x ep2", SAVE_AT),
                                            tmp_path / "hf")
    assert pre.state["layers.1.mlp.w1"].shape == (4, 32, 64)  # both etp halves of 32 columns
    for e in range(4):  # expert 3: ep rank 1, its columns on etp ranks 0 and 1
        assert torch.equal(tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"],
                           pre.state["layers.1.mlp.w1"][e])
        assert torch.equal(tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"],
                           pre.state["layers.1.mlp.w2"][e])
