"""Faults a run survives: a full disk during a save, non-finite steps, a collective that one
rank never reaches (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import fivefold.train.checkpoint as ckpt
from fivefold.config import load_config
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

CPU = Runtime(0, 1, 0, torch.device("cpu"))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rng_state_round_trips_through_weights_only(tmp_path):
    """rank_R.pt holds tensors and plain values only: torch.load(weights_only=True) reads it
    and every generator continues where it was saved."""
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    torch.save({"rng": ckpt.rng_state(CPU.device)}, tmp_path / "r.pt")
    expected = torch.rand(3), np.random.rand(3), random.random()
    ckpt.set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"], CPU.device)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_disk_full_during_save_keeps_the_last_checkpoint(tiny_overrides, tmp_path, monkeypatch):
    """ENOSPC while DCP writes the step-4 checkpoint: the run stops with a message naming the
    checkpoint that stands, no `.partial` is left, and the rerun resumes from step 2 (its
    rank_0.pt read with weights_only) to the very losses of an uninterrupted run (fp32)."""
    sets = tiny_overrides + ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=100",
                             "train.eval_batches=1", "train.sample_tokens=0"]
    cfg = load_config(None, sets)
    Trainer(cfg, CPU, tmp_path / "straight").run()
    real_save = ckpt.dcp.save

    def disk_full(state, checkpoint_id):
        if "step_00000004" in str(checkpoint_id):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    run_dir = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointWriteError,
                       match=r"could not write checkpoint step_00000004 .*No space left on "
                             r"device.*step_00000002, is intact"):
        Trainer(cfg, CPU, run_dir).run()
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(run_dir).name == "step_00000002"
    assert not list((run_dir / "checkpoints").glob(f"*{ckpt.PARTIAL}"))
    Trainer(cfg, CPU, run_dir).run()
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 5))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["grad_norm"]) for r in straight]
