"""Two-level (hierarchical) all-gather, reduce-scatter and all-reduce as schedules.

The cluster's two fabrics are used one at a time, each by a ring: the all-reduce
reduce-scatters inside every node, all-reduces the 1/per_node shards across nodes (devices of
the same index form one ring per rail, all rails at once), and all-gathers inside the node
(Horovod's hierarchical all-reduce; Jia et al., "Highly scalable deep learning training
system with mixed-precision", arXiv 1807.11205, Sec. 3.3; MiCS, arXiv 2205.00119, Sec. 3.3
for the all-gather). The all-gather is the inter-node half then the intra-node half: each
device first fetches its rail's shards over its own NIC ((nodes-1) shards), then the node
exchanges whole rails over the fast fabric. The reduce-scatter is the time-reversed dual (intra
first, then inter), built on reversed rings so data flows the same way round.

Rank r is device r mod per_node of node r div per_node. With one node or one device per node
this is the plain ring.
"""

from __future__ import annotations

from fivefold.comm.algorithms.ring import ring_steps
from fivefold.comm.schedule import (Schedule, all_reduce_of, make, merge_parallel,
                                    reversed_as_reduce_scatter)


def _check(ranks: int, per_node: int) -> None:
    if per_node < 1 or ranks % per_node:
        raise ValueError(f"hierarchical collectives need whole nodes: {ranks} ranks are not a "
                         f"multiple of {per_node} per node")


def hierarchical_all_gather(ranks: int, per_node: int, chunks_per_rank: int = 1,
                            backwards: bool = False) -> Schedule:
    _check(ranks, per_node)
    g, nodes, k = per_node, ranks // per_node, chunks_per_rank
    sign = -1 if backwards else 1

    def cycle(items: list[int]) -> list[int]:
        return items[::sign]

    def chunks(rank: int) -> list[int]:
        return [rank * k + p for p in range(k)]

    inter = merge_parallel(*[
        ring_steps(cycle([i * g + j for i in range(nodes)]),
                   [chunks(i * g + j) for i in cycle(list(range(nodes)))])
        for j in range(g)])
    intra = merge_parallel(*[
        ring_steps(cycle([i * g + j for j in range(g)]),
                   [[c for node in range(nodes) for c in chunks(node * g + j)]
                    for j in cycle(list(range(g)))])
        for i in range(nodes)])
    return make("all_gather", ranks, k, inter + intra, "hierarchical")


def hierarchical_reduce_scatter(ranks: int, per_node: int, chunks_per_rank: int = 1) -> Schedule:
    dual = hierarchical_all_gather(ranks, per_node, chunks_per_rank, backwards=True)
    return reversed_as_reduce_scatter(dual)


def hierarchical_all_reduce(ranks: int, per_node: int, chunks_per_rank: int = 1) -> Schedule:
    return all_reduce_of(hierarchical_reduce_scatter(ranks, per_node, chunks_per_rank),
                         hierarchical_all_gather(ranks, per_node, chunks_per_rank),
                         "hierarchical")
