"""The planner's side of the pipeline schedules: a layout's action lists, timed and replayed.

Schedules are data (a list of actions per rank, not code): fivefold.parallel.pipeline.schedules builds, for every
pipeline rank, the ordered list of actions the executor runs (gpipe, 1f1b, interleaved,
zb = ZB-H1, terapipe, pipedream-2bw; torch-free), and fivefold.parallel.pipeline.replay is
the one event loop that replays them. What is the planner's own is here: which lists a
layout runs (`runtime_schedule`), the simulator's stage times as action durations
(`action_durations`), the step a replay gives the simulator (`replay_step`: per rank its
finish time, busy time and peak activation bytes), and the closed forms the search scores
with (`bubble_fraction`, `peak_in_flight`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from fivefold.parallel.pipeline import replay as runtime_replay
from fivefold.parallel.pipeline import schedule_theory as theory
from fivefold.parallel.pipeline import schedules as runtime
from fivefold.parallel.pipeline.replay import Event
from fivefold.parallel.pipeline.schedules import (B, COMPUTE, F, GRADIENT_KINDS, I, RECVS,
                                                 SENDS, W, Action, Schedule, message,
                                                 peer_stage)


@functools.lru_cache(maxsize=256)
def runtime_schedule(schedule: str, pp: int, vpp: int, m: int, slices: int = 1,
                     steps: int = 1, tied: bool = False) -> Schedule:
    """The runtime's action lists for a layout's `schedule` (vpp > 1 is interleaved 1F1B;
    `slices` counts only for TeraPipe, `steps` only for PipeDream-2BW). With `tied`
    (tied embeddings) they carry the runtime's tied-embedding exchange: the head's matrix
    lent to the last stage before its first action there, and the head gradient returned
    before the first rank's last gradient action of stage 0 (a B, or under zero-bubble a
    W), so the replay waits where the executor does."""
    if schedule == "pipedream-2bw":
        return runtime.pipedream_2bw_schedule(pp, m, steps, tied)
    name = "interleaved" if vpp > 1 and schedule not in runtime.V_SCHEDULES else schedule
    return runtime.build_schedule(name, pp, m, vpp, slices if name == "terapipe" else 1,
                                  tied_embeddings=tied)


def overlapped_pairs(schedule: str, pp: int, vpp: int, m: int) -> dict[Action, Action]:
    """DualPipe-V's F&B pairs (fivefold.parallel.pipeline.schedules_v): each paired full
    backward B, mapped to the forward F of another micro-batch that runs right before it on
    the same rank. Empty for every other schedule."""
    if schedule != "dualpipev":
        return {}
    pairs = {}
    for actions in runtime_schedule(schedule, pp, vpp, m).ranks:
        compute = [a for a in actions if a.kind in COMPUTE]
        pairs.update({b: f for f, b in zip(compute, compute[1:])
                      if f.kind == F and b.kind == B})
    return pairs


def action_durations(stage_times: list[tuple], slices: int, micro_batches: int = 1,
                     once: list[tuple[float, float]] | None = None,
                     pairs: dict[Action, Action] | None = None, overlap_eff: float = 1.0
                     ) -> Callable[[Action], float]:
    """Seconds of each compute action from the simulator's per-stage times (forward,
    backward, its weight-gradient part, forward comm, backward comm) of one micro-batch: a
    token slice takes 1/slices of them, and zero-bubble's I is the backward without its
    weight gradients (W). `once` adds, per stage, seconds paid once a step: the first to the
    stage's first forward, the second to the gradient action (B, or W) of its last
    micro-batch (backward runs a micro-batch's slices in reverse, so slice 0 comes last).

    `pairs` (`overlapped_pairs`): DualPipe-V runs each pair's forward and backward together,
    so each half's communication (the MoE dispatch and combine all-to-alls, tp and cp
    collectives) runs during the other half's compute (DeepSeek-V3, arXiv 2412.19437,
    Sec. 3.2.1): the pair saves min(F comm, B compute) + min(B comm, F compute), times
    `overlap_eff`, charged to its B."""
    def hidden(a: Action) -> float:
        f_action = (pairs or {}).get(a)
        if f_action is None:
            return 0.0
        f, _, _, fc, _ = stage_times[f_action.stage][:5]
        _, b, _, _, bc = stage_times[a.stage][:5]
        return overlap_eff * (min(fc, b - bc) + min(bc, f - fc))

    def duration(a: Action) -> float:
        f, b, w = stage_times[a.stage][:3]
        first, last = once[a.stage] if once else (0.0, 0.0)
        if a.kind == F:
            return f / slices + (first if a.mb == 0 and a.slice == 0 else 0.0)
        end = last if a.mb == micro_batches - 1 and a.slice == 0 else 0.0
        if a.kind == B:
            return b / slices + end - hidden(a)
        if a.kind == I:
            return (b - w) / slices
        if a.kind == W:
            return w / slices + end
        return 0.0

    return duration


@dataclass
class Replay:
    """A replayed step, per pipeline rank."""

    finish_s: list[float]  # when its last action ends
    busy_s: list[float]  # its compute seconds; the rest of finish_s is bubble
    peak_weight: list[float]  # peak sum of `weight(stage)` over in-flight micro-batches
    events: list[Event] = field(default_factory=list)
    # per rank, virtual stage -> (start, end) of its last gradient action (B, or W): the
    # stage's weight gradients are complete, layer by layer, during it
    last_grads: list[dict[int, tuple[float, float]]] = field(default_factory=list)


def replay_step(schedule: Schedule, duration: Callable[[Action], float], p2p_s: float,
                weight: Callable[[int], float] = lambda stage: 1,
                keep_events: bool = False, message_s: dict[str, float] | None = None
                ) -> Replay:
    """Replay `schedule` with `duration` per action and `p2p_s` per point-to-point message
    (activations forward, gradients backward; only the receiver waits), or `message_s[kind]`
    for the kinds it names (the tied embedding's "tied_weight" and "tied_grad"). Busy time is
    the sum of the rank's durations, in list order, not the replay's end - start
    differences, so it carries no rounding of the clock."""
    order = replay_order(schedule)
    cost = message_s or {}
    n = schedule.pp
    clock, busy = [0.0] * n, [0.0] * n
    at = [0.0] * len(order)  # each send's time, by its place in the order
    last_grads: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
    events: list[Event] = []
    for k, (r, a, wait) in enumerate(order):
        start = clock[r]
        if wait == _SEND:
            at[k] = start
        elif wait is not None:  # a receive: (the send's place, crosses ranks)
            sent, cross, kind = wait
            clock[r] = start = max(start, at[sent] + cost.get(kind, p2p_s) if cross
                                   else at[sent])
        else:
            d = duration(a)
            clock[r] += d
            if a.kind in COMPUTE:
                busy[r] += d
            if a.kind in GRADIENT_KINDS:
                last_grads[r][a.stage] = (start, clock[r])
        if keep_events:
            events.append(Event(r, a, start, clock[r]))
    return Replay(list(clock), busy, runtime_replay.peak_in_flight(schedule, weight),
                  events, last_grads)


_SEND = "send"
_ORDERS: dict[int, tuple[Schedule, tuple]] = {}


def replay_order(schedule: Schedule) -> tuple:
    """The order in which fivefold.parallel.pipeline.replay.replay runs the schedule's
    actions, as (rank, action, wait): wait is "send", (the send's place in the order, whether
    it crosses ranks, the message's kind) for a receive, None for the rest. The loop's order
    depends on the lists only, never on the costs, so it is found once per schedule
    (replayed at unit cost, which also checks the lists) and `replay_step` walks it with
    each layout's durations: the same arithmetic as the loop, without its message
    bookkeeping."""
    hit = _ORDERS.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    stages = schedule.stages
    sent: dict[tuple, int] = {}
    order = []
    for k, e in enumerate(runtime_replay.replay(schedule)):
        a = e.action
        if a.kind in SENDS:
            sent[message(a, stages)] = k
            order.append((e.rank, a, _SEND))
        elif a.kind in RECVS:
            cross = schedule.rank_of(peer_stage(a, stages)) != e.rank
            key = message(a, stages)
            order.append((e.rank, a, (sent[key], cross, key[0])))
        else:
            order.append((e.rank, a, None))
    if len(_ORDERS) >= 256:
        _ORDERS.clear()
    _ORDERS[id(schedule)] = (schedule, tuple(order))
    return _ORDERS[id(schedule)][1]


def peak_in_flight(schedule: str, pp: int, m: int, rank: int, vpp: int = 1,
                   slices: int = 1) -> int:
    """Activations rank `rank` holds at its peak, in (chunk, micro-batch, slice) units."""
    if schedule == "pipedream-2bw":
        return min(pp - rank, m)
    if schedule in runtime.V_SCHEDULES:  # a list scheduler's order: no closed form
        return runtime_replay.peak_in_flight(runtime_schedule(schedule, pp, vpp, m))[rank]
    name = "interleaved" if vpp > 1 else schedule
    return theory.theory_peak_in_flight(name, pp, m, rank, vpp, slices)


def bubble_fraction(schedule: str, pp: int, m: int, vpp: int = 1, slices: int = 1) -> float:
    """Idle share of a step with T_B = 2 T_F (the search's fast estimate; the replay is
    exact for the real durations)."""
    if schedule == "pipedream-2bw":
        return 0.0  # no flush: the fill and drain happen once per run, not per step
    if schedule in runtime.V_SCHEDULES:  # the lists replayed at unit cost
        sched = runtime_schedule(schedule, pp, vpp, m)
        return runtime_replay.bubble_fraction(runtime_replay.replay(sched))
    name = "interleaved" if vpp > 1 else schedule
    return theory.theory_bubble(name, pp, m, vpp, slices)
