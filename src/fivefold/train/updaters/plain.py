"""The update rules that keep the plain model's parameters as they are: torch's optimizer on
one rank (`plan.update == "plain"`, the reference every layout is compared with), each
PipeDream-2BW stage's own optimizer and weight versions ("pipedream-2bw") and LOMO's SGD fused
into backward ("lomo", fivefold.memory.lomo). Their checkpoints are the model's and the torch
optimizer's state dicts, as DCP's get_state_dict gives them."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fivefold.comm.collectives import Axis
from fivefold.config import TrainConfig
from fivefold.memory.lomo import FusedSGD
from fivefold.optim import OptimizerPair, build_optimizer
from fivefold.train.memory_report import MemoryProbe
from fivefold.train.nonfinite import first_nonfinite
from fivefold.train.updaters.base import ClippedUpdater, Keep


class PlainUpdater(ClippedUpdater):
    """torch's optimizer (fivefold.optim.build_optimizer) on the whole plain model."""

    def __init__(self, model: nn.Module, train: TrainConfig, device: torch.device,
                 norm_axes: list[Axis], fp16: bool, memory: MemoryProbe):
        super().__init__(norm_axes, fp16)
        self.model, self.memory = model, memory
        self.optimizer = build_optimizer(model, train, device)

    def grads_for_norm(self):
        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        self.memory.note_grads(grads)
        return grads, None

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def first_nonfinite(self) -> str | None:
        return first_nonfinite((n, q.grad) for n, q in self.model.named_parameters()
                               if q.requires_grad)

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizer if isinstance(self.optimizer, OptimizerPair)
                    else [self.optimizer])

    def _optimizers(self):
        return self.optimizer

    def checkpoint_state(self, tag: str) -> dict:
        """The model's and the optimizer's state dicts; the optimizer's key carries the pp
        and tp ranks (`tag`: each stage's optimizer has its own parameter groups)."""
        model_sd, optim_sd = get_state_dict(self.model, self._optimizers())
        return {"model": model_sd, "optim" + tag: optim_sd}

    def after_load(self, state: dict, tag: str, step: int) -> None:
        set_state_dict(self.model, self._optimizers(), model_state_dict=state["model"],
                       optim_state_dict=state["optim" + tag])


class StageUpdater(PlainUpdater):
    """PipeDream-2BW: the stage's optimizer, stepped by its schedule
    (fivefold.parallel.pipeline.pipedream_2bw) right after the stage's last backward of a
    step, with per-stage clipping; there is no global norm (NaN) and nothing left for the
    trainer's update. `versions` is the schedule, which holds the older weight version."""

    versions = None  # the PipeDream2BWEngine, set by fivefold.train.pipeline_step

    def update(self, lr: float, clip: float, keep: Keep) -> torch.Tensor:
        return torch.tensor(math.nan)

    def checkpoint_state(self, tag: str) -> dict:
        return {**super().checkpoint_state(tag), "versions": self.versions.checkpoint_state()}

    def after_load(self, state: dict, tag: str, step: int) -> None:
        super().after_load(state, tag, step)
        if step < self.versions.steps:  # restart the schedule, recomputing what was in flight
            self.versions.resume_at(step)


class LomoUpdater(PlainUpdater):
    """LOMO (fivefold.memory.lomo): no optimizer object; the step's one micro-batch's
    backward is deferred to `update`, which runs it with SGD fused in (two passes with
    clipping, the guard deciding between them), after the trainer has summed the loss.
    With fp16 the loss is multiplied by the loss scale there and the scale updated from the
    first pass's norm: an overflow skips the second pass (fivefold.memory.lomo)."""

    def __init__(self, model: nn.Module, train: TrainConfig, dp_axis: Axis, sharded: bool,
                 fp16: bool):
        ClippedUpdater.__init__(self, [], fp16)
        self.model, self.optimizer = model, None
        self.lomo = FusedSGD(model, train, dp_axis if dp_axis.size > 1 else None, sharded)
        self.loss: torch.Tensor | None = None

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def update(self, lr: float, clip: float, keep: Keep) -> torch.Tensor:
        loss, self.loss = self.loss, None
        scale = self.loss_scale
        if scale is None:
            return self.lomo.step(loss, lr, clip, keep)
        norm = self.lomo.step(loss * scale.factor, lr, clip, keep, scale.inverse())
        scale.update(not bool(torch.isfinite(norm)))
        return norm

    def zero_grad(self) -> None:
        self.loss = None

    def first_nonfinite(self) -> str | None:
        """Gradients are gone: their norms, measured in backward, remain."""
        named = [n for n, q in self.model.named_parameters() if q.requires_grad]
        return first_nonfinite((named[i], norm) for i, norm in sorted(self.lomo.norms.items()))

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def _optimizers(self):
        return []
