"""A checkpoint written under one layout resumes under another (fivefold.train.reshard).

Seven changes of layout on 4 gloo ranks, each: the old layout trains 2 steps and saves; the
new layout resumes from that checkpoint and trains steps 3-4; the reference is the
single-process Trainer, the reference of all parity tests (and, with `-m slow`, the new
layout trained straight through 4 steps from the same initial state):

  dp 4, ZeRO-1                    -> dp 2 x tp 2, ZeRO-1 (vocabulary 511: one padding row)
  dp 2 x tp 2, ZeRO-1             -> pp 2 x dp 2, ZeRO-1, 1F1B (tied embeddings)
  dp 4, ZeRO-3 in groups of 2     -> dp 4, ZeRO-1 over all 4 (stage and group)
  pp 2 x dp 2, 1F1B (2 + 2 blocks) -> pp 2 x dp 2, interleaved (vpp 2, 1 block per chunk;
                                     tied embeddings)
  cp 2 x dp 2 (ring), ZeRO-1      -> dp 4, ZeRO-1 (ZeRO shards over dp x cp: 4 shards
                                     either way, but other tokens per rank)
  dp 4, DDP, Muon                 -> pp 2 x dp 2, 1F1B, Muon (whole matrices' momentum)
  dp 4, ZeRO-3 with qwZ and qgZ   -> dp 4, ZeRO-1 (units padded to whole quantization blocks;
                                     its quantized steps 1-2 are other math: state only)

Resharding itself is exact: right after the resume the new layout saves, and every weight,
AdamW moment and step count and Muon momentum read back from that checkpoint equals the old
checkpoint's bit for bit (both read whole through fivefold.train.checkpoint_export). The
resumed losses then differ from the straight run's only by the float order of the layouts'
sums in steps 1-2, so the tolerance is the parity tests' (tests/test_pipeline_trainer.py,
fp32 on CPU, lr 1e-3, Adam eps 1e-6; tests/test_data_parallel.py for Muon): losses rel 2e-5.
The same holds for a checkpoint taken into one process (dp 2 x tp 2 -> the plain Trainer and
torch's AdamW), and what cannot be resharded is refused with the key to change.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import plan_from_config
from fivefold.testing import run_on_ranks
from fivefold.train.checkpoint import check_layout, layout_record, step_dir
from fivefold.train.checkpoint_export import read_training_state
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer

from parity import CPU, assert_state_equal

STEPS, SAVE_AT = 4, 2
ZERO1 = ["parallel.zero_stage=1"]
TIED = ["model.tied_embeddings=true"]
MUON = ["train.optimizer=muon"]  # ZeRO-0, no tp: it orthogonalizes whole matrices
PP2 = ["parallel.pp=2", "parallel.micro_batch=1"]
CHANGES = {  # name: (on both sides and the one-process run, old layout, new), on 4 ranks
    "dp4 -> dp2 x tp2": ([], ZERO1, ZERO1 + ["parallel.tp=2"]),
    "dp2 x tp2 -> pp2 x dp2 (tied)": (TIED, ZERO1 + ["parallel.tp=2"],
                                      ZERO1 + PP2 + ["parallel.schedule='1f1b'"]),
    "ZeRO-3 (group 2) -> ZeRO-1": ([], ["parallel.zero_stage=3", "parallel.zero_group=2"], ZERO1),
    "1F1B -> interleaved (tied)": (TIED, ZERO1 + PP2 + ["parallel.schedule='1f1b'"],
                                   ZERO1 + PP2 + ["parallel.schedule='interleaved'",
                                                  "parallel.vpp=2"]),
    "cp2 x dp2 -> dp4": ([], ZERO1 + ["parallel.cp=2", "parallel.cp_mode='ring'"], ZERO1),
    "dp4 -> pp2 x dp2 (Muon)": (MUON, [], PP2 + ["parallel.schedule='1f1b'"]),
    "ZeRO-3 qwZ qgZ -> ZeRO-1": ([], ["parallel.zero_stage=3", "parallel.qwz=true",
                                      "parallel.qgz=true"], ZERO1),
}
QUANTIZED = {"ZeRO-3 qwZ qgZ -> ZeRO-1"}  # other math before the checkpoint: state only
LOSS_REL = 2e-5  # the parity tolerance (module docstring)


@pytest.fixture(scope="module")
def base(tiny_overrides):
    sets = tiny_overrides + ["model.layers=4", "model.vocab=511", "parallel.global_batch=8",
                             "train.lr=1e-3", "train.eps=1e-6", "train.sample_tokens=0",
                             f"train.steps={STEPS}"]
    prepare_data(load_config(None, sets))  # tokenized once, before ranks start
    return sets


def _changes(rt, base, tmp):
    """Per change of layout: the old layout's losses of steps 1-2 (and its checkpoint), and
    the new layout's losses of steps 3-4 after resharding (having first saved what it loaded
    to `{tmp}/{k}/loaded`)."""
    out = []
    for k, (common, old, new) in enumerate(CHANGES.values()):
        first = Trainer(load_config(None, base + common + old), rt, f"{tmp}/{k}/run")
        before = [first.train_step(s).loss for s in range(SAVE_AT)]
        first._save(SAVE_AT)
        resumed = Trainer(load_config(None, base + common + new), rt, f"{tmp}/{k}/run")
        start = resumed._resume()
        resumed.run_dir = resumed.run_dir.with_name("loaded")  # what the new layout holds now
        resumed._save(start)
        out.append((start, before, [resumed.train_step(s).loss for s in range(start, STEPS)]))
    return out


def _straight(rt, base, tmp):
    """Per change of layout but the quantized one: the new layout's losses of 4 straight
    steps."""
    out = {}
    for k, (name, (common, _, new)) in enumerate(CHANGES.items()):
        if name not in QUANTIZED:
            trainer = Trainer(load_config(None, base + common + new), rt, f"{tmp}/{k}")
            out[name] = [trainer.train_step(s).loss for s in range(STEPS)]
    return out


@pytest.fixture(scope="module")
def resharded(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    results = run_on_ranks(_changes, 4, base, str(tmp), timeout_s=600)
    return tmp, results


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory):
    """The single-process Trainer's losses of 4 straight steps, per model and optimizer."""
    losses = {}
    for common, _, _ in CHANGES.values():
        if tuple(common) not in losses:
            trainer = Trainer(load_config(None, base + common), CPU,
                              tmp_path_factory.mktemp("plain"))
            losses[tuple(common)] = [trainer.train_step(s).loss for s in range(STEPS)]
    return losses



