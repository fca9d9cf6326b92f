"""Time of one collective over a group of ranks on a two-level topology.

The cluster has nodes of `gpus_per_node` devices joined by a fast fabric (NVLink, per-device
one-direction bandwidth B_intra) and a network between nodes (each device's share of its
node's NICs, B_inter). A group of n ranks has `per_node` members on each of n/per_node
nodes (the mesh puts tp innermost, so a group's stride decides this: see `Group`). Bytes
follow the ledger's convention (fivefold.comm.ledger): the full buffer of an all-reduce, the
full output of an all-gather, the full input of a reduce-scatter, the send buffer of an
all-to-all. Each algorithm costs a latency term (hops x per-hop latency) plus a bandwidth term,
and the fastest one is taken, as NCCL's tuner does:

- ring (Patarasuk & Yuan 2009): all-reduce moves 2(n-1)/n of the buffer per rank, all-gather
  and reduce-scatter (n-1)/n, with n-1 (or 2(n-1)) hops. Across nodes NCCL runs one ring per
  NIC, so a node's traffic splits over its `per_node` NICs: the bandwidth is
  min(B_intra, per_node^a * B_inter), with a = the profile's `nic_aggregation` (1: every NIC
  carries its share; 0: the node's traffic funnels through one NIC, as large flat rings
  across many nodes reached in the ZeRO-3 runs of arXiv 2104.04473, Table 2).
- tree (all-reduce; NCCL's double binary tree, Sanders et al. 2009): 2x the buffer per rank at
  the same bandwidth, but 2 log2(nodes) inter-node hops instead of 2(n-1): it wins for small
  buffers on many nodes.
- hierarchical (two-level, as in Horovod / MiCS): reduce-scatter in the node, all-reduce of
  1/per_node of the buffer across nodes (each rank on its own NIC), all-gather in the node.
- all-to-all: each rank sends (n-1)/n of its buffer; the off-node part goes over its NIC.
- send/recv (pipeline stages): buffer / link bandwidth plus one hop.

The link bandwidths are the all-reduce's. A backend whose other collectives do not reach
the ring model's rate at that bandwidth says so in its profile (`reduce_scatter_eff`,
`all_gather_eff`, `all_to_all_eff`, which `fivefold calibrate` measures; 1 elsewhere): their
bandwidth terms are divided by it. Gloo on CPU ranks is the case in point: its
reduce-scatter of a buffer takes longer than its all-reduce of the same buffer, where a ring
would take half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.hardware import HardwareProfile


@dataclass(frozen=True)
class Links:
    """Effective per-device bandwidths (bytes/s) and per-hop latencies of one cluster."""

    intra_Bps: float
    inter_Bps: float
    latency_intra_s: float
    latency_inter_s: float
    gpus_per_node: int
    nic_aggregation: float = 1.0
    op_eff: tuple[tuple[str, float], ...] = ()  # (op, the profile's measured rate factor)

    def eff(self, op: str) -> float:
        """The backend's bandwidth for `op` over the ring model's (1 unless measured)."""
        return dict(self.op_eff).get(op, 1.0)

    def node_inter_Bps(self, per_node: int) -> float:
        """Network bandwidth the `per_node` ranks of one node reach together in one
        collective: per_node NICs at full aggregation, one NIC at none."""
        return self.inter_Bps * per_node ** self.nic_aggregation

    @classmethod
    def of(cls, prof: HardwareProfile, gpus_per_node: int, intra_GBps: float | None = None,
           inter_GBps: float | None = None) -> "Links":
        e = prof.eff
        intra = (intra_GBps or prof.intra_node_GBps) * 1e9 * e.comm_intra_eff
        inter = (inter_GBps or prof.inter_node_GBps) * 1e9 * e.comm_inter_eff
        return cls(intra, inter, e.latency_intra_s, e.latency_inter_s, gpus_per_node,
                   e.nic_aggregation, (("reduce_scatter", e.reduce_scatter_eff),
                                       ("all_gather", e.all_gather_eff),
                                       ("all_to_all", e.all_to_all_eff)))


@dataclass(frozen=True)
class Group:
    """n ranks, `per_node` of them on each node they span."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)

    @classmethod
    def strided(cls, size: int, stride: int, gpus_per_node: int) -> "Group":
        """The group of `size` ranks `stride` apart in rank order (mesh axes inside it)."""
        if size <= 1:
            return cls(1, 1)
        per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
        return cls(size, per_node)


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n}


