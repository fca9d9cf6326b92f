"""V-shaped schedules: two model chunks per rank, chunk 0 down the ranks and chunk 1 back up.

Placement. The blocks are cut into 2p virtual stages; rank r holds stage r (chunk 0) and
stage 2p-1-r (chunk 1), so a micro-batch goes down the ranks and comes back up, and the
first rank holds both the embedding and the last stage (final norm, head, loss): the turn at
the bottom rank is free (its two chunks exchange through the executor's mailbox), and the
loss's gradient starts on the rank whose forward started first. This is the V of ZB-V
(zero-bubble pipeline parallelism, arXiv 2401.10241, Sec. 6; Qi et al., "Pipeline
parallelism with controllable memory", arXiv 2405.15362) and of DualPipe-V, the one-direction
variant of DeepSeek-V3's DualPipe (arXiv 2412.19437, Sec. 3.2.1).

Orders. Both are made by one list scheduler that plays the pipeline forward in time with
T_F = T_I = T_W = 1 and T_B = 2 per chunk, each rank taking, whenever it is free, the first
of these that is ready:
- ZB-V: the backward for the input (I) of the oldest micro-batch whose gradient has arrived
  (chunk 1 before chunk 0: it is earlier on the way back); else a forward (chunk 1 first,
  which takes a micro-batch towards its loss; a new chunk-0 forward only while the rank
  holds fewer than 2p chunk activations, 1F1B's peak of p whole-stage activations, Sec. 6's
  memory bound); else the oldest deferred weight gradient (W). A rank at that bound with no
  I ready runs a W first, which frees an activation. The W's fill what would be bubbles;
  every unit's W follows its I in the order the I's ran.
- DualPipe-V: where a forward and a backward are both ready, the rank runs them as a pair,
  the forward of one micro-batch then the full backward (B) of another (the "F&B" chunk
  pairs of Sec. 3.2.1, Fig. 4): on an accelerator, each half's MoE dispatch and combine
  all-to-alls run while the other half computes. Where only a backward is ready (warm-up's
  end, cool-down) it splits it into I and a deferred W, as ZB-V, so the W's fill the drain.
  The executor here runs a pair's two actions one after the other; which all-to-alls a pair
  hides is the simulator's to model (fivefold.planner.schedules.overlapped_pairs).

Each unit's F precedes its backward, every receive follows its send in the simulated time,
so every order the scheduler writes runs (the replay checks it). The last stage's last
backward precedes the first stage's last gradient action on rank 0, so the tied head's
gradient (returned through the mailbox) is complete before the embedding's last W.
"""

from __future__ import annotations

from fivefold.parallel.pipeline.actions import (B, F, I, V_SCHEDULES, W, Action, Schedule,
                                               with_p2p, with_tied_embedding)

COSTS = {F: 1, I: 1, W: 1, B: 2}  # per chunk, the papers' unit analysis


def v_stages(pp: int, rank: int) -> tuple[int, int]:
    """(chunk 0's stage, chunk 1's stage) of rank `rank`."""
    return rank, 2 * pp - 1 - rank