def test_resharded_state_is_the_saved_state_exactly(resharded, base):
    """After resharding, the new layout's weights and optimizer state (AdamW's moments and
    step counts, Muon's momentum; saved and read back whole) equal the old checkpoint's,
    tensor for tensor, bit for bit; the step count is the 2 steps taken, and the moments are
    not empty."""
    tmp, _ = resharded
    for k, (label, (common, _, _)) in enumerate(CHANGES.items()):
        cfg = load_config(None, base + common).model
        old = read_training_state(step_dir(tmp / str(k) / "run", SAVE_AT), cfg)
        loaded = read_training_state(step_dir(tmp / str(k) / "loaded", SAVE_AT), cfg)
        assert_state_equal(loaded, old, label)
        states = old[1]
        assert {float(s["step"]) for s in states.values() if "step" in s} == {SAVE_AT}, label
        kinds = {kind for s in states.values() for kind in s}
        assert kinds == ({"exp_avg", "exp_avg_sq", "step", "momentum_buffer"} if common == MUON
                         else {"exp_avg", "exp_avg_sq", "step"}), label
        assert all(s["exp_avg"].abs().sum() > 0 for s in states.values() if "exp_avg" in s)


def test_resumed_losses_follow_one_process(resharded, one_process):
    """The new layout resumes at step 2, and the losses of steps 1-2 before and 3-4 after
    resharding are one process's within rel 2e-5 (module docstring); every rank logs the
    same."""
    _, results = resharded
    for (label, (common, _, _)), (start, before, after) in zip(CHANGES.items(), results[0]):
        assert start == SAVE_AT, label
        if label not in QUANTIZED:
            assert before + after == pytest.approx(one_process[tuple(common)],
                                                   rel=LOSS_REL), label
    for rank_results in results[1:]:
        assert [r[2] for r in rank_results] == [r[2] for r in results[0]]


@pytest.mark.slow
def test_resumed_losses_follow_the_new_layout_run_straight(resharded, base, one_process,
                                                           tmp_path):
    """The resumed losses of steps 3-4 are those of the new layout run straight through
    from step 0 (its own start of 4 ranks), which is one process's, within rel 2e-5. Slow:
    `test_resumed_losses_follow_one_process` compares both sides of each change with one
    process, and each new layout's straight parity is the default suite's
    (tests/test_data_parallel.py, test_tensor_parallel.py, test_pipeline_parity.py)."""
    _, results = resharded
    straight = run_on_ranks(_straight, 4, base, str(tmp_path), timeout_s=600)[0]
    for (label, (common, _, _)), (_, _, after) in zip(CHANGES.items(), results[0]):
        if label not in QUANTIZED:
            assert after == pytest.approx(straight[label][SAVE_AT:], rel=LOSS_REL), label
            assert straight[label] == pytest.approx(one_process[tuple(common)],
                                                    rel=LOSS_REL), label


