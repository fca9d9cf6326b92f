"""MoE layers on a rank's share of a micro-batch's tokens (sequence and context parallelism).

With sequence parallelism (the tp ranks hold (B, T/t, D) of the residual stream,
fivefold.parallel.tensor) and with context parallelism (the cp ranks hold T/cp positions of
every sequence, fivefold.parallel.context.layout) an MoE layer runs on the tokens its rank
holds: it routes them, applies the capacity to them (the group is the rank's share,
fivefold.models.moe) and computes their experts (with ep > 1, dispatched as usual over the
ep axis, fivefold.parallel.expert). Per token everything is the one-process computation
except the load-balancing loss, whose shares f_e are over the whole micro-batch: the
`MoE.balance_counts` seam installed here all-reduces each forward's assignments per expert
(int64, X numbers, purpose "moe_balance") over the `token_group` axis, the ranks that split
the micro-batch (tp with sequence parallelism, cp, or both joined), so each rank's balancing
term is its tokens' part of the one-process loss. The counts carry no gradient (f_e is a
constant in the Switch loss), so backward adds nothing. The other statistics (load, drops,
aux sums) are summed after the step over the ranks that route different tokens
(`ParallelPlan.routing_axes`, fivefold.train.moe_stats).

The layer's parameters (router, this ep rank's experts, shared experts) are replicated over
these ranks and see other tokens on each, so their gradients are partial sums: over cp the
data-parallel engine reduces them with the dense ones (cp is a token axis); over tp a hook on
each all-reduces its gradient (purpose "moe_sp_grads", every backward, as sequence
parallelism does for the norm gains, fivefold.parallel.tensor). The hooks go on the
parameters expert parallelism leaves, so this runs after it (fivefold.parallel.parallelize).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.models.moe import MoE
from fivefold.parallel.tensor_comm import all_reduced


class BalanceCounts:
    """`MoE.balance_counts` over `axis`: the micro-batch's assignments per expert."""

    def __init__(self, axis: Axis):
        self.axis = axis

    def __call__(self, counts_X: torch.Tensor) -> torch.Tensor:
        counts_X = counts_X.clone()
        C.all_reduce(counts_X, self.axis, "moe_balance")
        return counts_X


def apply_moe_token_split(model: nn.Module, token_group: Axis, tp_axis: Axis | None) -> None:
    """Make every MoE layer's balancing statistics span `token_group` and, with sequence
    parallelism (`tp_axis`), sum its gradients over tp (module docstring)."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.balance_counts = BalanceCounts(token_group)
        if tp_axis is not None:
            for param in module.parameters():
                param.register_hook(lambda grad: all_reduced(grad, tp_axis, "moe_sp_grads"))