def v_orders(pp: int, micro_batches: int, pair: bool) -> list[list[Action]]:
    """Every rank's compute order (module docstring): ZB-V, or DualPipe-V with `pair`."""
    p, m, last = pp, micro_batches, 2 * pp - 1
    cap = 2 * p  # chunk activations a rank may hold before it admits a new micro-batch
    fwd_ready: dict[tuple[int, int], float] = {(0, j): 0.0 for j in range(m)}
    bwd_ready: dict[tuple[int, int], float] = {}
    next_f = [[0, 0] for _ in range(p)]  # per rank, per chunk: the next micro-batch forward
    next_b = [[0, 0] for _ in range(p)]  # ... and backward (each stage goes in order)
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    live = [0] * p
    clock = [0.0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]

    def done(r: int) -> bool:
        return (min(next_f[r]) == m and min(next_b[r]) == m and not deferred[r])

    def ready(table, r, chunk, now, counters) -> tuple[int, int] | None:
        s, j = v_stages(p, r)[chunk], counters[r][chunk]
        t = table.get((s, j))
        return (s, j) if j < m and t is not None and t <= now else None

    def run(r: int, kind: str, unit: tuple[int, int]) -> None:
        s, j = unit
        start = clock[r]
        clock[r] = end = start + COSTS[kind]
        orders[r].append(Action(kind, s, j))
        if kind == F:
            next_f[r][0 if s < p else 1] += 1
            live[r] += 1
            if s < last:
                fwd_ready[(s + 1, j)] = end
            else:
                bwd_ready[(s, j)] = end
        elif kind in (B, I):
            next_b[r][0 if s < p else 1] += 1
            if s > 0:
                bwd_ready[(s - 1, j)] = end
            if kind == B:
                live[r] -= 1
            else:
                deferred[r].append(unit)
        else:
            live[r] -= 1

    def act(r: int) -> bool:
        now = clock[r]
        back = ready(bwd_ready, r, 1, now, next_b) or ready(bwd_ready, r, 0, now, next_b)
        fwd = ready(fwd_ready, r, 1, now, next_f)
        if fwd is None and live[r] < cap:
            fwd = ready(fwd_ready, r, 0, now, next_f)
        if live[r] >= cap and deferred[r] and not back:
            run(r, W, deferred[r].pop(0))  # free an activation before taking another
        elif pair and back and fwd:
            run(r, F, fwd)
            run(r, B, back)
        elif back:
            run(r, I, back)
        elif fwd:
            run(r, F, fwd)
        elif deferred[r]:
            run(r, W, deferred[r].pop(0))
        else:
            return False
        return True

    while not all(done(r) for r in range(p)):
        busy = [q for q in range(p) if not done(q)]
        now = min(clock[q] for q in busy)
        if any(act(q) for q in busy if clock[q] == now):
            continue
        # every rank at `now` waits: move them to the next arrival or the next rank's clock
        later = [t for t in list(fwd_ready.values()) + list(bwd_ready.values()) if t > now]
        later += [clock[q] for q in busy if clock[q] > now]
        if not later:
            raise ValueError(f"V schedule p={p} m={m}: no rank can move at time {now}")
        for q in busy:
            if clock[q] == now:
                clock[q] = min(later)
    return orders


def v_forward_only_orders(pp: int, micro_batches: int) -> list[list[Action]]:
    """Evaluation: each rank runs its chunk-0 forwards, then its chunk-1 forwards."""
    return [[Action(F, s, j) for s in v_stages(pp, r) for j in range(micro_batches)]
            for r in range(pp)]


def build_v_schedule(name: str, pp: int, micro_batches: int, vpp: int = 2,
                     tied_embeddings: bool = False, forward_only: bool = False) -> Schedule:
    """The action lists of "zbv" or "dualpipev" on `pp` ranks (2 chunks each)."""
    if name not in V_SCHEDULES:
        raise ValueError(f"{name!r} is not a V schedule; one of {V_SCHEDULES}")
    if vpp != 2:
        raise ValueError(f"{name} places two chunks per rank; vpp must be 2, got {vpp}")
    if pp < 2:
        raise ValueError(f"{name} needs pp >= 2, got {pp}")
    stages = 2 * pp
    if forward_only:
        orders = v_forward_only_orders(pp, micro_batches)
    else:
        orders = v_orders(pp, micro_batches, pair=name == "dualpipev")
    ranks = [with_p2p(order, stages) for order in orders]
    if tied_embeddings:
        ranks = with_tied_embedding(ranks, stages, 0, backward=not forward_only)
    label = f"{name} (forward only)" if forward_only else name
    return Schedule(label, pp, 2, micro_batches, 1, tuple(tuple(o) for o in ranks),
                    v_shape=True)