def test_a_parallel_checkpoint_resumes_in_one_process(resharded, base, one_process,
                                                      tmp_path, capsys):
    """dp 2 x tp 2 (ZeRO-1, tied, padded vocabulary) -> one process: the plain model and
    torch's AdamW hold exactly the checkpoint's tensors, the resume says what it resharded,
    and the continued losses are the one-process run's (rel 2e-5)."""
    tmp, _ = resharded
    saved = step_dir(tmp / "1" / "run", SAVE_AT)  # change 1's old layout: dp 2 x tp 2
    shutil.copytree(saved, step_dir(tmp_path, SAVE_AT))
    cfg = load_config(None, base + TIED)
    trainer = Trainer(cfg, CPU, tmp_path)
    assert trainer._resume() == SAVE_AT
    assert "resharded" in capsys.readouterr().out
    want = read_training_state(saved, cfg.model)
    names = {id(q): n for n, q in trainer.model.named_parameters()}
    got = ({n: q.detach() for n, q in trainer.model.named_parameters()},
           {names[id(q)]: state for q, state in trainer.optimizer.state.items()})
    assert_state_equal(got, want, "one process")
    losses = [trainer.train_step(s).loss for s in range(SAVE_AT, STEPS)]
    assert losses == pytest.approx(one_process[tuple(TIED)][SAVE_AT:], rel=LOSS_REL)


def _meta(base, sets):
    cfg = load_config(None, base + sets)
    return {"config": cfg.to_dict(), **layout_record(plan_from_config(cfg, 4, "fp32"))}


@pytest.mark.parametrize("old, new, key", [
    (["parallel.pp=2", "parallel.schedule='pipedream-2bw'"],
     ["parallel.pp=2", "parallel.schedule='1f1b'"], "parallel.schedule"),
    (["parallel.pp=2", "parallel.schedule='pipedream-2bw'"],
     ["parallel.pp=4", "parallel.schedule='pipedream-2bw'"], "parallel.pp"),
    (["train.optimizer='sgd'"], ["train.optimizer='sgd'", "parallel.pp=2"],
     "train.optimizer"),
    ([], ["train.optimizer='muon'", "parallel.pp=2"], "train.optimizer"),
    (["train.optimizer='muon'"], ["train.optimizer='muon'", "parallel.zero_stage=1"],
     "parallel.zero_stage"),
    ([], ["parallel.global_batch=16"], "parallel.global_batch"),
])
def test_what_cannot_be_resharded_is_refused(base, old, new, key):
    """PipeDream-2BW's weight versions, SGD's state, sharded Muon's, a change of optimizer
    and a changed global batch: refused with the key, the two values and what to do; a plain change of
    layout is not."""
    new_plan = plan_from_config(load_config(None, base + new), 4, "fp32")
    path = Path("run/checkpoints/step_00000002")
    with pytest.raises(ConfigError) as err:
        check_layout(path, _meta(base, old), new_plan)
    assert err.value.key == key and "resume with" in str(err.value)
    plan = plan_from_config(load_config(None, base + ["parallel.tp=2"]), 4, "fp32")
    assert check_layout(path, _meta(base, []), plan) == ["parallel.tp", "parallel.zero_group",
                                                         "parallel.dp"]


def test_a_refused_resume_stops_before_ranks_start(resharded, base, monkeypatch, capsys):
    """`fivefold train --nproc 4` with another global batch on a run directory that holds a
    checkpoint: exit 2 with the message, and no rank is launched."""
    from fivefold import cli
    import fivefold.train.launch as launch

    tmp, _ = resharded
    monkeypatch.setattr(launch, "launch_local", lambda *a: pytest.fail("ranks started"))
    sets = [arg for s in base for arg in ("--set", s)]
    code = cli.main(["train", "--nproc", "4", "--run-dir", str(tmp / "0" / "run"), *sets,
                     "--set", "parallel.global_batch=16"])
    assert code == 2
    assert "`parallel.global_batch`" in capsys.readouterr().err


def test_a_rank_reads_only_the_units_it_needs(resharded, base, monkeypatch):
    """Reading the pp 2 x dp 2 checkpoint (change 3's old layout) for the parameters of block
    0 loads block 0's unit alone (every shard of its weights, moments and step), and gives
    back exactly those parameters, equal to the whole read's."""
    import fivefold.train.checkpoint_export as export

    tmp, _ = resharded
    saved, cfg = step_dir(tmp / "3" / "run", SAVE_AT), load_config(None, base + TIED).model
    whole = read_training_state(saved, cfg)
    block0 = {name for name in whole[0] if name.startswith("layers.0.")}
    loaded = []
    real_load = export._load
    monkeypatch.setattr(export, "_load", lambda state, step: (loaded.extend(state),
                                                               real_load(state, step)))
    weights, states = read_training_state(saved, cfg, names=block0)
    assert loaded and all(".layers.0.shard" in key for key in loaded), loaded
    assert {key.split(".")[0] for key in loaded} == {"master", "exp_avg", "exp_avg_sq", "step"}
    assert weights.keys() == states.keys() == block0
    assert_state_equal((weights, states), ({n: whole[0][n] for n in block0},
                                            {n: whole[1][n] for n in block0}), "block 0")
