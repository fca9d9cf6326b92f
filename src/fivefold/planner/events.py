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
"""

from __future__ import annotations

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
    for k, op in enumerate(ops):
        if any(d >= k or d < 0 for d in op.after):
            raise ValueError(f"op {k} ({op.name}) waits for an op not listed before it")
    queues: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        queues.setdefault(op.stream, []).append(k)
    heads = {s: 0 for s in queues}
    start, end = [0.0] * n, [0.0] * n
    left = [op.seconds for op in ops]
    done = [False] * n
    running: dict[str, int] = {}  # stream -> the op it runs
    clock, finished = 0.0, 0
    while finished < n:
        progressed = True
        while progressed:  # start what is ready; zero-second ops end at once
            progressed = False
            for s, queue in queues.items():
                if s in running or heads[s] == len(queue):
                    continue
                k = queue[heads[s]]
                op = ops[k]
                if not all(done[d] for d in op.after):
                    continue
                ready = max([op.not_before] + [end[d] for d in op.after])
                if ready > clock + _EPS:
                    continue
                start[k] = clock
                heads[s] += 1
                if left[k] <= _EPS:
                    end[k], done[k] = clock, True
                    finished += 1
                else:
                    running[s] = k
                progressed = True
        if finished == n:
            break
        waits = [max([ops[q[heads[s]]].not_before] + [end[d] for d in ops[q[heads[s]]].after])
                 for s, q in queues.items() if s not in running and heads[s] < len(q)
                 and all(done[d] for d in ops[q[heads[s]]].after)]
        if not running:
            if not waits:
                raise ValueError("the ops deadlock: a stream's order contradicts the waits")
            clock = min(waits)
            continue
        rates = _rates(ops, running, overlap_eff)
        step = min(left[k] / rates[k] for k in running.values())
        future = [w - clock for w in waits if w > clock]
        step = min([step] + future)
        clock += step
        for s, k in list(running.items()):
            left[k] -= step * rates[k]
            if left[k] <= _EPS * max(1.0, ops[k].seconds) * 1e3:
                end[k], done[k] = clock, True
                finished += 1
                del running[s]
    return Timeline(tuple(start), tuple(end))


def _rates(ops: list[Op], running: dict[str, int], overlap_eff: float) -> dict[int, float]:
    """Progress per second of each running op (module docstring)."""
    compute = running.get(COMPUTE)
    comms = [k for s, k in running.items() if s != COMPUTE and s not in UNCONTENDED]
    rates = {k: 1.0 for k in running.values()}
    if compute is not None and comms:
        shared = 1.0 / (1.0 + len(comms) * (1.0 - overlap_eff))
        for k in comms + [compute]:
            rates[k] = shared
    return rates
