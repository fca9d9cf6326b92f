"""Layer-to-stage assignment by dynamic programming (Alpa's inter-operator pass).

Alpa (Zheng et al., arXiv 2201.12023, Sec. 5.2) cuts the layer chain into pipeline stages
by dynamic programming so that the slowest stage, which sets the pipeline's pace, is as fast
as possible, subject to each stage fitting in memory. Here the chain is the model's blocks
with their per-micro-batch times (MoE and dense blocks differ), the first stage also carries
the embedding and the last the output head and loss (large for big vocabularies, so the last
stage gets fewer blocks), and stage s may hold at most the blocks that `fits(s, count)`
allows (its in-flight micro-batches differ by schedule).

  best[s][i] = min over k < i of max(best[s-1][k], cost(s, blocks k..i-1))

best[s-1][k] grows with k and cost(s, k..i-1) shrinks with k, so the optimal k is where they
cross, found by bisection: O(S L log L) for S stages and L blocks.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Callable


def partition(costs: list[float], stages: int, first_extra: float = 0.0,
              last_extra: float = 0.0,
              fits: Callable[[int, int, int], bool] = lambda s, a, b: True) -> list[int]:
    """Blocks per stage (sum = len(costs), each >= 1) minimising the slowest stage."""
    n = len(costs)
    if stages > n:
        raise ValueError(f"{stages} stages for {n} blocks")
    prefix = [0.0, *accumulate(costs)]

    def cost(s: int, a: int, b: int) -> float:
        if b <= a or not fits(s, a, b):
            return math.inf
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    best = [cost(0, 0, i) for i in range(n + 1)]
    cuts: list[list[int]] = [[0] * (n + 1)]
    for s in range(1, stages):
        new, arg = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(s + 1, n + 1):
            lo, hi = s, i - 1  # the last cut k: stage s takes blocks k..i-1
            while lo < hi:  # first k where best[k] >= cost(s, k, i)
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
        raise ValueError("no assignment of blocks to stages fits in memory")
    sizes, i = [], n
    for s in range(stages - 1, 0, -1):
        k = cuts[s][i]
        sizes.append(i - k)
        i = k
    sizes.append(i)
    return sizes[::-1]
