"""Context parallelism: every sequence split over the cp ranks, attention computed across them.

Three modes, one file each: Ulysses (all-to-all to head shards, .ulysses), ring attention
(key/value blocks around a ring, zigzag-balanced, hand-written ring backward, .ring_attention)
and their 2D hybrid (.hybrid). `context_attention` is the one entry the model's attention seam
calls; `context_layout` / `context_positions` (.layout) say which tokens each rank holds.

Not yet used by the trainer: these are standalone, tested functions (docs/context_parallel.md).
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.context.hybrid import hybrid_attention
from fivefold.parallel.context.layout import (MODES, context_layout, context_positions,
                                              mode_degrees, shard_sequence, unshard_sequence)
from fivefold.parallel.context.ring_attention import ring_attention
from fivefold.parallel.context.ulysses import (check_ulysses_heads, ulysses_attention,
                                               ulysses_kv_heads)

__all__ = ["MODES", "check_ulysses_heads", "context_attention", "context_layout",
           "context_positions", "hybrid_attention", "mode_degrees", "ring_attention",
           "shard_sequence", "ulysses_attention", "ulysses_kv_heads", "unshard_sequence"]


def context_attention(q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                      mode: str, cp_axis: Axis | None = None, *,
                      ulysses_axis: Axis | None = None, ring_axis: Axis | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's shard (laid out as `context_layout(mode)`) over the
    whole sequence: "ring" and "ulysses" run on `cp_axis`, "hybrid" on `ulysses_axis` (inner)
    and `ring_axis` (outer). q (B, H, T/cp, E), k and v (B, K, T/cp, E) -> (B, H, T/cp, E)."""
    context_layout(mode)
    if mode == "hybrid":
        if ulysses_axis is None or ring_axis is None:
            raise ValueError("cp_mode 'hybrid' takes ulysses_axis and ring_axis")
        return hybrid_attention(q_BHSE, k_BKSE, v_BKSE, ulysses_axis, ring_axis, scale)
    if cp_axis is None:
        raise ValueError(f"cp_mode {mode!r} takes cp_axis")
    attend = ring_attention if mode == "ring" else ulysses_attention
    return attend(q_BHSE, k_BKSE, v_BKSE, cp_axis, scale)
