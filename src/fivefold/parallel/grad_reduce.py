"""Gradient reductions of the tensors that the data-parallel engine's flat units do not hold
(those are fivefold.parallel.grad_sync's): with grad_sync, the one place that says how a
gradient is summed, over which axis, under which ledger purpose. No other module writes a
gradient collective (tests/test_grad_sync_layering.py reads the source to hold that).

  all_reduce_grad        one tensor summed in place over the data-parallel ranks ("grads"):
                         LOMO's per-parameter gradient (arXiv 2306.09782, Sec. 3.2) and
                         GaLore-dp's packed bucket (fivefold.memory.galore_dp)
  reduce_scatter_grad    a packed bucket reduce-scattered into this rank's shard ("grads"):
                         GaLore-dp under ZeRO-1/2 (ZeRO, arXiv 1910.02054, Sec. 5)
  all_reduce_grads       several tensors summed in place through one flat all-reduce
                         ("grads"): PipeDream-2BW's stage gradients (arXiv 2006.09503, Sec. 3)
  reduce_scatter_tensor  ZeRO-1/2 for one tensor at a time ("grads"), with `tensor_shard` and
                         `gather_tensor` for its layout: LOMO's update inside backward
  sum_norm_gain_grads,   tensor-parallel partial sums of replicated parameters under sequence
  sum_moe_shared_grads   parallelism (Korthikanti et al., arXiv 2205.05198, Sec. 4.2.2): each
                         tp rank sees T/t tokens, so a replicated parameter's gradient is a
                         partial sum, all-reduced over tp from a hook on every backward
                         ("sp_norm_grads": the norm gains; "moe_sp_grads": an MoE layer's
                         router and shared parameters, fivefold.parallel.moe_tokens)
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C

# Ledger purposes of gradient reductions: the planner predicts each by name
# (fivefold.planner.ledger_model, ledger_update, moe_ledger).
GRADS = "grads"
SP_NORM_GRADS = "sp_norm_grads"
MOE_SP_GRADS = "moe_sp_grads"


def all_reduce_grad(grad: torch.Tensor, axis: C.Axis) -> None:
    """Sum `grad` in place over `axis` (each rank's loss is already divided by the global
    batch's tokens, so the sum is the averaged gradient)."""
    C.all_reduce(grad, axis, GRADS)


def reduce_scatter_grad(out: torch.Tensor, flat: torch.Tensor, axis: C.Axis) -> None:
    """Into `out`, this rank's equal slice of `flat` summed over `axis`."""
    C.reduce_scatter(out, flat, axis, GRADS)


def all_reduce_grads(grads: list[torch.Tensor], axis: C.Axis) -> None:
    """Sum every tensor of `grads` in place over `axis` through one flat all-reduce, laid out
    in list order (one collective, one ledger record of their total bytes)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, axis, GRADS)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def reduce_scatter_tensor(grad: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """ZeRO-1/2 for one tensor (an update fused into backward, fivefold.memory.lomo): this
    rank's slice of `grad` summed over `axis`, the tensor laid out flat and zero-padded to a
    multiple of the axis size, rank r holding the r-th equal slice (as `FlatUnit` cuts)."""
    size = -(-grad.numel() // axis.size)
    flat = torch.zeros(size * axis.size, dtype=grad.dtype, device=grad.device)
    flat[:grad.numel()].copy_(grad.reshape(-1))
    part = torch.empty(size, dtype=grad.dtype, device=grad.device)
    C.reduce_scatter(part, flat, axis, GRADS)
    return part


def tensor_shard(tensor: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """A copy of this rank's slice of `tensor` in `reduce_scatter_tensor`'s layout."""
    size = -(-tensor.numel() // axis.size)
    lo = min(axis.rank * size, tensor.numel())
    hi = min(lo + size, tensor.numel())
    shard = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    shard[:hi - lo].copy_(tensor.reshape(-1)[lo:hi])
    return shard


def gather_tensor(tensor: torch.Tensor, shard: torch.Tensor, axis: C.Axis) -> None:
    """Set `tensor` in place from every rank's `shard` (`reduce_scatter_tensor`'s layout)."""
    full = torch.empty(shard.numel() * axis.size, dtype=shard.dtype, device=shard.device)
    C.all_gather(full, shard, axis, "params")
    tensor.copy_(full[:tensor.numel()].view_as(tensor))


def _summed_over(axis: C.Axis, purpose: str):
    """A tensor hook: a new gradient, the sum of the partial one over `axis`."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        C.all_reduce(out, axis, purpose)
        return out
    return hook


def sum_norm_gain_grads(param: nn.Parameter, tp_axis: C.Axis) -> None:
    """Under sequence parallelism: sum a replicated parameter's (a norm gain's) partial
    gradient over the tp ranks on every backward."""
    param.register_hook(_summed_over(tp_axis, SP_NORM_GRADS))


def sum_moe_shared_grads(param: nn.Parameter, tp_axis: C.Axis) -> None:
    """An MoE layer's replicated parameter under tp (router, shared experts): its partial
    gradient summed over the tp ranks on every backward."""
    param.register_hook(_summed_over(tp_axis, MOE_SP_GRADS))
