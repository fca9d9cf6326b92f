"""Replay pipeline action lists event by event: start and end of every action on every rank.

Each rank runs its list (fivefold.planner.schedules) in order; an action starts when its
rank is free and its inputs exist: F(mb, g) needs F(mb, g-1) from the previous stage, B(mb, g)
needs this stage's F(mb, g) and B(mb, g+1) from the next stage, W(mb, g) needs B(mb, g)
(each per token slice under TeraPipe).
Crossing to another rank adds the point-to-point transfer time (activations forward,
gradients backward; the send runs on its own stream, so only the receiver waits). The
replay returns each rank's finish time and busy time (the rest is pipeline bubble), the
events for a trace, and the peak activation memory each rank holds: a stage's activations
live from the start of its forward to the end of its backward (or of its W).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from fivefold.planner.schedules import Action, Schedule


@dataclass
class Replay:
    finish_s: list[float]
    busy_s: list[float]
    peak_weight: list[float]  # peak sum of `weight(stage)` over in-flight micro-batches
    events: list[tuple[int, Action, float, float]] = field(default_factory=list)


def replay(schedule: Schedule, stages: int, duration: Callable[[Action], float],
           p2p_s: float, weight: Callable[[int], float] = lambda g: 1.0,
           keep_events: bool = False) -> Replay:
    pp = len(schedule)
    has_w = any(a.kind == "W" for acts in schedule for a in acts)
    end: dict[Action, float] = {}
    pos = [0] * pp
    free = [0.0] * pp
    busy = [0.0] * pp
    live = [0.0] * pp
    peak = [0.0] * pp
    events = []
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule[r]):
                act = schedule[r][pos[r]]
                ready = _ready(act, end, stages, p2p_s)
                if ready is None:
                    break
                start = max(free[r], ready)
                d = duration(act)
                end[act] = free[r] = start + d
                busy[r] += d
                if act.kind == "F":
                    live[r] += weight(act.stage)
                    peak[r] = max(peak[r], live[r])
                elif act.kind == "W" or not has_w:
                    live[r] -= weight(act.stage)
                if keep_events:
                    events.append((r, act, start, start + d))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [schedule[r][pos[r]] for r in range(pp) if pos[r] < len(schedule[r])]
            raise ValueError(f"pipeline schedule deadlocks at {stuck[:4]}")
    return Replay(free, busy, peak, events)


def _ready(act: Action, end: dict[Action, float], stages: int, p2p_s: float) -> float | None:
    """When `act`'s inputs exist, or None if one of them has not run yet."""
    kind, mb, g, k = act
    if kind == "F":
        if g == 0:
            return 0.0
        prev = end.get(Action("F", mb, g - 1, k))
        return None if prev is None else prev + p2p_s
    if kind == "W":
        return end.get(Action("B", mb, g, k))
    own = end.get(Action("F", mb, g, k))
    if own is None:
        return None
    if g + 1 == stages:
        return own
    nxt = end.get(Action("B", mb, g + 1, k))
    return None if nxt is None else max(own, nxt + p2p_s)
