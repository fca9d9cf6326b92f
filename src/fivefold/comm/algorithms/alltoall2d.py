"""Tutel's 2D hierarchical all-to-all as a schedule (Hwang et al., "Tutel: adaptive
mixture-of-experts at scale", arXiv 2206.03382, Sec. 3.3, "2DH all-to-all").

A flat all-to-all over n ranks sends n-1 small messages per rank, most of them across nodes;
at scale each message is too small to fill the network. 2DH aggregates: step 1, inside every
node, device b hands device d everything that is bound for devices of index d on any node
(one all-to-all over the fast fabric); step 2, device d of every node sends node c's device d,
over its rail, one aggregated message holding what all devices of its node had for it. Each
rank then sends per_node-1 messages inside the node and nodes-1 across, each per_node times
larger than a flat all-to-all's. (Tutel's layout transforms between the steps become chunk
relays here: a schedule moves chunks by index, so nothing needs re-ordering.)

Chunk c = src * n + dst is rank src's split for rank dst; rank r is device r mod per_node of
node r div per_node.
"""

from __future__ import annotations

from fivefold.comm.schedule import Schedule, Transfer, make


def hierarchical_all_to_all(ranks: int, per_node: int) -> Schedule:
    if per_node < 1 or ranks % per_node:
        raise ValueError(f"the 2D all-to-all needs whole nodes: {ranks} ranks are not a "
                         f"multiple of {per_node} per node")
    n, g = ranks, per_node
    intra, inter = [], []
    for src in range(n):
        node, local = divmod(src, g)
        for dst in range(n):
            relay = node * g + dst % g  # same node as src, same device index as dst
            if relay != src:
                intra.append(Transfer(src, relay, src * n + dst))
            if relay != dst:
                inter.append(Transfer(relay, dst, src * n + dst))
    return make("all_to_all", n, 1, [intra, inter], "hierarchical")
