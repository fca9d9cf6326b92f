"""The pipeline schedules the simulator replays: the runtime's own action lists.

Schedules are data (DESIGN.md): fivefold.parallel.pipeline.schedules builds, for every
pipeline rank, the ordered list of actions the executor runs (gpipe, 1f1b, interleaved,
zb = ZB-H1, terapipe, pipedream-2bw; torch-free). This module is the seam between that
definition and the planner: it keeps each rank's compute actions and names them for
fivefold.planner.replay as (kind, micro-batch, virtual stage, token slice), with kind "F"
(forward), "B" (backward; for zero-bubble schedules the input-gradient part, the runtime's
"I") and "W" (weight gradients). Point-to-point sends and receives are implied by the
stage order and timed by the replay with the modelled transfer time.
"""

from __future__ import annotations

from typing import NamedTuple

from fivefold.parallel.pipeline import schedules as runtime


class Action(NamedTuple):
    kind: str  # "F" | "B" | "W"
    mb: int
    stage: int
    slice: int = 0


Schedule = list[list[Action]]

KINDS = {runtime.F: "F", runtime.B: "B", runtime.I: "B", runtime.W: "W"}


def actions_for(schedule: str, pp: int, vpp: int, m: int, slices: int = 1,
                steps: int = 1) -> Schedule:
    """Each rank's compute actions under the runtime's schedule `schedule`."""
    if schedule == "pipedream-2bw":
        built = runtime.pipedream_2bw_schedule(pp, m, steps)
    else:
        name = "interleaved" if vpp > 1 else schedule
        built = runtime.build_schedule(name, pp, m, vpp, slices if name == "terapipe" else 1)
    return [[Action(KINDS[a.kind], a.mb, a.stage, a.slice) for a in rank
             if a.kind in KINDS] for rank in built.ranks]


def peak_in_flight(schedule: str, pp: int, m: int, rank: int, vpp: int = 1,
                   slices: int = 1) -> int:
    """Activations rank `rank` holds at its peak, in (chunk, micro-batch, slice) units."""
    if schedule == "pipedream-2bw":
        return min(pp - rank, m)
    name = "interleaved" if vpp > 1 else schedule
    return runtime.theory_peak_in_flight(name, pp, m, rank, vpp, slices)


def bubble_fraction(schedule: str, pp: int, m: int, vpp: int = 1, slices: int = 1) -> float:
    """Idle share of a step with T_B = 2 T_F (the search's fast estimate; the replay is
    exact for the real durations)."""
    if schedule == "pipedream-2bw":
        return 0.0  # no flush: the fill and drain happen once per run, not per step
    name = "interleaved" if vpp > 1 else schedule
    return runtime.theory_bubble(name, pp, m, vpp, slices)
