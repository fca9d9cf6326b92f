"""What every update rule does the same way: the Updater protocol and the clipped update.

An updater owns a rank's gradients and optimizer step for one update rule
(`ParallelPlan.update`): the trainer calls, per micro-batch, `prepare_backward(last)`,
`backward(loss)` and `after_backward(last)`, then once per step `update(lr, clip, keep)`,
which clips, asks the non-finite guard (`keep`, fivefold.train.nonfinite) and steps or drops
the step; checkpoints go through `checkpoint_state(tag)` and `after_load(state, tag, step)`.

`ClippedUpdater.update` is the synchronous update of every rule whose gradients are all known
before the first parameter changes (everything but LOMO and PipeDream-2BW): unscale (fp16,
fivefold.train.loss_scale), clip the global norm over the plan's axes
(fivefold.parallel.grad_clip), then step unless the guard drops the step or the scaled
gradients overflowed. Subclasses say which gradients clipping reads (`grads_for_norm`) and
how the step is taken (`step`).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.grad_clip import clip_grad_norm_
from fivefold.train.loss_scale import LossScale

Keep = Callable[[torch.Tensor], bool]  # the non-finite guard's decision on a gradient norm


class Updater(Protocol):
    engine: object | None  # the data-parallel engine (pipelines sync through it), or None
    optimizer: object | None  # the torch optimizer DCP saves with the model, or None
    loss_scale: LossScale | None  # fp16's dynamic loss scale, or None

    def prepare_backward(self, last: bool) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def after_backward(self, last: bool) -> None: ...
    def update(self, lr: float, clip: float, keep: Keep) -> torch.Tensor: ...
    def zero_grad(self) -> None: ...
    def first_nonfinite(self) -> str | None: ...
    def torch_optimizers(self) -> list[torch.optim.Optimizer]: ...
    def checkpoint_state(self, tag: str) -> dict: ...
    def after_load(self, state: dict, tag: str, step: int) -> None: ...


class ClippedUpdater:
    """The synchronous update; subclasses provide `grads_for_norm`, `step` and `zero_grad`."""

    engine = None
    optimizer = None

    def __init__(self, norm_axes: list[Axis], fp16: bool):
        self.norm_axes = norm_axes
        self.loss_scale = LossScale() if fp16 else None

    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's forward; `last` ends the step's accumulation."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's loss, multiplied by the fp16 loss scale."""
        (loss * self.loss_scale.factor if self.loss_scale else loss).backward()

    def after_backward(self, last: bool) -> None:
        """After a micro-batch's backward: what the rule's gradient sync does then."""

    def grads_for_norm(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
        """(this rank's gradients, the masks of the elements it counts in the norm)."""
        raise NotImplementedError

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def update(self, lr: float, clip: float, keep: Keep) -> torch.Tensor:
        """Clip, then step unless `keep` or an fp16 overflow drops the step; the norm. The
        overflow test is the norm every rank already shares, so all ranks skip together."""
        grads, counted = self.grads_for_norm()
        if self.loss_scale:
            self.loss_scale.unscale(grads)
        norm = clip_grad_norm_(grads, clip, self.norm_axes, counted)
        overflow = self.loss_scale is not None and not bool(torch.isfinite(norm))
        if keep(norm) and not overflow:
            self.step(lr)
        if self.loss_scale:
            self.loss_scale.update(overflow)
        self.zero_grad()
        return norm

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """This rank's torch optimizers for the memory report (the plain path's only)."""
        return []