_TIMES: dict[tuple, tuple[Links, float]] = {}


def collective_time(op: str, nbytes: float, group: Group, links: Links,
                    algorithm: str = "builtin") -> float:
    """Seconds for one collective of `nbytes` (ledger convention) over `group`; a `[comm]`
    algorithm other than "builtin" is priced as the very schedule the runtime runs.
    Remembered per (op, bytes, group, links object): the planner's search asks the same
    collectives for many layouts."""
    key = (op, nbytes, group.size, group.per_node, id(links), algorithm)
    hit = _TIMES.get(key)
    if hit is not None and hit[0] is links:
        return hit[1]
    if len(_TIMES) >= 1 << 18:
        _TIMES.clear()
    seconds = _collective_time(op, nbytes, group, links, algorithm)
    _TIMES[key] = (links, seconds)
    return seconds


def _collective_time(op: str, nbytes: float, group: Group, links: Links,
                     algorithm: str) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm != "builtin":
        from fivefold.comm.choice import two_level_time
        return two_level_time(op, algorithm, nbytes, n, group.per_node, links.intra_Bps,
                              links.inter_Bps, links.latency_intra_s, links.latency_inter_s)
    if op == "all_to_all":
        return _all_to_all(nbytes, group, links)
    if op == "send":
        bw = links.intra_Bps if group.nodes == 1 else links.inter_Bps
        lat = links.latency_intra_s if group.nodes == 1 else links.latency_inter_s
        return nbytes / bw + lat
    factor = RING_FACTOR[op](n)
    options = [_ring(op, nbytes, factor, group, links)]
    if group.nodes > 1:
        options.append(_hierarchical(op, nbytes, group, links))
        if op == "all_reduce":
            options.append(_tree(nbytes, group, links))
    return min(options)


def _ring(op: str, nbytes: float, factor: float, group: Group, links: Links) -> float:
    n = group.size
    hops = (2 if op == "all_reduce" else 1) * (n - 1)
    if group.nodes == 1:
        return factor * nbytes / (links.intra_Bps * links.eff(op)) + hops * links.latency_intra_s
    bw = min(links.intra_Bps, links.node_inter_Bps(group.per_node)) * links.eff(op)
    cross = (2 if op == "all_reduce" else 1) * (group.nodes - 1)
    lat = cross * links.latency_inter_s + (hops - cross) * links.latency_intra_s
    return factor * nbytes / bw + lat


def _tree(nbytes: float, group: Group, links: Links) -> float:
    bw = min(links.intra_Bps, links.node_inter_Bps(group.per_node))
    lat = (2 * math.ceil(math.log2(group.nodes)) * links.latency_inter_s
           + 2 * (group.per_node - 1) * links.latency_intra_s)
    return 2 * nbytes / bw + lat


def _hierarchical(op: str, nbytes: float, group: Group, links: Links) -> float:
    p, nodes = group.per_node, group.nodes
    inner = Group(p, p)
    outer = Group(nodes, 1)
    share = p / p ** links.nic_aggregation  # the node's p streams share its usable NICs
    if op == "all_reduce":
        return (collective_time("reduce_scatter", nbytes, inner, links)
                + _ring("all_reduce", nbytes / p * share, 2 * (nodes - 1) / nodes, outer,
                        links)
                + collective_time("all_gather", nbytes, inner, links))
    # all-gather / reduce-scatter: the node hop on the full buffer, the network on 1/p of it
    return (collective_time(op, nbytes, inner, links)
            + _ring(op, nbytes / p * share, (nodes - 1) / nodes, outer, links))


def _all_to_all(nbytes: float, group: Group, links: Links) -> float:
    n, p, eff = group.size, group.per_node, links.eff("all_to_all")
    intra = nbytes * (p - 1) / n / (links.intra_Bps * eff)
    inter = nbytes * (n - p) / n / (links.inter_Bps * eff) if group.nodes > 1 else 0.0
    lat = (p - 1) * links.latency_intra_s + (n - p) * links.latency_inter_s / max(1, p)
    return max(intra, inter) + lat
