"""Recursive doubling all-gather, recursive halving reduce-scatter, and their all-reduce
(Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in
MPICH", IJHPCA 2005, Sec. 4 (all-gather) and 4.3-4.4 (reduce-scatter, all-reduce)): the
config's "tree" algorithm.

log2(n) steps instead of n-1, so latency-bound (small) collectives win; every rank still
sends (n-1)/n of the buffer. With n a power of two, at step s rank r swaps everything it holds
with rank r xor 2^s. For other n the all-gather is Bruck's (Bruck et al., IEEE TPDS 1997,
Sec. 3, the variant of Thakur et al. Sec. 4.1): at step s rank r sends the blocks of ranks
r .. r+2^s-1 (mod n) that it holds to rank r-2^s, ceil(log2 n) steps, the last one partial.
Chunks carry their own index, so Bruck's final rotation is not needed. Reduce-scatter is the
time-reversed dual of the all-gather; all-reduce is the two in sequence (Rabenseifner).
"""

from __future__ import annotations

from fivefold.comm.schedule import (Schedule, Transfer, all_reduce_of, make,
                                    reversed_as_reduce_scatter)


def recursive_doubling_all_gather(ranks: int, chunks_per_rank: int = 1) -> Schedule:
    n, k = ranks, chunks_per_rank
    steps = []
    if n & (n - 1) == 0:
        held = [{r} for r in range(n)]  # whose blocks each rank holds
        dist = 1
        while dist < n:
            step = [Transfer(r, r ^ dist, b * k + p) for r in range(n)
                    for b in sorted(held[r]) for p in range(k)]
            held = [held[r] | held[r ^ dist] for r in range(n)]
            steps.append(step)
            dist *= 2
    else:
        dist = 1
        while dist < n:
            count = min(dist, n - dist)
            steps.append([Transfer(r, (r - dist) % n, ((r + j) % n) * k + p) for r in range(n)
                          for j in range(count) for p in range(k)])
            dist *= 2
    return make("all_gather", n, k, steps, "tree")


def recursive_halving_reduce_scatter(ranks: int, chunks_per_rank: int = 1) -> Schedule:
    return reversed_as_reduce_scatter(recursive_doubling_all_gather(ranks, chunks_per_rank))


def recursive_all_reduce(ranks: int, chunks_per_rank: int = 1) -> Schedule:
    return all_reduce_of(recursive_halving_reduce_scatter(ranks, chunks_per_rank),
                         recursive_doubling_all_gather(ranks, chunks_per_rank), "tree")
