"""The optimal all-gather time of a topology, the yardstick every schedule is reported against
(ForestColl, Zhao et al., arXiv 2402.06787, Sec. 4-5: spanning-tree packing reaches the cut
bound, and the optimum is computable in polynomial time).

An all-gather broadcasts every rank's shard (nbytes / n) to every other rank. Split the shard
of source s fractionally over many spanning out-trees rooted at s (ForestColl's forest): the
load f_s(e) they put on link e supports them iff, for every destination d, a unit s->d flow
fits under f_s (Edmonds' arborescence-packing theorem: the min s-d cut is at least 1 for all
d). All sources share every link's bandwidth, so the least time T solves the LP

    minimise T  subject to  for every s, d != s: g_sd is a unit s->d flow, g_sd <= f_s,
                            for every link e:    (nbytes / n) * sum_s f_s(e) <= T * B_e,

(scipy.optimize.linprog, HiGHS). It is a pure bandwidth bound (large messages); the latency
bound is the longest shortest-path latency from a shard's owner to a rank, and `bound_s` is
the larger of the two.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from fivefold.comm.topology import Topology


@dataclass(frozen=True)
class AllGatherBound:
    bandwidth_s: float
    latency_s: float

    @property
    def bound_s(self) -> float:
        return max(self.bandwidth_s, self.latency_s)


def all_gather_bound(topology: Topology, nbytes: float) -> AllGatherBound:
    """Lower bound on any all-gather of `nbytes` (the full output) on `topology`."""
    topology.check_connected()
    n, links = topology.ranks, topology.links
    if n == 1:
        return AllGatherBound(0.0, 0.0)
    E = len(links)
    pairs = [(s, d) for s in range(n) for d in range(n) if d != s]
    # columns: T, f[s, e] (n*E), g[(s, d), e] (len(pairs)*E)
    f0, g0 = 1, 1 + n * E
    cols = g0 + len(pairs) * E
    eq_r, eq_c, eq_v, b_eq = [], [], [], []
    for p, (s, d) in enumerate(pairs):
        for v in range(n):
            row = len(b_eq)
            for e, link in enumerate(links):
                if link.src == v:
                    eq_r.append(row), eq_c.append(g0 + p * E + e), eq_v.append(1.0)
                if link.dst == v:
                    eq_r.append(row), eq_c.append(g0 + p * E + e), eq_v.append(-1.0)
            b_eq.append(1.0 if v == s else -1.0 if v == d else 0.0)
    ub_r, ub_c, ub_v, b_ub = [], [], [], []
    for p, (s, d) in enumerate(pairs):
        for e in range(E):
            row = len(b_ub)
            ub_r += [row, row]
            ub_c += [g0 + p * E + e, f0 + s * E + e]
            ub_v += [1.0, -1.0]
            b_ub.append(0.0)
    shard = nbytes / n
    for e, link in enumerate(links):
        row = len(b_ub)
        ub_r.append(row), ub_c.append(0), ub_v.append(-1.0)
        for s in range(n):
            ub_r.append(row), ub_c.append(f0 + s * E + e), ub_v.append(shard / link.bandwidth_Bps)
        b_ub.append(0.0)
    cost = np.zeros(cols)
    cost[0] = 1.0
    res = linprog(cost, A_ub=coo_matrix((ub_v, (ub_r, ub_c)), shape=(len(b_ub), cols)),
                  b_ub=b_ub, A_eq=coo_matrix((eq_v, (eq_r, eq_c)), shape=(len(b_eq), cols)),
                  b_eq=b_eq, bounds=(0, None), method="highs")
    assert res.status == 0, res.message  # connected topologies are always feasible
    return AllGatherBound(float(res.x[0]), _latency_bound(topology))


def _latency_bound(topology: Topology) -> float:
    """max over (s, d) of the least total link latency on a path s -> d (Dijkstra)."""
    out: dict[int, list] = {r: [] for r in range(topology.ranks)}
    for link in topology.links:
        out[link.src].append((link.dst, link.latency_s))
    worst = 0.0
    for src in range(topology.ranks):
        best = {src: 0.0}
        heap = [(0.0, src)]
        while heap:
            dist, v = heapq.heappop(heap)
            if dist > best.get(v, float("inf")):
                continue
            for w, lat in out[v]:
                if dist + lat < best.get(w, float("inf")):
                    best[w] = dist + lat
                    heapq.heappush(heap, (dist + lat, w))
        worst = max(worst, max(best.values()))
    return worst
