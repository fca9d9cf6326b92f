"""When the trainer saves a checkpoint: every `train.checkpoint_every` steps, at the end, and,
with `train.checkpoint_minutes`, once that much wall time has passed since the last save.

A save is collective (DCP writes shards, barriers close it), so every rank must decide to
save at the same step. Steps are the same on every rank; clocks are not. The time-based
decision is therefore rank 0's alone: after each step rank 0 sets a flag from its clock and
broadcasts it over all ranks (fivefold.comm.collectives, so the ledger counts its 4 bytes),
and every rank saves or not by that flag. The bound on lost work after a crash is then one
interval of steps or minutes, whichever comes first, which is what `--max-restarts` resumes
from (docs/reliability.md).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.config import TrainConfig


class SaveSchedule:
    """`due(done)` after each step: save now? `world` spans every rank (None without
    `checkpoint_minutes`); `clock` is seconds (time.monotonic; a test hands each rank its
    own)."""

    def __init__(self, t: TrainConfig, world: Axis | None, device: torch.device,
                 clock: Callable[[], float] = time.monotonic):
        self.every, self.steps, self.minutes = t.checkpoint_every, t.steps, t.checkpoint_minutes
        self.world, self.device, self.clock = world, device, clock
        self.last_save = clock()

    def due(self, done: int) -> bool:
        due = done % self.every == 0 or done == self.steps
        if self.minutes is not None and not due:
            late = self.clock() - self.last_save >= 60.0 * self.minutes
            flag = torch.tensor([1.0 if late else 0.0], device=self.device)
            C.broadcast(flag, self.world, 0, "checkpoint_clock")  # rank 0 decides for all
            due = bool(flag.item())
        if due:
            self.last_save = self.clock()
        return due
