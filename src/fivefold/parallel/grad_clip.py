"""Gradient-norm clipping for every layout: one function over the plan's axes.

The global gradient norm is the norm of the plain model's gradient. Each rank holds a part
of it: its ZeRO shard (stages 1-3), its tensor-parallel shards, its pipeline stage's
parameters; the parts are disjoint except for the parameters tensor parallelism replicates
(norm gains), which `counted` masks out on all tp ranks but one. So the squared norm is this
rank's sum of squares, all-reduced over `ParallelPlan.grad_norm_axes` (each axis one 4-byte
fp32 all-reduce, which the ledger model predicts), and every gradient is scaled by
torch.nn.utils.clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)). The local
norm is torch's, a norm of per-tensor norms, so on one rank with no axes this is exactly
torch's clipping (LOMO's fused clipping, fivefold.memory.lomo, matches it bit for bit) for
every finite norm; the data-parallel engine hands it per-parameter parts of its flat
gradients, in model order, so that on one rank its norm is the plain run's too (its updater,
fivefold.train.updaters.engine). A non-finite norm scales nothing.
"""

from __future__ import annotations

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, axes: list[Axis],
                    counted: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Scale `grads` in place so that their global norm is at most `max_norm`; return the
    norm before clipping. `counted[i]`, where given, marks the elements of `grads[i]` this
    rank adds to the norm."""
    device = grads[0].device if grads else torch.device("cpu")
    parts = []
    for i, g in enumerate(grads):
        mask = counted[i] if counted else None
        g32 = g.float()
        part = torch.linalg.vector_norm(g32 if mask is None else torch.where(mask, g32, 0.0))
        parts.append(part.to(device))  # offload: host gradients beside device ones
    norm = (torch.linalg.vector_norm(torch.stack(parts)) if parts
            else torch.zeros((), dtype=torch.float32, device=device))
    if axes:  # the parts of other ranks: sum the squares
        sq = norm.square()
        for axis in axes:
            C.all_reduce(sq, axis, "grad_norm")
        norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # a non-finite norm leaves the gradients as they are (torch would scale them all by NaN):
    # the step is then skipped or stopped (fivefold.train.nonfinite), naming the culprit
    coef = torch.where(torch.isfinite(norm), coef, 1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return norm
