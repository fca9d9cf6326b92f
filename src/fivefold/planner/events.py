"""A discrete-event scheduler over one rank's streams: the simulator's one overlap model.

A rank runs ops on streams: "compute" (the device's kernels), one stream per communication
axis ("tp", "cp", "ep", "dp", "pp"), and the host's "host" and "disk" copies. Each op has a
stream, a duration priced before scheduling (fivefold.planner.compute, fivefold.planner.comm),
the ops it waits for, and optionally an earliest start. A stream runs its ops one at a time in
the order they are listed (a CUDA stream, a NCCL communicator); an op starts when its stream
is free and every op it waits for has ended. What hides behind what is not written per
technique: it follows from which ops wait for which.

Contention: a collective running beside compute shares the device's SMs and HBM bandwidth
with it. While compute runs together with k collectives, each of those k + 1 ops progresses
at the rate 1 / (1 + k (1 - overlap_eff)); an op alone on the device, or a collective beside
only other collectives (other links), runs at full rate; host and disk copies never contend.
For one collective of C seconds beside W seconds of compute, both starting together, that is
max(W, C) + (1 - overlap_eff) min(W, C): a hidden collective still slows the compute by
(1 - overlap_eff) of its time, and a longer one shows its excess (`exposed` is that closed
form, for the search's fast pass). With every collective hidden, the slowdowns add:
(1 - overlap_eff) times the sum of their seconds.

Several devices: an op may name the `device` it runs on (the pipeline ranks of one joint
schedule, fivefold.planner.trace_step); streams are then per device, and contention counts
each device's own compute and collectives. Ops that name none all share one device, so a
one-rank list schedules as it always did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

COMPUTE = "compute"
UNCONTENDED = ("host", "disk")  # their copies run on the host's memory and PCIe, not the SMs
_EPS = 1e-15


@dataclass(frozen=True)
class Op:
    """One op of a rank: `after` holds the indices of the ops it waits for (earlier in the
    list), `not_before` the earliest time it may start (a replayed schedule's clock)."""

    name: str
    stream: str
    seconds: float
    after: tuple[int, ...] = ()
    not_before: float = 0.0
    device: str = ""  # whose SMs and HBM its stream shares (module docstring)


@dataclass(frozen=True)
class Timeline:
    """When each op (by its index) started and ended."""

    start: tuple[float, ...]
    end: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


def exposed(comm: float, window: float, overlap_eff: float) -> float:
    """Seconds a collective of `comm` seconds adds to `window` seconds of compute when both
    start together and what follows waits for both: the scheduler's result for that pair
    (module docstring), max(W, C) + (1 - overlap_eff) min(W, C) - W."""
    return max(comm - overlap_eff * window, (1 - overlap_eff) * comm)


def schedule(ops: list[Op], overlap_eff: float) -> Timeline:
    """Run `ops` (module docstring). Raises ValueError when an op waits for a later op or
    the streams' order and the waits deadlock."""
    n = len(ops)
    waiters: list[list[int]] = [[] for _ in range(n)]
    unmet = [len(op.after) for op in ops]
    for k, op in enumerate(ops):
        for d in op.after:
            if d >= k or d < 0:
                raise ValueError(f"op {k} ({op.name}) waits for an op not listed before it")
            waiters[d].append(k)
    queues: dict[tuple[str, str], list[int]] = {}
    for k, op in enumerate(ops):
        queues.setdefault((op.device, op.stream), []).append(k)
    devices = {d: i for i, d in enumerate(dict.fromkeys(d for d, _ in queues))}
    streams = [(devices[d], q, s == COMPUTE, s != COMPUTE and s not in UNCONTENDED)
               for (d, s), q in queues.items()]
    heads = [0] * len(streams)
    ready = [op.not_before for op in ops]  # the latest of not_before and the waits' ends
    start, end = [0.0] * n, [0.0] * n
    left = [op.seconds for op in ops]
    running: list[int] = [-1] * len(streams)  # per stream, the op it runs
    clock, finished = 0.0, 0
    contend = 1.0 - overlap_eff
    while finished < n:
        started = True
        while started:  # start what is ready; zero-second ops end at once
            started = False
            for j, (_, queue, _, _) in enumerate(streams):
                if running[j] >= 0 or heads[j] == len(queue):
                    continue
                k = queue[heads[j]]
                if unmet[k] or ready[k] > clock + _EPS:
                    continue
                start[k] = clock
                heads[j] += 1
                if left[k] <= _EPS:
                    end[k] = clock
                    finished += 1
                    for w in waiters[k]:
                        unmet[w] -= 1
                        ready[w] = max(ready[w], clock)
                    started = True
                else:
                    running[j] = k
                    started = True
        if finished == n:
            break
        computing, comms = [0] * len(devices), [0] * len(devices)
        step = math.inf
        for j, (device, queue, is_compute, contends) in enumerate(streams):
            k = running[j]
            if k >= 0:
                computing[device] += is_compute
                comms[device] += contends
            elif heads[j] < len(queue):
                k = queue[heads[j]]
                if not unmet[k] and ready[k] > clock:
                    step = min(step, ready[k] - clock)  # a not_before still ahead
        shared = [1.0 / (1.0 + c * contend) if busy and c else 1.0
                  for busy, c in zip(computing, comms)]
        any_running = False
        for j, (device, _, is_compute, contends) in enumerate(streams):
            k = running[j]
            if k >= 0:
                any_running = True
                rate = shared[device] if (is_compute or contends) else 1.0
                step = min(step, left[k] / rate)
        if step == math.inf:
            raise ValueError("the ops deadlock: a stream's order contradicts the waits")
        clock += step
        if not any_running:
            continue
        for j, (device, _, is_compute, contends) in enumerate(streams):
            k = running[j]
            if k < 0:
                continue
            left[k] -= step * (shared[device] if (is_compute or contends) else 1.0)
            if left[k] <= _EPS * 1e3 * max(1.0, ops[k].seconds):
                end[k] = clock
                finished += 1
                running[j] = -1
                for w in waiters[k]:
                    unmet[w] -= 1
                    ready[w] = max(ready[w], clock)
    return Timeline(tuple(start), tuple(end))
