"""Collectives on one mesh axis, each recorded in the ledger before it is issued.

The runtime never calls torch.distributed collectives directly: it calls these, so the
ledger (fivefold.comm.ledger) sees every byte. Reductions are sums (callers pre-scale; gloo
has no PREMUL_SUM and AVG is not on every backend). On an axis of size 1 nothing is sent and
nothing is recorded; the functions then only copy where an output buffer is expected.
With `async_op=True` a work handle (or None on a size-1 axis) is returned; `wait(handle)`
finishes it. `send` and `recv` are point-to-point (pipeline stages): always asynchronous,
recorded as op "send" (the buffer on the wire) and "recv" (no wire bytes), between two
distinct ranks of the axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.comm.ledger import Ledger

# torch 2.13 renamed the flat-tensor collectives; 2.11 and 2.12 only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class Axis:
    """One axis of the rank mesh: its process group, size, this rank's index, the ledger."""

    name: str
    group: dist.ProcessGroup | None
    size: int
    rank: int
    ledger: Ledger

    def record(self, op: str, tensor: torch.Tensor, purpose: str) -> None:
        self.ledger.record(op, self.name, self.size, str(tensor.dtype).removeprefix("torch."),
                           tensor.numel() * tensor.element_size(), purpose)


def wait(handle) -> None:
    if handle is not None:
        handle.wait()


def all_reduce(tensor: torch.Tensor, axis: Axis, purpose: str, async_op: bool = False):
    """Sum `tensor` in place over the axis."""
    if axis.size == 1:
        return None
    axis.record("all_reduce", tensor, purpose)
    return dist.all_reduce(tensor, group=axis.group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
                   async_op: bool = False):
    """out (numel/n) = this rank's chunk of the sum of `inp` over the axis."""
    if axis.size == 1:
        out.copy_(inp)
        return None
    axis.record("reduce_scatter", inp, purpose)
    return _reduce_scatter_flat(out, inp, group=axis.group, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
               async_op: bool = False):
    """out (numel*n) = the concatenation of every rank's `inp`, in axis order."""
    if axis.size == 1:
        out.copy_(inp)
        return None
    axis.record("all_gather", out, purpose)
    return _all_gather_flat(out, inp, group=axis.group, async_op=async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
               out_splits: list[int] | None = None, in_splits: list[int] | None = None):
    """Chunk i of `inp` goes to rank i of the axis; chunk j of `out` comes from rank j."""
    if axis.size == 1:
        out.copy_(inp)
        return None
    axis.record("all_to_all", inp, purpose)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=axis.group)


def broadcast(tensor: torch.Tensor, axis: Axis, src_index: int, purpose: str):
    """Copy axis rank `src_index`'s tensor to every rank of the axis."""
    if axis.size == 1:
        return None
    axis.record("broadcast", tensor, purpose)
    src = dist.get_global_rank(axis.group, src_index) if axis.group is not None else src_index
    return dist.broadcast(tensor, src=src, group=axis.group)


def send(tensor: torch.Tensor, axis: Axis, dst_index: int, purpose: str, tag: int = 0):
    """Start sending `tensor` to rank `dst_index` of the axis (point-to-point, asynchronous);
    returns the work handle: `wait` it before the tensor is reused. Messages between two ranks
    are told apart by `tag` (pipeline stages send activations and gradients both ways)."""
    axis.record("send", tensor, purpose)
    dst = dist.get_global_rank(axis.group, dst_index) if axis.group is not None else dst_index
    return dist.isend(tensor, dst=dst, group=axis.group, tag=tag)


def recv(tensor: torch.Tensor, axis: Axis, src_index: int, purpose: str, tag: int = 0):
    """Start receiving into `tensor` from rank `src_index` of the axis; returns the work handle
    (the data is there after `wait`). Recorded with the buffer's bytes and no wire bytes."""
    axis.record("recv", tensor, purpose)
    src = dist.get_global_rank(axis.group, src_index) if axis.group is not None else src_index
    return dist.irecv(tensor, src=src, group=axis.group, tag=tag)
