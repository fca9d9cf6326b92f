"""Collectives on one mesh axis, each recorded in the ledger before it is issued.

The runtime never calls torch.distributed collectives directly: it calls these, so the
ledger (fivefold.comm.ledger) sees every byte. Reductions are sums (callers pre-scale; gloo
has no PREMUL_SUM and AVG is not on every backend). On an axis of size 1 nothing is sent and
nothing is recorded; the functions then only copy where an output buffer is expected.
With `async_op=True` a work handle (or None on a size-1 axis) is returned; `wait(handle)`
finishes it. `batch_send_recv` is point-to-point (pipeline stages): sends and receives
between distinct ranks of the axis issued as one asynchronous group, recorded as op "send"
(the buffer on the wire) and "recv" (no wire bytes).

An axis may carry `algorithms` (fivefold.comm.executor.ScheduledCollectives, set by the mesh
from the `[comm]` config section) and `per_node`, its ranks per node. all_gather, reduce_scatter,
all_reduce and all_to_all then run the chosen algorithm's schedule through the schedule
executor (fivefold.comm.executor): the ledger records the schedule's point-to-point messages
("send"/"recv" under the same purpose) instead of one collective record, and the call is
synchronous (`async_op` returns None). Without `algorithms` (the default), or for a kind left
"builtin", the builtin torch.distributed collective runs exactly as before.

A builtin collective or point-to-point batch that raises (gloo's timeout after
`train.timeout_s`, a peer that closed its connection), when issued or when its handle is
waited on, is reported through the ledger's flight recorder (fivefold.comm.flight_recorder):
each rank writes its recorder and stack, and `CollectiveError` names the operation, the axis
and the ranks that never reached it. Asynchronous handles come back wrapped for that (`Work`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.comm.flight_recorder import CollectiveError
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
    algorithms: object = None  # fivefold.comm.executor.ScheduledCollectives; None: builtin
    per_node: int = 1

    def scheduled(self, collective: str):
        """The executor's call that runs `collective` on this axis, or None for the builtin.
        (Duck-typed, so this module does not import the executor, which imports it.)"""
        return None if self.algorithms is None else self.algorithms.runner(collective, self)

    def record(self, op: str, tensor: torch.Tensor, purpose: str) -> None:
        self.ledger.record(op, self.name, self.size, str(tensor.dtype).removeprefix("torch."),
                           tensor.numel() * tensor.element_size(), purpose)


def _group_ranks(axis: Axis) -> list[int]:
    if axis.group is not None:
        return dist.get_process_group_ranks(axis.group)
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def _report(axis: Axis, entry: dict | None, err: BaseException) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return axis.ledger.recorder.failed(rank, _group_ranks(axis), entry, err)


class Work:
    """A torch.distributed work handle whose failure is reported like a synchronous call's."""

    def __init__(self, work, axis: Axis, entry: dict | None):
        self.work, self.axis, self.entry = work, axis, entry

    def wait(self):
        try:
            return self.work.wait()
        except CollectiveError:
            raise
        except RuntimeError as err:
            raise _report(self.axis, self.entry, err) from err

    def __getattr__(self, name):  # is_completed, ...
        return getattr(self.work, name)


def _issue(axis: Axis, call, async_op: bool = False):
    """Run the builtin collective `call()` just recorded on `axis`; report a failure."""
    entry = axis.ledger.recorder.last
    try:
        work = call()
    except RuntimeError as err:
        raise _report(axis, entry, err) from err
    return Work(work, axis, entry) if async_op and work is not None else work


def wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _copy_alone(out: torch.Tensor, inp: torch.Tensor) -> None:
    """A one-rank group's collective: `out` is `inp`, copied unless it is the same memory
    (a one-rank ZeRO unit's shard is a view of its whole buffer: no copy onto itself)."""
    if (out.data_ptr(), out.shape, out.stride()) != (inp.data_ptr(), inp.shape, inp.stride()):
        out.copy_(inp)


def all_reduce(tensor: torch.Tensor, axis: Axis, purpose: str, async_op: bool = False):
    """Sum `tensor` in place over the axis."""
    if axis.size == 1:
        return None
    if (run := axis.scheduled("all_reduce")) is not None:
        return run(tensor, axis, purpose)
    axis.record("all_reduce", tensor, purpose)
    return _issue(axis, lambda: dist.all_reduce(tensor, group=axis.group, async_op=async_op),
                  async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
                   async_op: bool = False):
    """out (numel/n) = this rank's chunk of the sum of `inp` over the axis."""
    if axis.size == 1:
        _copy_alone(out, inp)
        return None
    if (run := axis.scheduled("reduce_scatter")) is not None:
        return run(out, inp, axis, purpose)
    axis.record("reduce_scatter", inp, purpose)
    return _issue(axis, lambda: _reduce_scatter_flat(out, inp, group=axis.group,
                                                     async_op=async_op), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
               async_op: bool = False):
    """out (numel*n) = the concatenation of every rank's `inp`, in axis order."""
    if axis.size == 1:
        _copy_alone(out, inp)
        return None
    if (run := axis.scheduled("all_gather")) is not None:
        return run(out, inp, axis, purpose)
    axis.record("all_gather", out, purpose)
    return _issue(axis, lambda: _all_gather_flat(out, inp, group=axis.group,
                                                 async_op=async_op), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, axis: Axis, purpose: str,
               out_splits: list[int] | None = None, in_splits: list[int] | None = None):
    """Chunk i of `inp` goes to rank i of the axis; chunk j of `out` comes from rank j."""
    if axis.size == 1:
        _copy_alone(out, inp)
        return None
    if (run := axis.scheduled("all_to_all")) is not None:
        return run(out, inp, axis, purpose, out_splits, in_splits)
    axis.record("all_to_all", inp, purpose)
    return _issue(axis, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits,
                                                       group=axis.group))


def broadcast(tensor: torch.Tensor, axis: Axis, src_index: int, purpose: str):
    """Copy axis rank `src_index`'s tensor to every rank of the axis."""
    if axis.size == 1:
        return None
    axis.record("broadcast", tensor, purpose)
    src = dist.get_global_rank(axis.group, src_index) if axis.group is not None else src_index
    return _issue(axis, lambda: dist.broadcast(tensor, src=src, group=axis.group))


def batch_send_recv(ops: list[tuple[bool, torch.Tensor, int, str, int]], axis: Axis) -> list:
    """Issue point-to-point sends and receives on the axis together, as one batch_isend_irecv;
    each op is (is a send, tensor, peer index, purpose, tag), recorded as "send" or "recv" with
    the buffer's bytes (and no wire bytes). Messages between two ranks are told apart by the
    tag (pipeline stages send activations and gradients both ways); `wait` every returned
    handle before a tensor is reused or read.
    NCCL runs the batch as one group (a pair of ranks that both send and receive cannot
    block each other) and returns one handle for all of it; gloo returns one per op."""
    batch, entries = [], []
    for is_send, tensor, peer_index, purpose, tag in ops:
        axis.record("send" if is_send else "recv", tensor, purpose)
        entries.append(axis.ledger.recorder.last)
        peer = (dist.get_global_rank(axis.group, peer_index) if axis.group is not None
                else peer_index)
        batch.append(dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer,
                                axis.group, tag))
    if not batch:
        return []
    handles = _issue(axis, lambda: dist.batch_isend_irecv(batch))
    return [Work(h, axis, entries[i] if len(handles) == len(entries) else entries[0])
            for i, h in enumerate(handles)]
