"""The one executor of collective schedules: runs any `Schedule` (a fixed algorithm's or a
synthesized one) on real ranks with torch.distributed point-to-point operations.

Every step is one `fivefold.comm.collectives.batch_send_recv` (so each message is on the
ledger as a "send" and a "recv" record, under the caller's purpose), then a wait for all of
it, then the reductions of the step: the semantics `Schedule.check` replays. Chunks are
contiguous slices of flat buffers, so sends and most receives need no copy:

- all_gather: chunk c is part c mod k of rank c div k's slot in `out`; receives land in
  place.
- reduce_scatter: a working copy of `inp` accumulates the partial sums; a reduction arrives
  in a scratch buffer and is added after the step's wait; `out` is this rank's slot at the
  end.
- all_reduce: in place in the tensor, n*k chunks; reductions as above, copies in place.
- all_to_all: chunk (src, dst) is src's split for dst; relays keep it in a scratch buffer.
  Uneven splits need every split's size on every rank (a relay forwards chunks it neither
  sent nor keeps), so the split matrix is first all-gathered (one recorded builtin
  all_gather of n int64 values per rank).

A rank's part of a chunk count that does not divide its buffer is split as `tensor_split`
does (the first parts one element longer); empty chunks are not sent. Sums are in the
tensor's dtype, in the schedule's order, so floating-point results differ from the builtin
collective's by rounding only; integer data agrees exactly (the tests use integers).

`link_delay_s(src, dst, nbytes)`, for benchmarks only, emulates a slower network on CPU: each
rank sleeps, before a step, the longest delay of its sends in that step (the alpha-beta model's
step time when every link is emulated).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from fivefold.comm import collectives as C
from fivefold.comm.schedule import Schedule

Delay = Callable[[int, int, int], float]


def _parts(numel: int, k: int) -> list[int]:
    return [numel // k + (1 if p < numel % k else 0) for p in range(k)]


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _program(schedule: Schedule, me: int) -> list[tuple[list, list]]:
    """Per step: [(dst, chunk)] sent and [(src, chunk, reduce)] received by rank `me`."""
    steps = []
    for step in schedule.steps:
        steps.append(([(x.dst, x.chunk) for x in step if x.src == me],
                      [(x.src, x.chunk, x.reduce) for x in step if x.dst == me]))
    return steps


def _run(schedule: Schedule, axis: C.Axis, purpose: str, held: dict[int, torch.Tensor],
         landing: Callable[[int], torch.Tensor | None], numel: Callable[[int], int],
         like: torch.Tensor, delay: Delay | None) -> dict[int, torch.Tensor]:
    """Run the schedule from `held` (chunk -> view); `landing(c)` is the view a copied chunk
    is received into (None: a scratch buffer). Returns what the rank holds at the end."""
    me = axis.rank
    for sends, recvs in _program(schedule, me):
        sending = {c for _, c in sends}
        ops, pending = [], []
        for dst, c in sends:
            if numel(c):
                ops.append((True, held[c], dst, purpose, c))
        for src, c, reduce in recvs:
            size = numel(c)
            target = None if reduce or c in sending else landing(c)
            if target is None:
                target = like.new_empty(size)
                pending.append((c, target, reduce))
            else:
                held[c] = target
            if size:
                ops.append((False, target, src, purpose, c))
        if delay is not None and sends:
            time.sleep(max(delay(me, dst, numel(c) * like.element_size()) for dst, c in sends))
        for handle in C.batch_send_recv(ops, axis):
            handle.wait()
        for c, buf, reduce in pending:
            if reduce:
                held[c].add_(buf)
            elif landing(c) is not None:
                held[c] = landing(c)
                held[c].copy_(buf)
            else:
                held[c] = buf
    return held


def _check_fits(schedule: Schedule, collective: str, axis: C.Axis) -> None:
    if schedule.collective != collective or schedule.ranks != axis.size:
        raise ValueError(f"schedule {schedule.name} is a {schedule.ranks}-rank "
                         f"{schedule.collective}, not a {axis.size}-rank {collective} on axis "
                         f"{axis.name}")


def all_gather(out: torch.Tensor, inp: torch.Tensor, axis: C.Axis, purpose: str,
               schedule: Schedule, link_delay_s: Delay | None = None) -> None:
    _check_fits(schedule, "all_gather", axis)
    k, m = schedule.chunks_per_rank, inp.numel()
    sizes = _parts(m, k)
    offs = _offsets(sizes)
    flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype)
    flat[axis.rank * m:(axis.rank + 1) * m].copy_(inp.reshape(-1))

    def view(c: int) -> torch.Tensor:
        start = (c // k) * m + offs[c % k]
        return flat[start:start + sizes[c % k]]

    held = {c: view(c) for c in range(axis.rank * k, (axis.rank + 1) * k)}
    _run(schedule, axis, purpose, held, view, lambda c: sizes[c % k], flat, link_delay_s)
    if flat.data_ptr() != out.data_ptr():
        out.copy_(flat.view(out.shape))


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, axis: C.Axis, purpose: str,
                   schedule: Schedule, link_delay_s: Delay | None = None) -> None:
    _check_fits(schedule, "reduce_scatter", axis)
    k, m = schedule.chunks_per_rank, out.numel()
    sizes = _parts(m, k)
    offs = _offsets(sizes)
    work = inp.reshape(-1).clone()

    def view(c: int) -> torch.Tensor:
        start = (c // k) * m + offs[c % k]
        return work[start:start + sizes[c % k]]

    held = {c: view(c) for c in range(schedule.chunks)}
    _run(schedule, axis, purpose, held, view, lambda c: sizes[c % k], work, link_delay_s)
    out.copy_(work[axis.rank * m:(axis.rank + 1) * m].view(out.shape))


def all_reduce(tensor: torch.Tensor, axis: C.Axis, purpose: str, schedule: Schedule,
               link_delay_s: Delay | None = None) -> None:
    _check_fits(schedule, "all_reduce", axis)
    contiguous = tensor.is_contiguous()
    work = tensor.view(-1) if contiguous else tensor.reshape(-1).clone()
    sizes = _parts(work.numel(), schedule.chunks)
    offs = _offsets(sizes)

    def view(c: int) -> torch.Tensor:
        return work[offs[c]:offs[c] + sizes[c]]

    held = {c: view(c) for c in range(schedule.chunks)}
    _run(schedule, axis, purpose, held, view, lambda c: sizes[c], work, link_delay_s)
    if not contiguous:
        tensor.copy_(work.view(tensor.shape))


def all_to_all(out: torch.Tensor, inp: torch.Tensor, axis: C.Axis, purpose: str,
               schedule: Schedule, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None, link_delay_s: Delay | None = None) -> None:
    _check_fits(schedule, "all_to_all", axis)
    n, me = axis.size, axis.rank
    src_flat, dst_flat = inp.reshape(-1), out.view(-1)
    if in_splits is None and out_splits is None:
        matrix = [[inp.numel() // n] * n for _ in range(n)]
    else:
        mine = torch.tensor(in_splits if in_splits is not None else [inp.numel() // n] * n,
                            dtype=torch.int64)
        every = torch.empty(n * n, dtype=torch.int64)
        C.all_gather(every, mine, axis, purpose)
        matrix = every.view(n, n).tolist()
    in_offs = _offsets(matrix[me])
    out_sizes = [matrix[s][me] for s in range(n)]
    out_offs = _offsets(out_sizes)

    def numel(c: int) -> int:
        return matrix[c // n][c % n]

    def landing(c: int) -> torch.Tensor | None:
        if c % n != me:
            return None
        s = c // n
        return dst_flat[out_offs[s]:out_offs[s] + out_sizes[s]]

    held = {me * n + d: src_flat[in_offs[d]:in_offs[d] + matrix[me][d]] for d in range(n)}
    landing(me * n + me).copy_(held[me * n + me])
    _run(schedule, axis, purpose, held, landing, numel, src_flat, link_delay_s)


RUNNERS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "all_reduce": all_reduce, "all_to_all": all_to_all}


class ScheduledCollectives:
    """What an `Axis` carries to run the `[comm]` choice: `runner(collective, axis)` is the
    executor call of the chosen schedule (None: builtin). Built from the torch-free
    `fivefold.comm.choice.CommAlgorithms`, which finds (and caches) the schedules."""

    def __init__(self, choice, link_delay_s: Delay | None = None):
        self.choice, self.link_delay_s = choice, link_delay_s

    def runner(self, collective: str, axis: C.Axis):
        schedule = self.choice.schedule(collective, axis.size, axis.per_node)
        if schedule is None:
            return None
        run = RUNNERS[collective]
        delay = self.link_delay_s

        def call(*args):
            return run(*args[:4], schedule, *args[4:], link_delay_s=delay)

        return call
