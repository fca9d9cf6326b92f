"""LOMO: the SGD update fused into backward, so no full gradient is ever held.

LOMO (Lv et al., arXiv 2306.09782, Sec. 3.2) updates each parameter the moment its gradient
is complete during backward and frees that gradient at once: the gradient memory drops from
every parameter's to about one parameter's, and there are no optimizer states (plain SGD).
The price is that nothing global can be known before the first update happens: the global
gradient norm needs a first backward that only measures it (Sec. 3.3, the paper's
two-pass clipping), and gradients cannot be accumulated over micro-batches.

`FusedSGD(model, cfg)` registers a post-accumulate-grad hook on every trainable parameter;
`step(loss, lr, max_norm)` runs the backward(s) and returns the gradient norm before
clipping. The arithmetic is exactly torch's `clip_grad_norm_` followed by `torch.optim.SGD`
without momentum over fivefold's parameter groups (L2 weight decay on matrices, as torch's
SGD applies it), so a LOMO step equals that step (tests/test_train.py).

With data parallelism (`axis`, the data-parallel ranks) the hook first sums the gradient
over the ranks (each rank's loss is already divided by the global batch's tokens), then
measures or applies it: the update follows the gradient's all-reduce, one parameter at a
time, in backward's order, which is the same on every rank. The two-pass clipping
all-reduces in both passes (the first pass's norm is the averaged gradient's, so it is
global and the same on every rank), twice the bytes of one pass; no gradient is kept
between them. Parameters stay equal on every rank because each applies the same reduced
gradient (tests/test_galore_dp.py).

With ZeRO (`sharded`, parallel.zero_stage 1 or 2: LOMO keeps neither optimizer state nor a
whole gradient, so both stages shard the same thing, the update) each gradient is
reduce-scattered instead (fivefold.parallel.grad_reduce.reduce_scatter_tensor), each rank
updates its slice of the parameter and all-gathers the parameter back, the same bytes as the
all-reduce; the norm sums every rank's slices in one 4-byte all-reduce per step
(tests/test_lomo_zero.py).

With fp16 loss scaling (fivefold.train.loss_scale; the paper trains in fp16 with dynamic loss
scaling, Sec. 3.3) the loss arrives multiplied by the scale S and `unscale` (fp32 1/S) is
multiplied into each gradient right after its reduction, before it is measured or applied,
as the synchronous path unscales the reduced gradients before clipping. The overflow check
rides on the two-pass clipping: a first pass whose norm is not finite skips the second pass,
so nothing is applied, and the updater halves S. Without clipping (one pass) each gradient
is applied before any overflow could be known, so fp16 LOMO requires train.grad_clip > 0
(fivefold.compositions).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.config import TrainConfig
from fivefold.parallel.grad_reduce import (all_reduce_grad, gather_tensor, reduce_scatter_tensor,
                                           tensor_shard)


class FusedSGD:
    """SGD applied from inside backward, one parameter at a time."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, axis: C.Axis | None = None,
                 sharded: bool = False):
        self.weight_decay, self.axis = cfg.weight_decay, axis
        self.sharded = sharded and axis is not None and axis.size > 1
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.index = {id(q): i for i, q in enumerate(self.params)}
        self.norms: dict[int, torch.Tensor] = {}  # parameter index: its gradient's norm
        self.measure = self.apply = False
        self.lr, self.coef = 0.0, torch.ones(())
        self.unscale: torch.Tensor | None = None  # fp16: 1/S, multiplied into each gradient
        for q in self.params:
            q.register_post_accumulate_grad_hook(self._on_gradient)

    @torch.no_grad()
    def _on_gradient(self, q: torch.Tensor) -> None:
        """The gradient of `q` is complete: measure it, apply it, or both; then drop it."""
        grad, q.grad = q.grad, None
        if self.sharded:
            return self._on_sharded_gradient(q, grad)
        if self.axis is not None:  # one copy of the summed gradient on every rank
            all_reduce_grad(grad, self.axis)
        if self.unscale is not None:
            grad = grad.mul(self.unscale)
        if self.measure:
            self.norms[self.index[id(q)]] = torch.linalg.vector_norm(grad)
        if self.apply:
            grad = grad.mul(self.coef)
            if q.dim() >= 2 and self.weight_decay:
                grad = grad.add(q, alpha=self.weight_decay)
            q.data.add_(grad, alpha=-self.lr)  # .data: no saved view of q is read again

    def _on_sharded_gradient(self, q: torch.Tensor, grad: torch.Tensor) -> None:
        """ZeRO: this rank's slice of the summed gradient; measure it, or update the slice of
        `q` with it and gather `q` whole again."""
        part = reduce_scatter_tensor(grad, self.axis)
        if self.unscale is not None:
            part = part.mul(self.unscale)
        if self.measure:  # this rank's slice: `_norm` sums them over the ranks
            self.norms[self.index[id(q)]] = torch.linalg.vector_norm(part)
        if self.apply:
            shard = tensor_shard(q.data, self.axis)
            part = part.mul(self.coef)
            if q.dim() >= 2 and self.weight_decay:
                part = part.add(shard, alpha=self.weight_decay)
            shard.add_(part, alpha=-self.lr)
            gather_tensor(q.data, shard, self.axis)

    def _norm(self) -> torch.Tensor:
        """The global gradient norm, summed in parameter order as clip_grad_norm_ does (with
        ZeRO: the squares of every rank's slices summed over the ranks)."""
        norm = torch.linalg.vector_norm(torch.stack([self.norms[i] for i in sorted(self.norms)]))
        if not self.sharded:
            return norm
        square = norm.square()
        C.all_reduce(square, self.axis, "grad_norm")
        return square.sqrt()

    def step(self, loss: torch.Tensor, lr: float, max_norm: float,
             check: Callable[[torch.Tensor], bool] | None = None,
             unscale: torch.Tensor | None = None) -> torch.Tensor:
        """Backward of `loss` with the update fused in; the gradient norm before clipping
        (of the unscaled gradients). With a finite `max_norm` a first backward measures the
        norm (two passes), and `check(norm)` (the trainer's non-finite guard) decides before
        any update whether the second pass runs at all, as does an fp16 overflow (`unscale`
        given, 1/S of a loss multiplied by S: a norm that is not finite); with one pass
        `check` sees the norm after the update."""
        self.norms, self.lr, self.coef, self.unscale = {}, lr, torch.ones(()), unscale
        two_pass = math.isfinite(max_norm)
        assert unscale is None or two_pass, "fp16 LOMO finds overflows in the clipping pass"
        if two_pass:
            self.measure, self.apply = True, False
            loss.backward(retain_graph=True)
            norm = self._norm()
            self.measure = False
            keep = check is None or check(norm)
            if not keep or (unscale is not None and not torch.isfinite(norm)):
                return norm  # nothing applied; the retained graph goes with `loss`
            self.coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.measure, self.apply = not two_pass, True
        loss.backward()
        self.measure = self.apply = False
        if two_pass:
            return norm
        norm = self._norm()
        if check is not None:
            check(norm)
        return norm
