"""How a pipeline cuts its work: blocks into stages, stages onto ranks, sequences into slices.

The step time of a pipeline is set by its slowest stage, so the blocks are cut into
`pp * vpp` contiguous runs (virtual stages, see fivefold.parallel.pipeline.schedules) that
minimize the most expensive run, with the first stage also paying for the embedding and the
last for the final norm, the output head and the loss. The head is not small: with the
project's FLOP convention (fivefold.models.flops) it costs 6 V D per token, about 2.4 blocks
of the default `tiny` model, which is why the last stage of a balanced split holds fewer
blocks (Megatron-LM's uneven first/last stages and its "account for embedding/loss in the
pipeline split" options address the same imbalance). The split is exact dynamic programming
over (stages, blocks); every stage holds at least one block. The planner uses the same
function with modelled times and a memory bound (fivefold.planner.simulate).

Costs are training FLOPs per token: a block 3 (2 P_block + 4 T H E) (matrix multiplies and
attention over the full T x T square, as in fivefold.models.flops), the head 3 * 2 V D, the
embedding 2 D (its lookup and its gradient's scatter-add move D values per token; it has no
matrix multiply). The planner may pass measured costs instead.

A pp rank holds virtual stages pp_rank, pp_rank + pp, ... (`stage_ids_of_rank`, its chunks
under interleaving), or pp_rank and 2pp-1-pp_rank under a V schedule. TeraPipe cuts each
sequence into `ParallelPlan.slices` near-equal slices (`slice_bounds`;
fivefold.parallel.pipeline.terapipe runs them). Pure Python, no torch: the runtime and the
planner (fivefold.planner.ledger_pipeline) cut by these same functions.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Callable

from fivefold.config import ModelConfig
from fivefold.models.flops import block_matmul_params


def part_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """(embedding, [block 0, ..., block L-1], head + loss) training FLOPs per token."""
    attention = 4 * cfg.seq_len * cfg.heads * cfg.d_head
    block = 3.0 * (2 * block_matmul_params(cfg) + attention)
    return 2.0 * cfg.hidden, [block] * cfg.layers, 6.0 * cfg.vocab * cfg.hidden


def balanced_counts(block_costs: list[float], stages: int, first_extra: float = 0.0,
                    last_extra: float = 0.0,
                    fits: Callable[[int, int, int], bool] = lambda s, a, b: True) -> list[int]:
    """Blocks per stage, contiguous, at least one each, minimizing the costliest stage;
    stage s may hold blocks [a, b) only if `fits(s, a, b)` (the planner's memory bound).

    Exact dynamic programming (Alpa's inter-operator pass, arXiv 2201.12023 Sec. 5.2):
    best[s][i] = min over k < i of max(best[s-1][k], cost(s, blocks k..i-1)). best[s-1][k]
    grows with k and cost(s, k..i-1) shrinks with k, so the optimal k is where they cross,
    found by bisection: O(S L log L) for S stages and L blocks (the planner's search calls
    this for every layout)."""
    n = len(block_costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages of at least one block")
    prefix = [0.0, *accumulate(block_costs)]

    def cost(s: int, lo: int, hi: int) -> float:  # blocks [lo, hi) on stage s
        if hi <= lo or not fits(s, lo, hi):
            return math.inf
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    best = [cost(0, 0, i) for i in range(n + 1)]  # stages 0..s holding blocks [0, i)
    cuts: list[list[int]] = [[0] * (n + 1)]
    for s in range(1, stages):
        new, arg = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(s + 1, n + 1):
            lo, hi = s, i - 1  # the first k where best[k] >= cost(s, k, i)
            while lo < hi:
                mid = (lo + hi) // 2
                if best[mid] >= cost(s, mid, i):
                    hi = mid
                else:
                    lo = mid + 1
            for k in (lo - 1, lo):
                if s <= k < i:
                    value = max(best[k], cost(s, k, i))
                    if value < new[i]:
                        new[i], arg[i] = value, k
        best = new
        cuts.append(arg)
    if math.isinf(best[n]):
        raise ValueError(f"no split of {n} blocks into {stages} stages fits in memory")
    counts, i = [], n
    for s in range(stages - 1, 0, -1):
        k = cuts[s][i]
        counts.append(i - k)
        i = k
    counts.append(i)
    return counts[::-1]


def stage_layer_ranges(cfg: ModelConfig, stages: int,
                       counts: list[int] | None = None) -> list[range]:
    """The block indices of each virtual stage: `counts` as given, else balanced by cost."""
    if counts is None:
        embed, blocks, head = part_costs(cfg)
        counts = balanced_counts(blocks, stages, embed, head)
    if len(counts) != stages or min(counts) < 1 or sum(counts) != cfg.layers:
        raise ValueError(f"stage layer counts {counts} must be {stages} numbers of at least one "
                         f"block summing to {cfg.layers}")
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def stage_ids_of_rank(pp: int, vpp: int, pp_rank: int, v_shape: bool = False) -> list[int]:
    """The virtual stages pp rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (its chunks),
    or in a V (two chunks, fivefold.parallel.pipeline.schedules_v) pp_rank and 2pp-1-pp_rank."""
    if v_shape:
        return sorted((pp_rank, 2 * pp - 1 - pp_rank))
    return [pp_rank + c * pp for c in range(vpp)]


def slice_bounds(seq_len: int, slices: int) -> list[tuple[int, int]]:
    """[start, end) of each slice: near-equal lengths, the longer ones first."""
    if not 1 <= slices <= seq_len:
        raise ValueError(f"cannot cut {seq_len} tokens into {slices} slices")
    base, extra = divmod(seq_len, slices)
    bounds, start = [], 0
    for k in range(slices):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
