"""Pipeline schedules as data: for every pp rank, the ordered list of actions it performs.

One definition, two uses: `fivefold.parallel.pipeline.executor` runs these lists on ranks,
and the planner (or `replay`) replays exactly the same lists with modelled costs. Nothing here
imports torch, so the lists can be built and checked anywhere.

Stages and chunks. The model's blocks are cut into `pp * vpp` virtual stages; virtual stage s
lives on rank s % pp as its model chunk s // pp (Megatron-LM's interleaved assignment, arXiv
2104.04473, Sec. 2.2). With vpp = 1 the virtual stage is the rank. The V schedules, ZB-V and
DualPipe-V (fivefold.parallel.pipeline.schedules_v), place their two chunks in a V instead:
stage s < p on rank s, stage s >= p on rank 2p-1-s. Stage 0 embeds the tokens, the last stage
applies the final norm, the head and the loss. The actions, the placement and the messages
are fivefold.parallel.pipeline.actions'.

Actions. Compute: F (forward), B (full backward), or, for zero-bubble schedules, I (backward
for the input only: the gradient sent upstream) and W (the weight gradients, any time after
I). Point-to-point: SEND_ACT / RECV_ACT move a stage's output activation downstream,
SEND_GRAD / RECV_GRAD move the gradient of a stage's input upstream. With tied embeddings the
first rank owns the embedding matrix; the last stage borrows it (SEND/RECV_TIED_WEIGHT at the
start of a step) and returns the head's share of its gradient (SEND/RECV_TIED_GRAD) before the
first rank's last weight-gradient action, so the owner's gradient is complete when data
parallelism reduces it. The borrowed copy's gradient is computed with the input gradient (in
B, or in I: never deferred to W), so it is complete after the last stage's last I, which
precedes the first rank's last W: the exchange adds no bubble. Sends never wait; a receive
waits until its message has been sent. Each message has an identity (`message`, sent as the
tag), so matching never depends on arrival order. A message between two stages on one rank
(a V's turn at the last rank, its tied embedding on the first) goes through the executor's
mailbox.

A micro-batch is a group of sequences; TeraPipe (arXiv 2102.07988) further cuts each sequence
into token slices, and its actions carry the slice index.
"""

from __future__ import annotations

from fivefold.parallel.pipeline.actions import (  # noqa: F401 (the lists' vocabulary)
    B, COMPUTE, F, GRADIENT_KINDS, I, RECV_ACT, RECV_GRAD, RECV_LOSS, RECV_TIED_GRAD,
    RECV_TIED_WEIGHT, RECVS, SEND_ACT, SEND_GRAD, SEND_LOSS, SEND_TIED_GRAD, SEND_TIED_WEIGHT,
    SENDS, SYNC_SCHEDULES, UPDATE, V_SCHEDULES, W, Action, Schedule, message, peer_stage,
    rank_of_stage, with_p2p, with_tied_embedding)
from fivefold.parallel.pipeline.schedules_v import build_v_schedule


# ---------------------------------------------------------------- compute orders per rank

