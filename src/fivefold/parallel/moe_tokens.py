"""MoE layers on a rank's share of a micro-batch's tokens (sequence and context parallelism).

With sequence parallelism (the tp ranks hold (B, T/t, D) of the residual stream,
fivefold.parallel.tensor) and with context parallelism (the cp ranks hold T/cp positions of
every sequence, fivefold.parallel.context.layout) an MoE layer runs on the tokens its rank
holds. Tensor parallelism without sequence parallelism leaves (B, T, D) equal on every tp
rank; there the layer takes the rank's T/t positions on entry and all-gathers the tp ranks'
outputs on exit (purpose "moe_tp_tokens"; backward all-gathers the input gradient's shares,
"moe_tp_tokens_grad"), so that no two ranks of a stage route the same token and the experts'
grid folds tp in (MoE Parallel Folding, arXiv 2504.14960; fivefold.expert_grid). Either way
the layer routes them, applies the capacity to them (the group is the rank's share,
fivefold.models.moe) and computes their experts (with ep > 1, dispatched as usual over the
ep axis, fivefold.parallel.expert). Per token everything is the one-process computation
except the load-balancing loss, whose shares f_e are over the whole micro-batch: the
`MoE.balance_counts` seam installed here all-reduces each forward's assignments per expert
(int64, X numbers, purpose "moe_balance") over the `token_group` axis, the ranks that split
the micro-batch (tp, cp, or both joined), so each rank's balancing
term is its tokens' part of the one-process loss. The counts carry no gradient (f_e is a
constant in the Switch loss), so backward adds nothing. The other statistics (load, drops,
aux sums) are summed after the step over the ranks that route different tokens
(`ParallelPlan.routing_axes`, fivefold.train.moe_stats).

The layer's router and shared experts are replicated over these ranks and see other tokens
on each, so their gradients are partial sums: over cp the data-parallel engine reduces them
with the dense ones (cp is a token axis); over tp a hook on each all-reduces its gradient
(purpose "moe_sp_grads", every backward, as sequence parallelism does for the norm gains,
fivefold.parallel.tensor). The routed experts' gradients are reduced by the engine over
their edp ranks, which include the tp ranks that fold into them.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.models.moe import MoE
from fivefold.parallel.expert import is_expert_param
from fivefold.parallel.grad_reduce import sum_moe_shared_grads
from fivefold.parallel.tensor_comm import gather_sequence


class BalanceCounts:
    """`MoE.balance_counts` over `axis`: the micro-batch's assignments per expert."""

    def __init__(self, axis: Axis):
        self.axis = axis

    def __call__(self, counts_X: torch.Tensor) -> torch.Tensor:
        counts_X = counts_X.clone()
        C.all_reduce(counts_X, self.axis, "moe_balance")
        return counts_X


class _TakeShare(torch.autograd.Function):
    """(B, T, D) equal on every tp rank -> this rank's (B, T/t, D); backward all-gathers the
    shares' gradients, the input's whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x_BTD: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        size = x_BTD.shape[1] // axis.size
        return x_BTD.narrow(1, axis.rank * size, size).contiguous()

    @staticmethod
    def backward(ctx, grad_BSD: torch.Tensor):
        return gather_sequence(grad_BSD.contiguous(), ctx.axis, "moe_tp_tokens_grad"), None


class _GatherShares(torch.autograd.Function):
    """The tp ranks' (B, T/t, D) outputs -> (B, T, D) on every rank; backward keeps this
    rank's share of the (equal) output gradient."""

    @staticmethod
    def forward(ctx, y_BSD: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return gather_sequence(y_BSD.contiguous(), axis, "moe_tp_tokens")

    @staticmethod
    def backward(ctx, grad_BTD: torch.Tensor):
        size = grad_BTD.shape[1] // ctx.axis.size
        return grad_BTD.narrow(1, ctx.axis.rank * size, size).contiguous(), None


def apply_moe_token_split(model: nn.Module, token_group: Axis, tp_axis: Axis | None,
                          sequence_parallel: bool) -> None:
    """Make every MoE layer's balancing statistics span `token_group` and, over tp
    (`tp_axis`), run on the rank's share of the tokens and sum its router's and shared
    experts' gradients (module docstring)."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.balance_counts = BalanceCounts(token_group)
        if tp_axis is None:
            continue
        if not sequence_parallel:
            module.register_forward_pre_hook(
                lambda mod, args: (_TakeShare.apply(args[0], tp_axis), *args[1:]))
            module.register_forward_hook(
                lambda mod, args, out: _GatherShares.apply(out, tp_axis))
        for name, param in module.named_parameters():
            if not is_expert_param(f"mlp.{name}"):
                sum_moe_shared_grads(param, tp_axis)
