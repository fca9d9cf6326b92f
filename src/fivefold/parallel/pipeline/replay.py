"""Replay a schedule's action lists with modelled costs: deadlock check, timeline, bubble.

The one event loop over the action lists (fivefold.parallel.pipeline.schedules): the tests,
the pictures (fivefold.parallel.pipeline.timeline) and the planner's simulator
(fivefold.planner.simulate) all replay the lists the executor runs through `replay`. Each
rank runs its list in order. A compute action (and 2BW's UPDATE) takes its cost; a send takes
no time and never waits (the executor's sends are asynchronous, on their own stream); a
receive waits until its message has been sent and, from another rank, has crossed the link
(`transfer_s`). Replaying every rank this way gives the earliest start of every action, which
is what the runtime does when compute and transfer costs are as modelled, so the same function
checks a schedule (every message sent once and received once, no rank waiting forever) and
draws or scores it: `bubble_fraction` from its events, `peak_in_flight` (in units or, with a
weight per stage, in bytes) from its order. Unit costs (`unit_cost`) are the papers' analyses;
the planner passes its stage durations and point-to-point time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from fivefold.parallel.pipeline.p2p_plan import Exchange, issue_plan
from fivefold.parallel.pipeline.schedules import (B, COMPUTE, F, I, RECVS, SENDS, UPDATE, W,
                                                  Action, Schedule, message, peer_stage)


class ScheduleError(ValueError):
    """The action lists cannot run: a deadlock, a lost or duplicated message, a bad order."""


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


def unit_cost(schedule: Schedule) -> Callable[[Action], float]:
    """T_F = 1, T_B = 2 (T_I = T_W = 1) for one micro-batch through one whole stage: a chunk
    costs 1/v of that and a token slice 1/n (the papers' analyses)."""
    share = 1.0 / (schedule.vpp * schedule.slices)
    costs = {F: share, B: 2 * share, I: share, W: share, UPDATE: 0.0}
    return lambda a: costs.get(a.kind, 0.0)


def replay(schedule: Schedule, cost: Callable[[Action], float] | None = None,
           transfer_s: float = 0.0) -> list[Event]:
    """Every action's (start, end) on its rank, with `cost` per compute action (default
    `unit_cost`) and `transfer_s` per message between two ranks (a message to the rank itself
    goes through the executor's mailbox at no cost). Raises ScheduleError if the lists cannot
    run."""
    cost = cost or unit_cost(schedule)
    n, stages = len(schedule.ranks), schedule.stages
    pos, clock = [0] * n, [0.0] * n
    posted: dict[tuple, float] = {}
    received: set[tuple] = set()
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for r in range(n):
            actions = schedule.ranks[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if a.kind in SENDS:
                    key = message(a, stages)
                    if key in posted:
                        raise ScheduleError(f"rank {r}: {a} sends message {key} twice")
                    posted[key] = clock[r]
                    events.append(Event(r, a, clock[r], clock[r]))
                elif a.kind in RECVS:
                    key = message(a, stages)
                    if key not in posted:
                        break  # wait for the sender
                    if key in received:
                        raise ScheduleError(f"rank {r}: {a} receives message {key} twice")
                    received.add(key)
                    arrives = posted[key]
                    if schedule.rank_of(peer_stage(a, stages)) != r:
                        arrives += transfer_s
                    clock[r] = max(clock[r], arrives)
                    events.append(Event(r, a, clock[r], clock[r]))
                else:
                    start = clock[r]
                    clock[r] += cost(a)
                    events.append(Event(r, a, start, clock[r]))
                pos[r] += 1
                progress = True
    stuck = [(r, str(schedule.ranks[r][pos[r]])) for r in range(n)
             if pos[r] < len(schedule.ranks[r])]
    if stuck:
        raise ScheduleError(f"{schedule.name}: deadlock, ranks waiting at {stuck}")
    unread = set(posted) - received
    if unread:
        raise ScheduleError(f"{schedule.name}: messages sent but never received: "
                            f"{sorted(unread)[:4]}")
    return events


def check_nccl(schedule: Schedule, batched: bool = True) -> None:
    """Raise ScheduleError unless the schedule runs under NCCL's point-to-point semantics.

    NCCL ignores tags: between two ranks, in each direction, the k-th send issued is paired
    with the k-th receive issued, so both ends must issue the same messages in the same
    order. A send completes only once its receive is posted (large messages rendezvous; the
    eager path for small ones is not relied on), and a rank's operations run in issue order
    on its communication stream, each group of them (one batch_isend_irecv) starting
    together. So a rank passes a group only when every operation in it is paired with a
    posted one. `batched=True` checks the executor's plan (p2p_plan.issue_plan: its
    Exchanges); `batched=False` issues every send and receive alone where the list puts it,
    as the executor did before the plan. Messages to the rank itself go through the
    executor's mailbox and are not NCCL's concern.
    """
    stages = schedule.stages
    if batched:
        groups = [[g.actions for g in plan if isinstance(g, Exchange)]
                  for plan in issue_plan(schedule)]
    else:
        groups = [[(a,) for a in actions if a.kind in SENDS or a.kind in RECVS]
                  for actions in schedule.ranks]
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst): messages in order
    taken: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    plan: list[list[list[tuple]]] = []  # rank, group: (direction, index in it, is a send)
    for r, rank_groups in enumerate(groups):
        plan.append([])
        for group in rank_groups:
            ops = []
            for a in group:
                peer = schedule.rank_of(peer_stage(a, stages))
                if peer == r:
                    continue
                is_send = a.kind in SENDS
                pair = (r, peer) if is_send else (peer, r)
                order = sent[pair] if is_send else taken[pair]
                ops.append((pair, len(order), is_send))
                order.append(message(a, stages))
            plan[-1].append(ops)
    for pair in sorted(set(sent) | set(taken)):
        for k, (out, got) in enumerate(zip(sent[pair], taken[pair])):
            if out != got:
                raise ScheduleError(f"{schedule.name}: NCCL pairs rank {pair[0]}'s send #{k} "
                                    f"to rank {pair[1]}, {out}, with its receive of {got}")
        if len(sent[pair]) != len(taken[pair]):
            raise ScheduleError(f"{schedule.name}: ranks {pair} send {len(sent[pair])} and "
                                f"receive {len(taken[pair])} messages")
    posted = {True: defaultdict(int), False: defaultdict(int)}  # is a send: pair -> count
    pos, entered = [0] * len(plan), [False] * len(plan)
    progress = True
    while progress:
        progress = False
        for r, rank_plan in enumerate(plan):
            while pos[r] < len(rank_plan):
                ops = rank_plan[pos[r]]
                if not entered[r]:
                    for pair, _, is_send in ops:
                        posted[is_send][pair] += 1
                    entered[r] = progress = True
                if not all(posted[not is_send][pair] > k for pair, k, is_send in ops):
                    break
                pos[r], entered[r], progress = pos[r] + 1, False, True
    stuck = [(r, [str(a) for a in groups[r][pos[r]]])
             for r in range(len(plan)) if pos[r] < len(plan[r])]
    if stuck:
        raise ScheduleError(f"{schedule.name}: NCCL deadlock, ranks waiting at {stuck}")


def check_compute(schedule: Schedule) -> None:
    """Each (stage, micro-batch, slice) unit is computed on its stage's rank: exactly one F
    and either one B or one I followed by one W, F before the backward. Raises otherwise."""
    expected = {(s, j, k) for s in range(schedule.stages)
                for j in range(schedule.micro_batches * schedule.first_step,
                               schedule.micro_batches * schedule.steps)
                for k in range(schedule.slices)}
    seen: dict[str, list] = {F: [], B: [], I: [], W: []}
    for r, actions in enumerate(schedule.ranks):
        done: dict[tuple, list[str]] = {}
        for a in actions:
            if a.kind not in COMPUTE:
                continue
            unit = (a.stage, a.mb, a.slice)
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} computes {a}, which belongs to another rank")
            history = done.setdefault(unit, [])
            need = {F: [], B: [F], I: [F], W: [F, I]}[a.kind]
            if history != need:
                raise ScheduleError(f"rank {r}: {a} after {history or 'nothing'}")
            history.append(a.kind)
            seen[a.kind].append(unit)
    for kind in (F,):
        if sorted(seen[kind]) != sorted(expected):
            raise ScheduleError(f"{schedule.name}: forwards do not cover each unit exactly once")
    backward = sorted(seen[B] + seen[I])
    if backward != sorted(expected) or sorted(seen[W]) != sorted(seen[I]):
        raise ScheduleError(f"{schedule.name}: backwards do not cover each unit exactly once")


def peak_in_flight(schedule: Schedule,
                   weight: Callable[[int], float] = lambda stage: 1) -> list[float]:
    """Per rank, the most activations it holds at once: the sum of `weight(stage)` (default
    1, counting (chunk, micro-batch, slice) units) over the units between their forward and
    their last backward action (zero-bubble: their W, which still reads the inputs). It
    depends on each rank's order only, not on the costs."""
    peaks = []
    for actions in schedule.ranks:
        split = {(a.stage, a.mb, a.slice) for a in actions if a.kind == I}
        live = peak = 0
        for a in actions:
            unit = (a.stage, a.mb, a.slice)
            if a.kind == F:
                live += weight(a.stage)
                peak = max(peak, live)
            elif a.kind == W or (a.kind == B and unit not in split):
                live -= weight(a.stage)
        peaks.append(peak)
    return peaks


def bubble_fraction(events: list[Event]) -> float:
    """Idle share of the ranks' time between the first start and the last end of any action:
    1 - (busy time summed over ranks) / (ranks x makespan)."""
    ranks = {e.rank for e in events}
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events if e.action.kind in COMPUTE)
    return 1.0 - busy / (len(ranks) * (t1 - t0))
