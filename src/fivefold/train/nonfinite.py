"""The non-finite guard: a step whose loss or global gradient norm is NaN or infinite is
skipped or stops the run (`train.on_nonfinite`), with the same decision on every rank.

The decision reads only values every rank already shares: the loss summed over the token
axes and the gradient norm all-reduced over the plan's axes (fivefold.parallel.grad_clip),
so no collective is added and no rank can decide alone. It is taken after the backward and
before any parameter or optimizer state changes:

- the synchronous update (one plain rank, the data-parallel engine, synchronous pipeline
  schedules): after clipping measured the norm; "skip" drops the gradients and steps nothing;
- LOMO with clipping: between its two backward passes (the first only measures the norm), so
  "skip" never runs the pass that applies the update. LOMO without clipping applies each
  gradient inside its only backward: "stop" then raises after that update, and "skip" is
  refused at config time (fivefold.validate);
- with fp16's loss scale (fivefold.train.loss_scale) only the loss is checked: an
  overflowing gradient is the loss scale's to skip (it halves), not a fault;
- PipeDream-2BW updates each stage inside its schedule, with per-stage clipping and no
  global norm: "skip" is refused at config time and "stop" checks nothing there.

"stop" raises `NonFiniteError` naming the step (as the metrics count it, from 1) and the first
parameter, in this rank's parameter order, whose gradient holds a non-finite value.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was not finite under train.on_nonfinite = "stop"."""


def first_nonfinite(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first gradient holding a NaN or an infinity, or None."""
    for name, grad in named_grads:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None


def flat_unit_grads(units, grads: list[torch.Tensor | None]) -> Iterable[tuple[str, torch.Tensor]]:
    """Each parameter's slice of the flat gradients of the data-parallel engine's units
    (fivefold.parallel.flat_unit): whole units, or this rank's shard of each (ZeRO >= 1)."""
    for unit, grad in zip(units, grads):
        if grad is None:
            continue
        start = 0 if grad.numel() == unit.padded else unit.shard_slice.start
        for name, off, n in zip(unit.names, unit.offsets, unit.numels):
            lo, hi = max(off - start, 0), min(off + n - start, grad.numel())
            if lo < hi:
                yield name, grad[lo:hi]


def keep_step(policy: str, step: int, loss: float, grad_norm: float, rank: int,
              offender: Callable[[], str | None], check_norm: bool = True) -> bool:
    """True when the update of `step` (0-based) may be applied. A non-finite `loss` (or
    `grad_norm`, when `check_norm`) returns False under "skip" and raises under "stop", naming
    the parameter `offender()` finds on this rank."""
    if math.isfinite(loss) and (math.isfinite(grad_norm) or not check_norm):
        return True
    if policy == "skip":
        return False
    name = offender()
    where = (f"the first parameter with a non-finite gradient on rank {rank} is {name}"
             if name else f"no gradient on rank {rank} holds a non-finite value (another "
                          "rank's does, or only the loss is non-finite)")
    raise NonFiniteError(f"step {step + 1}: non-finite loss ({loss}) or gradient norm "
                         f"({grad_norm}); {where}. The run stops (train.on_nonfinite = "
                         "'stop'); 'skip' drops such updates instead")
