"""Ring all-gather, reduce-scatter and all-reduce as schedules (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009, Sec. 3).

n ranks in a cycle; in each of n-1 steps every rank passes one chunk to its successor, so
every link carries (n-1)/n of the buffer and no rank waits for a slow root. The all-gather
forwards what it received the step before; the reduce-scatter is its time-reversed dual (run
on the reversed cycle so data still flows successor-wards); the all-reduce is reduce-scatter
then all-gather, 2(n-1) steps.

On a two-level cluster the cycle is the "snake" (node 0's devices in order, node 1's in
reverse, ...), so every hop between nodes joins devices of the same index: a rail link.
"""

from __future__ import annotations

from fivefold.comm.schedule import (Schedule, Transfer, all_reduce_of, make,
                                    reversed_as_reduce_scatter)


def ring_order(ranks: int, per_node: int) -> list[int]:
    """The snake cycle: node i's devices forwards for even i, backwards for odd i."""
    if per_node <= 1 or ranks <= per_node or ranks % per_node:
        return list(range(ranks))
    order = []
    for node in range(ranks // per_node):
        local = range(per_node) if node % 2 == 0 else reversed(range(per_node))
        order += [node * per_node + j for j in local]
    return order


def ring_steps(order: list[int], bundles: list[list[int]]) -> list[list[Transfer]]:
    """All-gather of `bundles[i]` (chunks first held by order[i]) round the cycle `order`."""
    m = len(order)
    return [[Transfer(order[i], order[(i + 1) % m], c) for i in range(m)
             for c in bundles[(i - s) % m]] for s in range(m - 1)]


def ring_all_gather(ranks: int, per_node: int = 1, chunks_per_rank: int = 1,
                    order: list[int] | None = None) -> Schedule:
    order = order or ring_order(ranks, per_node)
    k = chunks_per_rank
    bundles = [[r * k + p for p in range(k)] for r in order]
    return make("all_gather", ranks, k, ring_steps(order, bundles), "ring")


def ring_reduce_scatter(ranks: int, per_node: int = 1, chunks_per_rank: int = 1) -> Schedule:
    backwards = ring_order(ranks, per_node)[::-1]
    dual = ring_all_gather(ranks, per_node, chunks_per_rank, order=backwards)
    return reversed_as_reduce_scatter(dual)


def ring_all_reduce(ranks: int, per_node: int = 1, chunks_per_rank: int = 1) -> Schedule:
    return all_reduce_of(ring_reduce_scatter(ranks, per_node, chunks_per_rank),
                         ring_all_gather(ranks, per_node, chunks_per_rank), "ring")