def gpipe_order(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """GPipe (arXiv 1811.06965, Sec. 2.2, Fig. 2c).

    Fill: every micro-batch's forward, in order; the last stage starts its backward only after
    the last forward. Drain: the backwards, last micro-batch first (the figure's order), so the
    last stage starts with the micro-batch it has just finished. All m activations are alive
    at the turn: peak in-flight = m on every rank.
    """
    return ([Action(F, rank, j) for j in range(micro_batches)] +
            [Action(B, rank, j) for j in reversed(range(micro_batches))])


def one_f_one_b_order(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B, PipeDream-Flush (PipeDream arXiv 1806.03377 Sec. 3.2; 2BW arXiv 2006.09503 Sec. 3.3).

    Warm-up: rank r runs min(p - r - 1, m) forwards, exactly enough that the first backward
    reaches it the moment its next forward is done. Steady state: one forward, one backward.
    Cool-down: the remaining backwards. The bubble is the same as GPipe's, (p-1)/(m+p-1) of
    the step, but rank r holds at most p - r activations instead of m.
    """
    warm = min(pp - rank - 1, micro_batches)
    out = [Action(F, rank, j) for j in range(warm)]
    for i in range(micro_batches - warm):
        out += [Action(F, rank, warm + i), Action(B, rank, i)]
    out += [Action(B, rank, j) for j in range(micro_batches - warm, micro_batches)]
    return out


def interleaved_tables(pp: int, vpp: int, micro_batches: int) -> tuple[list, list]:
    """(micro-batch, chunk) in the order every rank runs forwards, and backwards.

    Micro-batches go in groups of g = min(p, m) (the last group holds the rest): a group passes
    chunk 0, then chunk 1, ... (forward), and the chunks in reverse order (backward).
    """
    group = min(pp, micro_batches)
    fwd, bwd = [], []
    for first in range(0, micro_batches, group):
        mbs = range(first, min(first + group, micro_batches))
        fwd += [(j, c) for c in range(vpp) for j in mbs]
        bwd += [(j, c) for c in reversed(range(vpp)) for j in mbs]
    return fwd, bwd


def interleaved_order(pp: int, vpp: int, micro_batches: int, rank: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM, arXiv 2104.04473, Sec. 2.2, Fig. 4).

    Each rank holds v model chunks, so one micro-batch visits every rank v times and each
    visit costs 1/v of a stage: the bubble shrinks to (p-1)/(v*m + p - 1) of the step, for v
    times the point-to-point traffic. Warm-up: rank r runs 2(p - r - 1) + (v - 1) g chunk
    forwards (g micro-batches per group), which lets the first backward of the last chunk
    arrive as it finishes. Steady state: one chunk forward, one chunk backward, following
    the tables above. Cool-down: the remaining chunk backwards.
    """
    fwd, bwd = interleaved_tables(pp, vpp, micro_batches)
    total = len(fwd)
    warm = min(2 * (pp - rank - 1) + (vpp - 1) * min(pp, micro_batches), total)
    stage = lambda c: c * pp + rank  # noqa: E731
    out = [Action(F, stage(c), j) for j, c in fwd[:warm]]
    for k in range(total - warm):
        j, c = fwd[warm + k]
        jb, cb = bwd[k]
        out += [Action(F, stage(c), j), Action(B, stage(cb), jb)]
    out += [Action(B, stage(c), j) for j, c in bwd[total - warm:]]
    return out


def zb_h1_order(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-H1, zero-bubble pipeline parallelism (arXiv 2401.10241, Sec. 3.1, Fig. 3 top).

    The backward splits into I (gradient of the stage input, on the critical path between
    stages) and W (weight gradients, needed only by the optimizer). Warm-up: as 1F1B,
    p - r - 1 forwards. Steady state: F, I, and a W, except that rank r keeps its r oldest
    W's pending; they run in cool-down, where 1F1B would wait for gradients. Every rank then
    holds up to p micro-batches between F and W (1F1B's peak, now on every rank), and with
    T_F = T_I = T_W the bubble is (p-1) T_F: a third of 1F1B's (p-1)(T_F + T_B).
    """
    warm = min(pp - rank - 1, micro_batches)
    out = [Action(F, rank, j) for j in range(warm)]
    pending: list[int] = []

    def backward(j: int) -> None:
        out.append(Action(I, rank, j))
        pending.append(j)
        while len(pending) > rank:
            out.append(Action(W, rank, pending.pop(0)))

    for i in range(micro_batches - warm):
        out.append(Action(F, rank, warm + i))
        backward(i)
    for j in range(micro_batches - warm, micro_batches):
        backward(j)
    out += [Action(W, rank, j) for j in pending]
    return out


def terapipe_order(pp: int, micro_batches: int, slices: int, rank: int) -> list[Action]:
    """TeraPipe, token-level pipelining (arXiv 2102.07988, Sec. 3, Fig. 2).

    A causal model's token t depends only on tokens before it, so each sequence is cut into
    `slices` slices that enter the pipeline one after another: slice k's attention reads the
    cached keys and values of slices < k on the same stage. Forward: every (micro-batch,
    slice) in order. Backward: in exactly the reverse order, so that a slice's gradient has
    collected the key/value gradients of every later slice before it runs. With m*n units of
    1/n of a micro-batch each, the bubble is (p-1)/(m*n + p - 1).
    """
    units = [(j, k) for j in range(micro_batches) for k in range(slices)]
    return ([Action(F, rank, j, k) for j, k in units] +
            [Action(B, rank, j, k) for j, k in reversed(units)])


def forward_only_order(pp: int, vpp: int, micro_batches: int, slices: int,
                       rank: int) -> list[Action]:
    """Evaluation: every forward, in the training schedule's forward order."""
    if vpp > 1:
        fwd, _ = interleaved_tables(pp, vpp, micro_batches)
        return [Action(F, c * pp + rank, j) for j, c in fwd]
    return [Action(F, rank, j, k) for j in range(micro_batches) for k in range(slices)]



def build_schedule(name: str, pp: int, micro_batches: int, vpp: int = 1, slices: int = 1,
                   tied_embeddings: bool = False, forward_only: bool = False) -> Schedule:
    """The action lists of a synchronous schedule: "gpipe", "1f1b", "interleaved", "zb"
    (ZB-H1), "terapipe", "zbv" or "dualpipev" (fivefold.parallel.pipeline.schedules_v);
    `forward_only` gives the evaluation pass of the same layout."""
    if name not in SYNC_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; one of {SYNC_SCHEDULES}")
    if name in V_SCHEDULES:
        return build_v_schedule(name, pp, micro_batches, vpp, tied_embeddings, forward_only)
    if name != "interleaved" and vpp != 1:
        raise ValueError(f"{name} runs one chunk per rank; vpp must be 1")
    if name != "terapipe" and slices != 1:
        raise ValueError(f"{name} does not slice sequences; slices must be 1")
    stages = pp * vpp
    orders = []
    for r in range(pp):
        if forward_only:
            order = forward_only_order(pp, vpp, micro_batches, slices, r)
        elif name == "gpipe":
            order = gpipe_order(pp, micro_batches, r)
        elif name == "1f1b":
            order = one_f_one_b_order(pp, micro_batches, r)
        elif name == "interleaved":
            order = interleaved_order(pp, vpp, micro_batches, r)
        elif name == "zb":
            order = zb_h1_order(pp, micro_batches, r)
        else:
            order = terapipe_order(pp, micro_batches, slices, r)
        orders.append(with_p2p(order, stages))
    if tied_embeddings and pp > 1:
        orders = with_tied_embedding(orders, stages, (stages - 1) % pp,
                                     backward=not forward_only)
    label = f"{name} (forward only)" if forward_only else name
    return Schedule(label, pp, vpp, micro_batches, slices, tuple(tuple(o) for o in orders))


def pipedream_2bw_schedule(pp: int, micro_batches: int, steps: int,
                           tied_embeddings: bool = False, first_step: int = 0) -> Schedule:
    """PipeDream-2BW (arXiv 2006.09503, Sec. 3.1-3.2): 1F1B that never flushes.

    The warm-up of 1F1B happens once; after it every rank alternates forward and backward
    across step boundaries, so step t+1's first micro-batches enter while step t's last ones
    are still in backward. Rank r applies step t's update (UPDATE t) right after its own last
    backward of step t, without waiting for the other ranks. Every micro-batch of step t
    computes with weight version t-1 (the "double buffer"), giving the paper's update
    W(t+1) = W(t) - lr * grad f(W(t-1)); m >= p guarantees that version t-1 exists before
    step t's first forward on every rank. With tied embeddings the owner sends each new
    version of the matrix to the last stage after its update, and the last stage returns the
    head's gradient share of step t before the owner's UPDATE t; the last stage also sends
    the step's loss to the first rank there (no all-rank synchronization per step).

    `first_step` > 0 is a run resumed from a checkpoint written after UPDATE first_step-1:
    the lists cover steps first_step..steps-1 and start with a fresh warm-up, whose forwards
    recompute what was in flight (with the checkpoint's version first_step-1, so the math is
    the uninterrupted run's).
    """
    m, first, total = micro_batches, micro_batches * first_step, micro_batches * steps
    if m < pp:
        raise ValueError(f"PipeDream-2BW needs at least pp = {pp} micro-batches per step, got {m}")
    if not 0 <= first_step < steps:
        raise ValueError(f"first_step {first_step} is outside the run's steps 0..{steps - 1}")
    stages = pp
    ranks = []
    for r in range(pp):
        warm = min(pp - r - 1, total - first)
        order = [Action(F, r, g) for g in range(first, first + warm)]
        for g in range(first, total):
            if g + warm < total:
                order.append(Action(F, r, g + warm))
            order.append(Action(B, r, g))
            if g % m == m - 1:
                order.append(Action(UPDATE, r, g // m))
        ranks.append(with_p2p(order, stages))
    if pp > 1:
        _add_2bw_exchanges(ranks, m, steps, tied_embeddings, first_step)
    return Schedule("pipedream-2bw", pp, 1, m, 1, tuple(tuple(o) for o in ranks), steps,
                    first_step)


def _add_2bw_exchanges(ranks: list[list[Action]], m: int, steps: int, tied: bool,
                       first_step: int) -> None:
    """Loss (and tied-embedding) messages between the first and the last rank of 2BW.

    Step k computes with matrix version max(k-1, 0); the last stage receives each version
    before the first activation of the first step that uses it. The owner sends version
    k + 1 after its UPDATE k; a resumed run (first_step s > 0) sends version s - 1 first and
    version s where the uninterrupted run did, after the warm-up's activations."""
    first, last = ranks[0], ranks[-1]
    used_first = max(first_step - 1, 0)
    out_last = []
    for a in last:
        k = a.mb // m
        if tied and a.kind == RECV_ACT and a.mb % m == 0 and (k == first_step or
                                                               k - 1 > used_first):
            out_last.append(Action(RECV_TIED_WEIGHT, mb=max(k - 1, 0)))
        if a.kind == UPDATE:
            out_last += ([Action(SEND_TIED_GRAD, mb=a.mb)] if tied else []) + [
                Action(SEND_LOSS, mb=a.mb)]
        out_last.append(a)
    last[:] = out_last
    resent = first_step * m + len(ranks) - 1 if 0 < first_step <= steps - 2 else None
    out_first = [Action(SEND_TIED_WEIGHT, mb=used_first)] if tied else []
    for a in first:
        if tied and a.kind == F and a.mb == resent:
            out_first.append(Action(SEND_TIED_WEIGHT, mb=first_step))
        if a.kind == UPDATE:
            out_first += ([Action(RECV_TIED_GRAD, mb=a.mb)] if tied else []) + [
                Action(RECV_LOSS, mb=a.mb)]
        out_first.append(a)
        if tied and a.kind == UPDATE and a.mb + 1 <= steps - 2:
            out_first.append(Action(SEND_TIED_WEIGHT, mb=a.mb + 1))
    first[:] = out_first
