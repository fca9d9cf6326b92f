"""The gloo test harness that every parity test stands on."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fivefold.testing import RankFailure, run_on_ranks


def _sum_of_ranks(rt, scale):
    t = torch.tensor([float(rt.rank) * scale])
    dist.all_reduce(t)
    return rt.rank, rt.world_size, t.item(), torch.get_num_threads()


def _fails_on_rank_1(rt):
    if rt.rank == 1:
        raise ValueError("rank one is unhappy")
    return rt.rank


def _rank_0_hangs(rt):
    if rt.rank == 0:
        time.sleep(60)
    return rt.rank


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4,
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_results_come_back_in_rank_order(world):
    out = run_on_ranks(_sum_of_ranks, world, 2.0, timeout_s=120)
    expected = 2.0 * sum(range(world))
    assert out == [(r, world, expected, 1) for r in range(world)]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RankFailure, match="rank one is unhappy"):
        run_on_ranks(_fails_on_rank_1, 2, timeout_s=120)


def test_a_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_on_ranks(_rank_0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 30
