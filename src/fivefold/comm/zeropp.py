"""ZeRO++'s three communication reductions (Wang et al., arXiv 2306.10209).

- qwZ (Sec. 3.1): the all-gathers of ZeRO-3 weight shards over the shard group (forward, and
  backward unless hpZ serves it inside the node) send block-quantized int8 values plus one
  fp32 scale per block instead of the compute dtype: about 1/2 of bf16 bytes, 1/4 of fp32.
- hpZ (Sec. 3.2): after the forward all-gather each rank keeps a secondary shard of the
  weights partitioned over its node only; the backward all-gather then runs within the node
  (over NVLink) instead of across all shard ranks, at the cost of that extra copy.
- qgZ (Sec. 3.3): gradients are reduce-scattered by two all-to-all hops, first within the node
  and then across nodes, each sending int8 blocks; values are dequantized and summed in full
  precision between the hops, so quantization error does not grow with the number of ranks
  the way a ring of quantized partial sums would.

Rank r of the shard group is local index j = r mod g on node i = r div g (g ranks per node),
and owns the contiguous shard r of a unit's flat buffer, as unquantized ZeRO does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.comm import collectives as C
from fivefold.comm.quantize import dequantize_int8, quantize_int8


@dataclass(frozen=True)
class NodeAxes:
    """The shard group split into an intra-node axis (size g) and an inter-node axis."""

    intra: C.Axis
    inter: C.Axis


def split_by_node(shard: C.Axis, ranks_per_node: int,
                  all_groups: list[list[int]] | None = None) -> NodeAxes:
    """Create the intra- and inter-node subgroups of `shard` (collective: every rank calls).

    `all_groups`: the members of every group of this kind (the same list on every rank, this
    rank's group among them), as for the expert-data-parallel groups, whose members differ per
    ep rank: torch.distributed.new_group must see every group's calls on every rank in the
    same order. None: `shard`'s own members only (one shard group spans the ranks that call).
    """
    g, n = ranks_per_node, shard.size
    if shard.group is None or n == 1:
        none = C.Axis(f"{shard.name}.intra", None, 1, 0, shard.ledger)
        return NodeAxes(none, C.Axis(f"{shard.name}.inter", None, 1, 0, shard.ledger))
    own = dist.get_process_group_ranks(shard.group)
    intra_group = inter_group = None
    for members in all_groups or [own]:
        for node in range(n // g):  # new_group must be called by every rank for every group
            group = dist.new_group(members[node * g:(node + 1) * g])
            if members == own and shard.rank // g == node:
                intra_group = group
        for local in range(g):
            group = dist.new_group(members[local::g])
            if members == own and shard.rank % g == local:
                inter_group = group
    return NodeAxes(C.Axis(f"{shard.name}.intra", intra_group, g, shard.rank % g, shard.ledger),
                    C.Axis(f"{shard.name}.inter", inter_group, n // g, shard.rank // g,
                           shard.ledger))


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, axis: C.Axis,
                         purpose: str) -> None:
    """qwZ: `out` = concatenation of every rank's `shard`, sent as int8 blocks + scales."""
    q, scale = quantize_int8(shard)
    q_all = torch.empty(q.numel() * axis.size, dtype=torch.int8, device=q.device)
    scale_all = torch.empty(scale.numel() * axis.size, dtype=torch.float32, device=q.device)
    C.all_gather(q_all, q, axis, purpose)
    C.all_gather(scale_all, scale, axis, purpose)
    out.copy_(dequantize_int8(q_all, scale_all, out.dtype))


def _quantized_all_to_all(x: torch.Tensor, axis: C.Axis, purpose: str) -> torch.Tensor:
    """All-to-all of `x` (chunk k to rank k) as int8 blocks; returns the dequantized fp32."""
    q, scale = quantize_int8(x)
    q_out, scale_out = torch.empty_like(q), torch.empty_like(scale)
    C.all_to_all(q_out, q, axis, purpose)
    C.all_to_all(scale_out, scale, axis, purpose)
    return dequantize_int8(q_out, scale_out, torch.float32)


def quantized_reduce_scatter(out: torch.Tensor, full: torch.Tensor, nodes: NodeAxes,
                             purpose: str) -> None:
    """qgZ: `out` = this rank's shard of the sum of `full` over the shard group.

    Hop 1 (intra-node): local rank j collects, from each node peer, the shards that ranks
    with local index j own on every node, and sums them. Hop 2 (inter-node): it sends node
    i's part of that partial sum to node i's rank j and sums what it receives: its own shard.
    """
    g, num_nodes = nodes.intra.size, nodes.inter.size
    shard = full.numel() // (g * num_nodes)
    by_local_index = full.view(num_nodes, g, shard).transpose(0, 1).reshape(-1)
    node_partial = _quantized_all_to_all(by_local_index, nodes.intra, purpose)
    node_partial = node_partial.view(g, num_nodes * shard).sum(0)
    total = _quantized_all_to_all(node_partial, nodes.inter, purpose)
    out.copy_(total.view(num_nodes, shard).sum(0))

