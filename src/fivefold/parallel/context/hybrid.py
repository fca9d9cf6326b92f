"""The 2D hybrid of Ulysses and ring attention (USP, Fang & Zhao, arXiv 2405.07719, Sec. 3-4;
Megatron-LM's "a2a+p2p" context parallelism).

cp = u x r ranks: a Ulysses sub-axis of u ranks (innermost: cp index c = ring_index * u +
ulysses_index, so a Ulysses group is u neighbours, the same node) and a ring sub-axis of r
ranks across the groups. Ulysses' all-to-all over the inner sub-axis turns each rank's
(B, H, T/cp, E) into (B, H/u, T/r, E): the ring rank's whole part of the sequence for 1/u of
the heads; ring attention over the outer sub-axis then attends those heads over the whole
sequence, and the inverse all-to-all brings the output back. Only the all-to-alls' small
groups need a fast network; the ring's block transfers overlap compute.

USP Sec. 4.2 (load balance): the ring needs its zigzag balance on the sequence it sees after
the all-to-all, so the sequence is laid out in "zigzag-ring" order (.layout): zigzag over the
r ring ranks, each ring rank's part cut contiguously over its u Ulysses ranks. Heads follow
Ulysses' rules at degree u (`ulysses_kv_heads(K, u)`); the ring moves K'/u key/value heads.

The ledger per call on this rank: Ulysses' eight all-to-alls on the Ulysses axis with
T/u -> T/cp (the local tokens), and the ring's sends and receives on the ring axis with
K -> K'/u heads and T_local -> T/r tokens (see .ulysses and .ring_attention).
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.context.block_attention import default_scale
from fivefold.parallel.context.ring_attention import ring_attention
from fivefold.parallel.context.ulysses import ulysses_attention


def hybrid_attention(q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                     ulysses_axis: Axis, ring_axis: Axis, scale: float | None = None
                     ) -> torch.Tensor:
    """Causal attention of this rank's zigzag-ring shard (q: B, H, T/cp, E; k, v: B, K,
    T/cp, E), Ulysses over `ulysses_axis` and ring over `ring_axis`; returns (B, H, T/cp, E)."""
    scale = default_scale(q_BHSE.shape[-1]) if scale is None else scale

    def ring(q, k, v):
        return ring_attention(q, k, v, ring_axis, scale)

    return ulysses_attention(q_BHSE, k_BKSE, v_BKSE, ulysses_axis, scale, attend=ring)
