"""The deterministic, rank-aware batch sampler: the same step gives the same batch, targets
are the inputs shifted by one, every offset stays in bounds, the ranks' shares concatenate to
the global batch, and a resumed run draws from the step alone (exact equality throughout).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fivefold.train.data import BatchSampler


TOKENS = np.arange(10_000, dtype=np.uint16)


def test_sampler_same_step_same_batch_and_steps_differ():
    s = BatchSampler(TOKENS, seq_len=16, global_batch=8, seed=3)
    x, y = s.rank_batch(5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    x2, y2 = s.rank_batch(5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(s.rank_batch(6)[0], x)
    assert not torch.equal(BatchSampler(TOKENS, 16, 8, seed=4).rank_batch(5)[0], x)
    assert not torch.equal(BatchSampler(TOKENS, 16, 8, seed=3, split=1).rank_batch(5)[0], x)


def test_sampler_targets_are_inputs_shifted_by_one():
    s = BatchSampler(TOKENS, seq_len=16, global_batch=8, seed=0)
    for step in range(4):
        x, y = s.rank_batch(step)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(y, x + 1)  # the stream is 0, 1, 2, ...: rows are contiguous
        starts = x[:, 0].numpy()
        assert np.array_equal(starts, s.global_offsets(step))


def test_sampler_stays_in_bounds():
    tokens = np.arange(17, dtype=np.uint16)  # exactly one sequence of seq_len + 1
    x, y = BatchSampler(tokens, seq_len=16, global_batch=4, seed=0).rank_batch(0)
    assert torch.equal(x, torch.arange(16).expand(4, 16))
    assert torch.equal(y, torch.arange(1, 17).expand(4, 16))
    s = BatchSampler(np.arange(40, dtype=np.uint16), seq_len=16, global_batch=64, seed=1)
    for step in range(10):
        x, y = s.rank_batch(step)
        assert y.max() <= 39 and x.min() >= 0
        assert x.shape == (64, 16)
    assert set(np.concatenate([s.global_offsets(k) for k in range(10)])) == set(range(24))


def test_sampler_rank_shares_concatenate_to_the_global_batch():
    full_x, full_y = BatchSampler(TOKENS, 16, 8, seed=9).rank_batch(11)
    parts = [BatchSampler(TOKENS, 16, 8, seed=9, dp_rank=r, dp_size=4).rank_batch(11)
             for r in range(4)]
    assert all(p[0].shape == (2, 16) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    halves = [BatchSampler(TOKENS, 16, 8, seed=9, dp_rank=r, dp_size=2).rank_batch(11)[0]
              for r in range(2)]
    assert torch.equal(torch.cat(halves), full_x)


def test_sampler_is_resumable_from_the_step_alone():
    first = BatchSampler(TOKENS, 16, 8, seed=2)
    for step in range(7):
        first.rank_batch(step)  # consuming earlier steps changes nothing
    x, y = first.rank_batch(7)
    fresh_x, fresh_y = BatchSampler(TOKENS, 16, 8, seed=2).rank_batch(7)
    assert torch.equal(x, fresh_x) and torch.equal(y, fresh_y)


def test_sampler_rejects_uneven_dp():
    with pytest.raises(ValueError):
        BatchSampler(TOKENS, 16, 6, seed=0, dp_rank=0, dp_size=4)
