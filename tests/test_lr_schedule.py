"""The learning-rate schedules (fivefold.lr_schedule): their shapes, the automatic warm-up,
extending a run, and a WSD run's exact resume."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fivefold.config import ConfigError, TrainConfig, load_config
from fivefold.lr_schedule import lr_at, resumed_length
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer
from fivefold.validate import validate
from test_train import read_metrics, straight_and_resumed

CPU = Runtime(0, 1, 0, torch.device("cpu"))
TOL = 1e-12  # relative: the shapes' closed forms against the float arithmetic


def train(**keys) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), lr=1.0, min_lr_ratio=0.1, **keys)


def old_cosine(step: int, t: TrainConfig) -> float:
    """The warm-up + cosine of fivefold before train.lr_schedule, verbatim."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_default_cosine_is_the_old_schedule_bit_for_bit():
    """Defaults: 200 steps warm up 20 (automatic) and the lr of every step, and past the
    end, equals the former schedule's exactly."""
    t = dataclasses.replace(TrainConfig())
    assert t.lr_schedule == "cosine" and t.warmup_steps is None and t.steps == 200
    old = dataclasses.replace(t, warmup_steps=20)
    assert [lr_at(s, t) for s in range(210)] == [old_cosine(s, old) for s in range(210)]


@pytest.mark.parametrize("schedule, points", [
    # steps 11, warm-up 2: the decay runs over steps 2..10 (progress (step - 2) / 8)
    ("cosine", {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.55, 10: 0.1, 30: 0.1}),
    ("linear", {0: 0.5, 2: 1.0, 4: 0.775, 6: 0.55, 10: 0.1, 30: 0.1}),
    ("constant", {0: 0.5, 1: 1.0, 6: 1.0, 10: 1.0, 30: 1.0}),
])
def test_schedule_shapes(schedule, points):
    t = train(steps=11, warmup_steps=2, lr_schedule=schedule)
    assert {s: lr_at(s, t) for s in points} == pytest.approx(points, rel=TOL)


@pytest.mark.parametrize("shape, points", [
    # steps 20, warm-up 2, decay_fraction 0.2: stable through step 15, the decay's
    # progress at steps 16..19 is 1/4, 2/4, 3/4, 1
    ("linear", {0: 0.5, 2: 1.0, 15: 1.0, 16: 0.775, 17: 0.55, 19: 0.1, 25: 0.1}),
    ("cosine", {1: 1.0, 15: 1.0, 17: 0.55, 19: 0.1}),
    ("sqrt", {1: 1.0, 15: 1.0, 16: 0.55, 19: 0.1, 25: 0.1}),
])
def test_wsd_shapes(shape, points):
    t = train(steps=20, warmup_steps=2, lr_schedule="wsd", decay_fraction=0.2,
              decay_shape=shape)
    assert {s: lr_at(s, t) for s in points} == pytest.approx(points, rel=TOL)


def test_wsd_warmup_longer_than_the_stable_phase_shortens_the_decay():
    t = train(steps=10, warmup_steps=8, lr_schedule="wsd", decay_fraction=0.5,
              decay_shape="linear")
    assert [lr_at(s, t) for s in (7, 8, 9)] == pytest.approx([1.0, 0.55, 0.1], rel=TOL)


@pytest.mark.parametrize("steps, warmup", [(200, 20), (1000, 20), (100, 10), (10, 1),
                                           (5, 0)])
def test_automatic_warmup(steps, warmup):
    """train.warmup_steps absent: min(20, steps // 10) warm-up steps, then the peak."""
    t = train(steps=steps)
    assert [lr_at(s, t) for s in range(warmup)] == [(s + 1) / warmup for s in range(warmup)]
    assert lr_at(warmup, t) == 1.0


def test_short_runs_are_accepted_and_explicit_warmup_still_checked():
    validate(load_config(None, ["train.steps=10"]))
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, ["train.steps=10", "train.warmup_steps=11"]))
    assert info.value.key == "train.warmup_steps"


@pytest.mark.parametrize("overrides, key", [
    (["train.lr_schedule=step"], "train.lr_schedule"),
    (["train.decay_shape=exp"], "train.decay_shape"),
    (["train.decay_fraction=0"], "train.decay_fraction"),
    (["train.decay_fraction=1.5"], "train.decay_fraction"),
    (["train.decay_fraction=nan"], "train.decay_fraction"),
])
def test_rejected(overrides, key):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, overrides))
    assert info.value.key == key


def test_resumed_length_rule():
    """Extending keeps a decayed schedule (the added steps hold the floor), re-lays out one
    whose taken steps the longer layout leaves unchanged (WSD in its stable phase), and
    fewer or equal steps lay it out for train.steps."""
    cosine = train(steps=400, warmup_steps=2)
    length, note = resumed_length(200, cosine, 200)
    assert length == 200 and "steps 201-400 hold its last lr 0.1" in note
    assert lr_at(399, cosine, length) == pytest.approx(0.1, rel=TOL)
    length, note = resumed_length(200, cosine, 100)
    assert length == 200 and "steps 101-200 keep their cosine schedule" in note
    wsd = train(steps=400, warmup_steps=2, lr_schedule="wsd")
    assert resumed_length(200, wsd, 100)[0] == 400  # stable until step 180 of 200
    assert resumed_length(200, wsd, 190)[0] == 200  # decaying already
    assert resumed_length(400, wsd, 100) == (400, None)
    assert resumed_length(800, wsd, 100) == (400, None)


def test_wsd_run_resumes_bit_identically(tiny_overrides, tmp_path):
    """fp32 on CPU: a WSD run (decaying over its last 4 of 8 steps) crashed at step 6 and
    resumed from step 4 has the uninterrupted run's losses, gradient norms and lrs exactly."""
    sets = tiny_overrides + ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=4",
                             "train.sample_tokens=0", "train.lr_schedule=wsd",
                             "train.decay_fraction=0.5"]
    straight, resumed, resumed_from = straight_and_resumed(load_config(None, sets), tmp_path,
                                                           crash_at=6)
    assert resumed_from == "step_00000004"
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert len({r["lr"] for r in straight}) > 3  # warm-up, stable and decay all ran
    for a, b in zip(straight, resumed):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])


def test_extending_a_finished_run_keeps_its_schedule(tiny_overrides, tmp_path, capsys):
    """A finished 4-step cosine run extended to 8 steps: steps 1-4 keep the lr of the
    unextended run, 5-8 hold the floor (no jump back up) and a line says so."""
    sets = tiny_overrides + ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=100",
                             "train.sample_tokens=0"]
    Trainer(load_config(None, sets), CPU, tmp_path / "straight").run()
    Trainer(load_config(None, sets), CPU, tmp_path / "run").run()
    capsys.readouterr()
    Trainer(load_config(None, sets + ["train.steps=8"]), CPU, tmp_path / "run").run()
    assert "steps 5-8 hold its last lr" in capsys.readouterr().out
    straight, extended = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "run")
    assert [r["lr"] for r in extended[:4]] == [r["lr"] for r in straight]
    floor = 1e-2 * 0.1  # tiny_overrides' lr x the default min_lr_ratio
    assert [r["lr"] for r in extended[4:]] == pytest.approx([floor] * 4, rel=TOL)
    assert straight[-1]["lr"] == pytest.approx(floor, rel=TOL)
