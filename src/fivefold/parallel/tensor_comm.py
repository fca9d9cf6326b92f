"""The collectives of tensor and sequence parallelism, as autograd functions on the ledger.

Megatron-LM (arXiv 1909.08053, Sec. 3, Fig. 3; 2104.04473, Sec. 2.3) brackets each
tensor-parallel region (an attention or an MLP) with two conjugate operators:

  f  `copy_to_tp`      forward identity                 backward all-reduce
  g  `reduce_from_tp`  forward all-reduce               backward identity

Sequence parallelism (2205.05198, Sec. 4.2.2, Fig. 5) keeps the activations between regions
sharded along the sequence and splits each all-reduce into its two halves:

  g  `gather_from_sp`  forward all-gather (sequence)    backward reduce-scatter
  ḡ  `scatter_to_sp`   forward reduce-scatter           backward all-gather

and the column-parallel linears of a region store only this rank's sequence shard of their
input, gathering it again in backward for the weight gradient (`linear_regathered`, as the
same section describes). One `SharedRegather` per region makes the region's linears (wq, wk,
wv or w1, w3) share a single re-gather. Under zero-bubble's split backward the re-gather runs
in the W pass, with the weight gradients that read it, and not in the I pass (`_walk_needs`):
the ZB authors' Megatron implementation (arXiv 2401.10241, Sec. 2; sail-sg's
zero-bubble-pipeline-parallelism) likewise defers the sequence-parallel all-gather of a
linear's input together with its weight-gradient GEMM to W. Between I and W a unit then keeps
only the sequence shard, as sequence parallelism promises, and the bytes moved are a full
backward's: one re-gather per region and micro-batch.

Collectives are flat (gloo takes no stacked buffers): `gather_stacked` and
`reduce_scatter_stacked` lay the ranks' parts out along a leading dim.

Explicit autograd functions, not DTensor, so that every collective goes through
fivefold.comm.collectives and is recorded in the ledger on the "tp" axis with a purpose:
"tp_activations" (f, g), "sp_activations" (all-gather / reduce-scatter), "sp_regather".
Activations are batch-first (B, T, D); the sequence is dim 1, so a gather or scatter moves
the sequence to the front, runs the flat collective and moves it back (one copy each way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis


def all_reduced(x: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """A new tensor holding the sum of `x` over the axis (`x` itself is left alone)."""
    out = x.clone(memory_format=torch.contiguous_format)
    C.all_reduce(out, axis, purpose)
    return out


def gather_stacked(x: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """(n, *x.shape): every rank's `x`, in axis order (a flat all-gather, as gloo wants)."""
    out = torch.empty(axis.size * x.numel(), dtype=x.dtype, device=x.device)
    C.all_gather(out, x.contiguous().view(-1), axis, purpose)
    return out.view(axis.size, *x.shape)


def reduce_scatter_stacked(x_n: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """x_n[r] summed over the axis, on rank r (x_n has the axis size as its first dim)."""
    out = torch.empty(x_n.shape[1:], dtype=x_n.dtype, device=x_n.device)
    C.reduce_scatter(out.view(-1), x_n.contiguous().view(-1), axis, purpose)
    return out


def gather_sequence(x_BSD: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """(B, T/n, ...) shards of the axis's n ranks -> the full (B, T, ...), in rank order."""
    return gather_stacked(x_BSD, axis, purpose).movedim(0, 1).flatten(1, 2)


def scatter_sequence(x_BTD: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """(B, T, ...) partial sums -> this rank's (B, T/n, ...) slice of their sum over the axis."""
    chunks_nBSD = x_BTD.unflatten(1, (axis.size, x_BTD.shape[1] // axis.size)).movedim(1, 0)
    return reduce_scatter_stacked(chunks_nBSD, axis, purpose)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduced(grad, ctx.axis, "tp_activations"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return all_reduced(x, axis, "tp_activations")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSD, axis):
        ctx.axis = axis
        return gather_sequence(x_BSD, axis, "sp_activations")

    @staticmethod
    def backward(ctx, grad_BTD):
        return scatter_sequence(grad_BTD, ctx.axis, "sp_activations"), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTD, axis):
        ctx.axis = axis
        return scatter_sequence(x_BTD, axis, "sp_activations")

    @staticmethod
    def backward(ctx, grad_BSD):
        return gather_sequence(grad_BSD, ctx.axis, "sp_activations"), None


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """f: enter a region with a replicated input; its gradient is summed over the axis."""
    return _CopyToTP.apply(x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """g: leave a region by summing the ranks' partial outputs."""
    return _ReduceFromTP.apply(x, axis)


def gather_from_sp(x_BSD: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Enter a region from sequence shards: all-gather the sequence (dim 1)."""
    return _GatherFromSP.apply(x_BSD, axis)


def scatter_to_sp(x_BTD: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Leave a region into sequence shards: reduce-scatter the partial outputs over dim 1."""
    return _ScatterToSP.apply(x_BTD, axis)


class SharedRegather:
    """The full input of one sequence-parallel region, gathered again once in backward.

    Each column-parallel linear of the region registers itself in forward (`users`); the first
    backward to ask all-gathers the saved shard, the others reuse it, and the last one drops it,
    so the full (B, T, D) input lives only while the region's weight gradients are computed.
    """

    def __init__(self, axis: Axis):
        self.axis, self.users, self.full = axis, 0, None

    def gather(self, x_local_BSD: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = gather_sequence(x_local_BSD, self.axis, "sp_regather")
        full, self.users = self.full, self.users - 1
        if self.users == 0:
            self.full = None
        return full


def _walk_needs(ctx, i: int) -> bool:
    """Whether the backward now running reaches the node that input `i` of `ctx`'s op feeds.

    A built-in op computes only the gradients the current walk asks for; a custom function's
    `needs_input_grad` says only what could be asked. Zero-bubble's split backward
    (fivefold.parallel.pipeline.split_backward) walks the graph twice: I asks for the input
    gradient alone, W for the weight's alone. Asking the engine which edges this walk will
    follow keeps I from re-gathering the input and W from computing the input gradient again.
    """
    node = ctx.next_functions[i][0]
    return node is not None and torch._C._will_engine_execute_node(node)


class _LinearRegathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTD, x_local_BSD, weight, shared):
        shared.users += 1
        ctx.shared = shared
        ctx.save_for_backward(x_local_BSD, weight)
        return F.linear(x_BTD, weight)

    @staticmethod
    def backward(ctx, grad_BTO):
        x_local, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and _walk_needs(ctx, 0):
            grad_x = grad_BTO.matmul(weight.to(grad_BTO.dtype))
        if ctx.needs_input_grad[2] and _walk_needs(ctx, 2):
            x_BTD = ctx.shared.gather(x_local)
            grad_w = grad_BTO.flatten(0, -2).t().matmul(x_BTD.flatten(0, -2).to(grad_BTO.dtype))
            grad_w = grad_w.to(weight.dtype)
        return grad_x, None, grad_w, None


def linear_regathered(x_BTD: torch.Tensor, x_local_BSD: torch.Tensor, weight: torch.Tensor,
                      shared: SharedRegather) -> torch.Tensor:
    """`x_BTD @ weight.T` where x_BTD = gather_from_sp(x_local_BSD), saving only the shard."""
    return _LinearRegathered.apply(x_BTD, x_local_BSD, weight, shared)
