"""Pipeline schedules as data, checked without ranks: every action list runs (no deadlock,
every message sent and received exactly once), every micro-batch gets exactly one forward and
one backward per chunk, and the replayed bubble and peak in-flight activations per rank equal
the schedules' theory exactly (fivefold.parallel.pipeline.schedule_theory: theory_bubble,
theory_peak_in_flight). Under NCCL's point-to-point semantics (replay.check_nccl: in-order
pairing per rank pair and direction, a send waits for its receive, batched groups start
together) the executor's issue plan (p2p_plan) runs every schedule, while issuing the lists
one operation at a time deadlocks or mispairs exactly where predicted. Also the stage
partition, the torch-free import the planner needs, and the timeline picture and trace.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from fivefold.config import load_config
from fivefold.parallel.pipeline.p2p_plan import Exchange, Step, issue_plan
from fivefold.parallel.pipeline.partition import (balanced_counts, part_costs,
                                                  stage_layer_ranges)
from fivefold.parallel.pipeline.replay import (ScheduleError, bubble_fraction, check_compute,
                                               check_nccl, peak_in_flight, replay)
from fivefold.parallel.pipeline.schedules import (B, F, I, RECV_ACT, RECV_GRAD, RECVS,
                                                  SEND_ACT, SEND_GRAD, SENDS, W, Action,
                                                  Schedule, build_schedule,
                                                  pipedream_2bw_schedule)
from fivefold.parallel.pipeline.schedule_theory import theory_bubble, theory_peak_in_flight
from fivefold.parallel.pipeline.timeline import chrome_trace, plot_timeline


def _cases():
    """(name, pp, micro-batches, vpp, slices) over a grid, interleaved with m <= p or p | m."""
    for p in range(1, 7):
        for m in range(1, 2 * p + 2):
            yield "gpipe", p, m, 1, 1
            yield "1f1b", p, m, 1, 1
            yield "zb", p, m, 1, 1
            for slices in (2, 3):
                yield "terapipe", p, m, 1, slices
            if m <= p or m % p == 0:
                for v in (2, 3):
                    yield "interleaved", p, m, v, 1


CASES = list(_cases())


@pytest.mark.parametrize("tied", [False, True])
def test_every_schedule_runs_and_matches_theory(tied):
    for name, p, m, v, slices in CASES:
        label = (name, p, m, v, slices, tied)
        for forward_only in (False, True):
            schedule = build_schedule(name, p, m, v, slices, tied, forward_only)
            events = replay(schedule)  # raises on a deadlock or a lost message
            assert len(events) == sum(len(r) for r in schedule.ranks), label
        schedule = build_schedule(name, p, m, v, slices, tied)
        check_compute(schedule)
        assert bubble_fraction(replay(schedule)) == pytest.approx(
            theory_bubble(name, p, m, v, slices), abs=1e-12), label
        assert peak_in_flight(schedule) == [
            theory_peak_in_flight(name, p, m, r, v, slices) for r in range(p)], label


def _unbatched_nccl_failure(name, p, m, tied, forward_only):
    """What NCCL does to the lists issued one operation at a time (the executor before the
    issue plan): 1F1B, ZB and interleaved training cross a send and a receive on both sides
    of a boundary as soon as two micro-batches are in flight; interleaved evaluation does
    once the micro-batches wrap from the last rank back to the first (m >= p); with a tied
    embedding, interleaved sends the matrix ahead of the activations the last rank waits for
    first (pp 2: NCCL pairs it with an activation; pp >= 3: deadlock)."""
    if p < 2 or name in ("gpipe", "terapipe"):
        return None
    if name == "interleaved" and tied:
        return "pairs" if p == 2 else "deadlock"
    if forward_only:
        return "deadlock" if name == "interleaved" and m >= p else None
    return "deadlock" if m >= 2 else None


def _check_plan_keeps_the_lists(schedule):
    """The plan runs each rank's list: its Steps in list order, each with the receives listed
    right before it; every send and receive issued once; a send right after the step that
    precedes it in the list, a receive no later than the list has it."""
    for actions, plan in zip(schedule.ranks, issue_plan(schedule)):
        steps = [a for a in actions if a.kind not in SENDS and a.kind not in RECVS]
        assert [i.action for i in plan if isinstance(i, Step)] == steps
        listed_after = {}  # p2p action: steps before it in the list
        done, needs = 0, []
        for a in actions:
            if a.kind in RECVS:
                needs.append(a)
            if a.kind in SENDS or a.kind in RECVS:
                listed_after[a] = done
            else:
                assert _plan_step(plan, done).needs == tuple(needs)
                done, needs = done + 1, []
        issued_after, done = {}, 0
        for item in plan:
            if isinstance(item, Step):
                done += 1
                continue
            for a in item.actions:
                assert a not in issued_after, a
                issued_after[a] = done
        assert issued_after.keys() == listed_after.keys()
        for a, n in issued_after.items():
            assert n == listed_after[a] if a.kind in SENDS else n <= listed_after[a], a


def _plan_step(plan, index):
    return [i for i in plan if isinstance(i, Step)][index]


@pytest.mark.parametrize("tied", [False, True])
def test_every_schedule_runs_under_nccl(tied):
    """pp 1-6, micro-batches 1..2p+1, vpp 2 and 3, training and evaluation: the issue plan
    passes the NCCL check; the lists issued one operation at a time fail where predicted."""
    failures = {"deadlock": 0, "pairs": 0}
    for name, p, m, v, slices in CASES:
        for forward_only in (False, True):
            schedule = build_schedule(name, p, m, v, slices, tied, forward_only)
            check_nccl(schedule)
            _check_plan_keeps_the_lists(schedule)
            expected = _unbatched_nccl_failure(name, p, m, tied, forward_only)
            if expected is None:
                check_nccl(schedule, batched=False)
                continue
            with pytest.raises(ScheduleError, match=f"NCCL {expected}"):
                check_nccl(schedule, batched=False)
            failures[expected] += 1
    # training with m >= 2 on pp 2..6: 40 cases each for 1F1B, ZB and interleaved (vpp 2
    # and 3); interleaved evaluation with m >= p: 20; tied interleaved: all 50 (6 on pp 2)
    assert failures == ({"deadlock": 3 * 40 + 20, "pairs": 0} if not tied else
                        {"deadlock": 2 * 40 + 2 * 44, "pairs": 2 * 6})


def test_pipedream_2bw_runs_under_nccl():
    """2BW's plan (loss and tied-matrix messages between the first and the last rank, across
    step boundaries) passes the NCCL check; issued one operation at a time, every pp >= 2
    layout deadlocks in 1F1B's steady state, or (tied, 3 steps) NCCL pairs the second matrix
    version with an activation."""
    for p, steps, tied in itertools.product(range(1, 6), (1, 2, 3), (False, True)):
        for m, first in itertools.product(range(p, 2 * p + 1), range(1, steps)):
            resumed = pipedream_2bw_schedule(p, m, steps, tied, first)  # from a checkpoint
            check_nccl(resumed)
            _check_plan_keeps_the_lists(resumed)
        for m in range(p, 2 * p + 1):
            schedule = pipedream_2bw_schedule(p, m, steps, tied)
            check_nccl(schedule)
            _check_plan_keeps_the_lists(schedule)
            if p == 1:
                check_nccl(schedule, batched=False)
                continue
            expected = "pairs" if tied and steps == 3 and p == 2 else None
            with pytest.raises(ScheduleError, match=f"NCCL {expected or 'deadlock'}"):
                check_nccl(schedule, batched=False)


def test_issue_plan_of_1f1b_pairs_the_steady_state():
    """1F1B, 2 ranks x 3 micro-batches: rank 0 issues the activation of micro-batch 2 with
    the receive of gradient 1 as one group, so neither rank's send waits on the other's."""
    plan = issue_plan(build_schedule("1f1b", 2, 3))
    groups = [[i.actions for i in rank if isinstance(i, Exchange)] for rank in plan]
    assert (Action(SEND_ACT, 0, 2), Action(RECV_GRAD, 0, 1)) in groups[0]
    assert (Action(RECV_ACT, 1, 2), Action(SEND_GRAD, 1, 1)) in groups[1]
    assert [len(g) for g in groups[0]] == [1, 1, 1, 2, 1]


def test_nccl_check_catches_crossed_and_misordered_lists():
    """1F1B on 2 ranks x 2 micro-batches: both ranks send before they receive (rank 0 the
    activation of micro-batch 1, rank 1 the gradient of 0), a deadlock one operation at a
    time, fine as groups; two activations received in the other order than sent: NCCL would
    pair them wrongly."""
    crossed = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"NCCL deadlock.*send_act\[s0 mb1\].*"
                                            r"send_grad\[s1 mb0\]"):
        check_nccl(crossed, batched=False)
    check_nccl(crossed)
    swapped = Schedule("swapped", 2, 1, 2, 1, (
        (Action(F, 0, 0), Action(SEND_ACT, 0, 0), Action(F, 0, 1), Action(SEND_ACT, 0, 1)),
        (Action(RECV_ACT, 1, 1), Action(RECV_ACT, 1, 0), Action(F, 1, 0), Action(F, 1, 1))))
    with pytest.raises(ScheduleError, match=r"pairs rank 0's send #0 .*'act', 0, 1, 0"):
        check_nccl(swapped, batched=False)


def test_named_theory_values():
    """The papers' numbers: GPipe/1F1B (p-1)/(m+p-1); interleaving divides the bubble by v;
    ZB-H1 keeps a third of 1F1B's bubble time; 1F1B holds p activations, GPipe m."""
    assert theory_bubble("1f1b", 4, 8) == theory_bubble("gpipe", 4, 8) == 3 / 11
    assert theory_bubble("interleaved", 4, 8, vpp=2) == 3 / 19  # 1.5 bubble vs 16 of work
    assert theory_bubble("zb", 4, 8) == 3 / 27  # (p-1) T_F vs 1F1B's 3 (p-1) T_F
    assert theory_bubble("terapipe", 4, 8, slices=4) == 3 / 35
    assert [theory_peak_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [theory_peak_in_flight("gpipe", 4, 8, r) for r in range(4)] == [8] * 4
    assert [theory_peak_in_flight("zb", 4, 8, r) for r in range(4)] == [4] * 4
    assert theory_peak_in_flight("interleaved", 4, 8, 0, vpp=2) == 11  # chunk activations


def test_pipedream_2bw_never_flushes():
    """Continuous 1F1B over all steps: runs, one F and B per micro-batch, 1F1B's peak, and one
    warm-up and drain for the whole run: bubble (p-1)/(steps*m + p - 1)."""
    for p, steps, tied in itertools.product(range(1, 6), (1, 2, 3), (False, True)):
        for m in range(p, 2 * p + 1):
            schedule = pipedream_2bw_schedule(p, m, steps, tied)
            check_compute(schedule)
            assert bubble_fraction(replay(schedule)) == pytest.approx(
                (p - 1) / (steps * m + p - 1), abs=1e-12)
            assert peak_in_flight(schedule) == [p - r for r in range(p)]
            updates = [[a.mb for a in rank if a.kind == "update"] for rank in schedule.ranks]
            assert updates == [list(range(steps))] * p
            for first in range(1, steps):  # resumed from the checkpoint after UPDATE first-1
                resumed = pipedream_2bw_schedule(p, m, steps, tied, first)
                check_compute(resumed)
                assert [[a.mb for a in rank if a.kind == "update"]
                        for rank in resumed.ranks] == [list(range(first, steps))] * p
                if tied and p > 1:  # the last stage receives each matrix version it uses
                    assert [a.mb for a in resumed.ranks[-1] if a.kind == "recv_tied_weight"] \
                        == list(range(first - 1, steps - 1))
    with pytest.raises(ValueError, match="at least pp = 4 micro-batches"):
        pipedream_2bw_schedule(4, 3, 2)
    with pytest.raises(ValueError, match="first_step 2 is outside"):
        pipedream_2bw_schedule(2, 2, 2, first_step=2)


def test_interleaved_with_a_partial_group_deadlocks():
    """Why validation asks for m <= p or a multiple of p: 5 micro-batches on 4 ranks leave a
    last group of 1, and the warm-up no longer matches the dependencies."""
    with pytest.raises(ScheduleError, match="deadlock"):
        replay(build_schedule("interleaved", 4, 5, vpp=3))


def test_transfer_time_delays_gpipe_by_its_fill_and_drain():
    """A message between two ranks takes `transfer_s`: GPipe's fill and drain each cross
    p - 1 links, so its step grows by 2 (p - 1) t; the tied-embedding exchange hides behind
    them (the planner's simulator replays with its point-to-point time this way)."""
    for p, m in ((4, 8), (2, 5), (4, 4)):
        schedule = build_schedule("gpipe", p, m, tied_embeddings=True)
        events = replay(schedule, transfer_s=0.25)
        assert max(e.end for e in events) == (m + p - 1) * 3 + 2 * (p - 1) * 0.25


def test_replay_rejects_broken_lists():
    fwd = Action(F, 0, 0)
    lost = Schedule("lost", 2, 1, 1, 1, ((fwd, Action(SEND_ACT, 0, 0), Action(SEND_ACT, 0, 0)),
                                         (Action(RECV_ACT, 1, 0), Action(F, 1, 0))))
    with pytest.raises(ScheduleError, match="twice"):
        replay(lost)
    unread = Schedule("unread", 2, 1, 1, 1, ((fwd, Action(SEND_ACT, 0, 0)), (Action(F, 1, 0),)))
    with pytest.raises(ScheduleError, match="never received"):
        replay(unread)
    twice = Schedule("twice", 1, 1, 1, 1, ((fwd, Action(B, 0, 0), Action(B, 0, 0)),))
    with pytest.raises(ScheduleError, match="after"):
        check_compute(twice)
    split = Schedule("split", 1, 1, 1, 1, ((fwd, Action(W, 0, 0), Action(I, 0, 0)),))
    with pytest.raises(ScheduleError, match="after"):
        check_compute(split)


def test_zb_defers_weight_gradients_by_rank():
    """ZB-H1 rank r keeps its r oldest W's pending through the steady state."""
    schedule = build_schedule("zb", 4, 8)
    for r, actions in enumerate(schedule.ranks):
        compute = [a for a in actions if a.kind in (F, I, W)]
        first_w = next(i for i, a in enumerate(compute) if a.kind == W)
        inputs_before = sum(1 for a in compute[:first_w] if a.kind == I)
        assert inputs_before == r + 1


# ---------------------------------------------------------------- partition

TEST_MODEL = ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=96",
              "model.vocab=512", "model.seq_len=32"]


