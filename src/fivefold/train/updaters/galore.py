"""Data-parallel GaLore's update rule (`plan.update == "galore-dp"`): every rank keeps the
plain model's whole matrices and fivefold.memory.galore_dp.GaLoreDataParallel, which this
wraps, reduces their gradients after the step's backward, gives clipping its view of them
and steps the low-rank moments and the sharded rest."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.comm.ledger import Ledger
from fivefold.config import TrainConfig
from fivefold.memory.galore_dp import GaLoreDataParallel
from fivefold.train.nonfinite import first_nonfinite
from fivefold.train.updaters.base import ClippedUpdater


class GaLoreUpdater(ClippedUpdater):
    def __init__(self, model: nn.Module, train: TrainConfig, zero_stage: int, dp_axis: Axis,
                 ledger: Ledger, norm_axes: list[Axis], fp16: bool):
        super().__init__(norm_axes, fp16)
        self.galore = GaLoreDataParallel(model, train, zero_stage, dp_axis, ledger)

    def after_backward(self, last: bool) -> None:
        self.galore.after_backward(last=last)

    def grads_for_norm(self):
        return self.galore.norm_grads()

    def step(self, lr: float) -> None:
        self.galore.step(lr)

    def zero_grad(self) -> None:
        self.galore.zero_grad()

    def first_nonfinite(self) -> str | None:
        return first_nonfinite(self.galore.named_grads())

    def checkpoint_state(self, tag: str) -> dict[str, torch.Tensor]:
        return self.galore.checkpoint_state()

    def after_load(self, state: dict, tag: str, step: int) -> None:
        """Loaded in place with the model."""
