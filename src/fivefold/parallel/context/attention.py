"""`context_attention`: the attention core of a context-parallel rank, by mode.

The one function the model's attention seam (`Attention.attend`, fivefold.models.llama)
calls under context parallelism: "ring" (fivefold.parallel.context.ring_attention) and
"ulysses" (.ulysses) on the cp axis, "hybrid" (.hybrid) on a Ulysses and a ring sub-axis.
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.context.hybrid import hybrid_attention
from fivefold.parallel.context.layout import context_layout
from fivefold.parallel.context.ring_attention import ring_attention
from fivefold.parallel.context.ulysses import ulysses_attention


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
