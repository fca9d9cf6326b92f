"""The V schedules as data (fivefold.parallel.pipeline.schedules_v): ZB-V and DualPipe-V.

Every list (pp 2..6, 1..12 micro-batches, tied and untied, training and evaluation) computes
each unit once on its stage's rank in a V, runs under the replay and under NCCL's in-order
pairing, and keeps the memory bound the list scheduler promises: ZB-V holds at most 2p chunk
activations (1F1B's p whole-stage activations on its first rank), DualPipe-V one more. With
the papers' unit costs both idle less than ZB-H1's closed form once m >= 2p. DualPipe-V's
steady state is F&B pairs; the planner's replay hides a pair's communication (the MoE
all-to-alls) behind the other half's compute. Torch-free and fast.
"""

from __future__ import annotations

import pytest

from fivefold.config import ConfigError, load_config
from fivefold.parallel.pipeline.actions import (RECV_TIED_GRAD, RECV_TIED_WEIGHT, SEND_ACT, B,
                                                F, I, W)
from fivefold.parallel.pipeline.p2p_plan import Exchange, issue_plan
from fivefold.parallel.pipeline.partition import stage_ids_of_rank
from fivefold.parallel.pipeline.replay import (bubble_fraction, check_compute, check_nccl,
                                               peak_in_flight, replay)
from fivefold.parallel.pipeline.schedule_theory import theory_bubble
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.planner.schedules import action_durations, overlapped_pairs, runtime_schedule
from fivefold.validate import validate_for_training


def _cases():
    for name in ("zbv", "dualpipev"):
        for p in range(2, 7):
            for m in range(1, 13):
                yield name, p, m


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_lists_run_and_keep_their_memory_bound(name):
    for _, p, m in (c for c in _cases() if c[0] == name):
        for tied in (False, True):
            label = f"{name} p={p} m={m} tied={tied}"
            schedule = build_schedule(name, p, m, 2, 1, tied)
            check_compute(schedule)
            check_nccl(schedule)
            replay(schedule)
            evaluation = build_schedule(name, p, m, 2, 1, tied, forward_only=True)
            check_nccl(evaluation)
            replay(evaluation)
            bound = 2 * p + (name == "dualpipev")
            assert max(peak_in_flight(schedule)) <= bound, label
            for r, actions in enumerate(schedule.ranks):
                stages = {a.stage for a in actions if a.kind in (F, B, I, W)}
                assert stages == {r, 2 * p - 1 - r}, label


def test_v_placement_puts_the_turn_and_the_head_on_one_rank():
    """Rank 0 holds the first and the last stage; the last rank passes the activation
    between its chunks, and rank 0 lends the tied matrix to itself (mailbox: no wire)."""
    p = 4
    assert stage_ids_of_rank(p, 2, 0, v_shape=True) == [0, 7]
    assert stage_ids_of_rank(p, 2, 3, v_shape=True) == [3, 4]
    schedule = build_schedule("zbv", p, 8, 2, tied_embeddings=True)
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    kinds = [a.kind for a in schedule.ranks[0]]
    assert RECV_TIED_WEIGHT in kinds and RECV_TIED_GRAD in kinds
    assert not any(a.kind in (RECV_TIED_WEIGHT, RECV_TIED_GRAD)
                   for r in range(1, p) for a in schedule.ranks[r])
    plan = issue_plan(schedule)
    turn = [a for item in plan[p - 1] if isinstance(item, Exchange) for a in item.actions
            if a.kind == SEND_ACT and a.stage == p - 1]
    assert len(turn) == 8 and all(schedule.rank_of(a.stage + 1) == p - 1 for a in turn)


def test_v_schedules_idle_less_than_zero_bubble_h1():
    """Unit costs (T_F = T_I = T_W = 1 per stage, a chunk half of it): the V schedules'
    measured bubble against ZB-H1's (p-1)/(3m+p-1) and 1F1B's, for m >= 2p."""
    for name in ("zbv", "dualpipev"):
        for p in (2, 3, 4, 6):
            for m in (2 * p, 4 * p):
                bubble = bubble_fraction(replay(build_schedule(name, p, m, 2)))
                assert bubble < theory_bubble("zb", p, m) < theory_bubble("1f1b", p, m), \
                    (name, p, m, bubble)


def test_dualpipev_pairs_forward_and_backward_chunks():
    """Most of DualPipe-V's steady state is F&B pairs of different micro-batches (a full B
    right after another micro-batch's F); ZB-V has none (all split)."""
    p, m = 4, 16
    pairs = overlapped_pairs("dualpipev", p, 2, m)
    assert len(pairs) >= m * 2 * p // 3
    assert all(f.kind == F and b.kind == B and f.mb != b.mb for b, f in pairs.items())
    assert overlapped_pairs("zbv", p, 2, m) == {}
    zbv = runtime_schedule("zbv", p, 2, m)
    assert not any(a.kind == B for actions in zbv.ranks for a in actions)


def test_replay_hides_a_pairs_communication_behind_the_other_half():
    """(F, B, W, F comm, B comm) per stage: a paired B saves min(F comm, B compute) +
    min(B comm, F compute), times the overlap efficiency; an unpaired B pays it all."""
    times = [(1.0, 2.0, 0.8, 0.3, 0.5)] * 4
    pairs = overlapped_pairs("dualpipev", 2, 2, 8)
    duration = action_durations(times, 1, 8, pairs=pairs, overlap_eff=0.5)
    paired = next(iter(pairs))
    assert duration(paired) == pytest.approx(2.0 - 0.5 * (0.3 + 0.5))
    unpaired = [a for actions in runtime_schedule("dualpipev", 2, 2, 8).ranks
                for a in actions if a.kind == B and a not in pairs]
    assert all(duration(a) == 2.0 for a in unpaired)


@pytest.mark.parametrize("sets, key, words", [
    (["parallel.schedule=zbv", "parallel.pp=2"], "parallel.vpp", "parallel.vpp = 2"),
    (["parallel.schedule=dualpipev", "parallel.vpp=2"], "parallel.pp", "parallel.pp >= 2"),
    (["parallel.schedule=dualpipev", "parallel.pp=2", "parallel.vpp=3"], "parallel.vpp",
     "two chunks"),
])
def test_v_schedule_configs_are_checked(sets, key, words):
    cfg = load_config(None, ["model.layers=4", "parallel.global_batch=8"] + sets)
    with pytest.raises(ConfigError) as err:
        validate_for_training(cfg, 4)
    assert err.value.key == key and words in str(err.value)


def test_v_schedule_config_is_accepted_and_planned():
    cfg = load_config(None, ["model.layers=4", "parallel.global_batch=8", "parallel.pp=2",
                             "parallel.vpp=2", "parallel.schedule=dualpipev",
                             "parallel.micro_batch=1"])
    validate_for_training(cfg, 2)
    from fivefold.parallel.plan import training_plan
    plan = training_plan(cfg, 2, "cpu")
    assert plan.stage_ids_of_rank(0) == [0, 3] and plan.ends_of_rank(0) == (True, True)
    assert plan.ends_of_rank(1) == (False, False)
    train, evaluation = plan.pipeline_schedules(tied_embeddings=True)
    assert train.v_shape and evaluation.v_shape and train.micro_batches == 8