def test_partition_counts_the_head_and_embedding():
    """Test model: a block costs 208,896 FLOPs per token, the head 196,608 (0.94 blocks), the
    embedding 128; default model: the head is 2.4 blocks, so pp 2 holds 3 + 1 blocks."""
    small = load_config(None, TEST_MODEL + ["model.layers=7"]).model
    embed, blocks, head = part_costs(small)
    assert (embed, blocks[0], head) == (128.0, 208896.0, 196608.0)
    assert balanced_counts(blocks, 2, embed, head) == [4, 3]
    assert balanced_counts(blocks, 4, embed, head) == [2, 2, 2, 1]
    default = load_config(None, []).model
    embed, blocks, head = part_costs(default)
    assert head / blocks[0] == pytest.approx(2.415, abs=1e-3)
    assert balanced_counts(blocks, 2, embed, head) == [3, 1]
    assert [list(r) for r in stage_layer_ranges(small, 2, [2, 5])] == [[0, 1], [2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="must be 2 numbers"):
        stage_layer_ranges(small, 2, [3, 3])


def test_partition_is_optimal():
    """The dynamic programme's costliest stage equals the brute-force optimum."""
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in range(1, 6):
        for first, last in ((0.0, 0.0), (2.0, 7.0)):
            def worst(counts):
                out, start = [], 0
                for s, c in enumerate(counts):
                    extra = (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                    out.append(sum(costs[start:start + c]) + extra)
                    start += c
                return max(out)
            best = min(worst(c) for c in itertools.product(range(1, 9), repeat=stages)
                       if sum(c) == len(costs))
            counts = balanced_counts(costs, stages, first, last)
            assert sum(counts) == len(costs) and min(counts) >= 1
            assert worst(counts) == best


def test_schedules_import_without_torch():
    """The planner replays the same lists, through the same loop, without torch (or its
    process groups)."""
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch': raise ImportError(name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from fivefold.parallel.pipeline import schedules, replay, partition\n"
            "import fivefold.planner.schedules\n"
            "s = schedules.build_schedule('zb', 4, 8, tied_embeddings=True)\n"
            "print(round(replay.bubble_fraction(replay.replay(s)), 6))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(round(3 / 27, 6))


def test_timeline_picture_and_trace(tmp_path):
    """1F1B on 2 ranks x 4 micro-batches: the trace holds one complete event per compute
    action (16) whose durations add to the 24 units of work (in microseconds at 1 ms/unit),
    one thread per rank; the PNG is written."""
    events = replay(build_schedule("1f1b", 2, 4, tied_embeddings=True))
    chrome_trace(events, tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert len(complete) == 16
    assert sum(e["dur"] for e in complete) == pytest.approx(24_000)
    assert {e["tid"] for e in complete} == {0, 1}
    plot_timeline(events, tmp_path / "t.png", "1F1B", pp=2, time_unit="T_F")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
