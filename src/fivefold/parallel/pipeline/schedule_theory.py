"""Closed forms of the synchronous schedules' bubble and activation peak (the papers' analyses).

The search scores layouts with these (fivefold.planner.schedules), and the tests check that
replaying the action lists (fivefold.parallel.pipeline.replay) with unit costs gives exactly
these numbers. The V schedules (fivefold.parallel.pipeline.schedules_v) are built by a list
scheduler and have no closed form here: the planner replays their lists instead.
"""

from __future__ import annotations


def theory_bubble(name: str, pp: int, micro_batches: int, vpp: int = 1, slices: int = 1) -> float:
    """Idle fraction of the step with the costs of `replay.unit_cost` (T_F = 1, T_B = 2, or
    T_I = T_W = 1, per micro-batch through one whole stage).

    GPipe and 1F1B (GPipe Sec. 2.2): (p-1)/(m+p-1). Interleaved (Megatron Sec. 2.2.2): the
    bubble time divides by v, (p-1)/(v m + p - 1). ZB-H1 (ZB Sec. 3.1): the bubble is
    (p-1)(T_F + T_I - T_W) = (p-1) T_F against 3 m T_F of work, (p-1)/(3m + p - 1). TeraPipe:
    m*n units of 1/n micro-batch each, (p-1)/(m n + p - 1).

    The interleaved and ZB-H1 figures assume m >= p. With fewer micro-batches, each of the
    v - 1 extra trips of the micro-batch group around the ring leaves p - m chunk slots idle,
    and ZB-H1 has only m deferred W's to fill the p - 1 slots of its drain: both add p - m
    to the bubble, in chunk slots times v - 1 (interleaved) or in T_F (ZB-H1).
    """
    p, m, v = pp, micro_batches, vpp
    short = max(p - m, 0)
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        idle = p - 1 + (v - 1) * short
        return idle / (v * m + idle)
    if name == "zb":
        idle = p - 1 + short
        return idle / (3 * m + idle)
    if name == "terapipe":
        return (p - 1) / (m * slices + p - 1)
    raise ValueError(f"no bubble theory for {name!r}")


def theory_peak_in_flight(name: str, pp: int, micro_batches: int, rank: int, vpp: int = 1,
                          slices: int = 1) -> int:
    """Most (chunk, micro-batch, slice) activations rank `rank` holds at once: from its
    forward until its backward (zero-bubble: until its W, which still reads the inputs).

    GPipe: all m. 1F1B: p - r (the warm-up plus one). ZB-H1: p on every rank (Sec. 3.1:
    the deferred W's keep every rank at 1F1B's peak). Interleaved: the warm-up plus one,
    2(p-r-1) + (v-1)g + 1 chunk activations (each 1/v of a stage). TeraPipe: m n slices.
    Each is capped by the m (or m v) units that exist.
    """
    p, m, r = pp, micro_batches, rank
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - r, m)
    if name == "zb":
        return min(p, m)
    if name == "interleaved":
        return min(2 * (p - r - 1) + (vpp - 1) * min(p, m) + 1, vpp * m)
    if name == "terapipe":
        return m * slices
    raise ValueError(f"no in-flight theory for {name!r}")
