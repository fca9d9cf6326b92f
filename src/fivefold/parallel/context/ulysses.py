"""DeepSpeed-Ulysses: sequence shards to head shards by all-to-all, attention, and back.

Jacobs et al., arXiv 2309.14509, Sec. 3.1 and Fig. 2: each of the u ranks of the axis holds a
contiguous 1/u of the sequence for all heads, (B, H, T/u, E). An all-to-all over the heads
turns that into all of the sequence for 1/u of the heads, (B, H/u, T, E); every rank runs
ordinary (causal) attention on its heads, and the inverse all-to-all brings the output back
to sequence shards. Each all-to-all is an autograd.Function whose backward is the inverse
all-to-all on the gradient, through the recorded collective (fivefold.comm.collectives).

Layout: contiguous shards (rank i holds tokens [i T/u, (i+1) T/u)), so the all-to-all
concatenates the shards in true order and causal attention needs no permutation. Ulysses
needs no causal balancing: after the all-to-all every rank attends over the whole sequence.
In the hybrid (fivefold.parallel.context.hybrid) the shards are contiguous pieces of a ring
rank's zigzag part, and the all-to-all rebuilds that part (see .layout).

Grouped-query attention (`heads.ulysses_kv_heads`): the key/value heads are split over the axis
like the query heads when u divides them; when there are fewer than u and they divide u,
each is replicated u/K times (the replicas' gradients are summed back by the replication's
own backward) so every rank gets the one key/value head its query heads share; otherwise the
combination is refused. Query heads must divide by u.

The ledger, per call on this rank (s the element size; K' = ulysses_kv_heads(K, u)):
    forward   ("all_to_all", "cp_q") B·H·(T/u)·E·s, ("all_to_all", "cp_k") and ("...", "cp_v")
              B·K'·(T/u)·E·s each, ("all_to_all", "cp_out") B·H·(T/u)·E·s
    backward  the same four sizes, purposes "cp_out_grad", "cp_q_grad", "cp_k_grad",
              "cp_v_grad"
(bytes: this rank's send buffer; wire bytes (u-1)/u of it.)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.parallel.context.block_attention import default_scale
from fivefold.parallel.context.heads import check_ulysses_heads


def _seq_to_heads(x_BHSE: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """(B, H, T/u, E) on each rank -> (B, H/u, T, E): head group j goes to rank j."""
    B, H, S, E = x_BHSE.shape
    u = axis.size
    send = x_BHSE.reshape(B, u, H // u, S, E).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # recv[j]: rank j's tokens of this rank's heads
    C.all_to_all(recv, send, axis, purpose)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // u, u * S, E)


def _heads_to_seq(x_BhTE: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """(B, H/u, T, E) on each rank -> (B, H, T/u, E): token shard j goes to rank j."""
    B, h, T, E = x_BhTE.shape
    u = axis.size
    send = x_BhTE.reshape(B, h, u, T // u, E).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # recv[j]: rank j's heads of this rank's tokens
    C.all_to_all(recv, send, axis, purpose)
    return recv.transpose(0, 1).reshape(B, u * h, T // u, E)


class _AllToAll(torch.autograd.Function):
    """Forward one direction of the exchange, backward the other (on the gradient)."""

    @staticmethod
    def forward(ctx, x, axis, to_heads, purpose):
        ctx.axis, ctx.to_heads, ctx.purpose = axis, to_heads, purpose
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, axis, purpose)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad, ctx.axis, ctx.purpose + "_grad"), None, None, None


def seq_to_heads(x_BHSE: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """Differentiable (B, H, T/u, E) sequence shard -> (B, H/u, T, E) head shard."""
    return _AllToAll.apply(x_BHSE, axis, True, purpose)


def heads_to_seq(x_BhTE: torch.Tensor, axis: Axis, purpose: str) -> torch.Tensor:
    """Differentiable (B, H/u, T, E) head shard -> (B, H, T/u, E) sequence shard."""
    return _AllToAll.apply(x_BhTE, axis, False, purpose)


def local_causal_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Causal SDPA over a whole sequence, grouped-query as fivefold.models.llama does it."""
    groups = q_BHTE.shape[1] // k_BKTE.shape[1]
    gqa_in_kernel = groups > 1 and q_BHTE.is_cuda
    if groups > 1 and not gqa_in_kernel:
        k_BKTE = k_BKTE.repeat_interleave(groups, dim=1)
        v_BKTE = v_BKTE.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, is_causal=True, scale=scale,
                                          enable_gqa=gqa_in_kernel)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ulysses_attention(q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                      axis: Axis, scale: float | None = None,
                      attend: Attend | None = None) -> torch.Tensor:
    """Causal attention of this rank's contiguous sequence shard (q: B, H, T/u, E; k, v:
    B, K, T/u, E) over the axis; returns (B, H, T/u, E). `attend(q, k, v)` runs on the head
    shards (default: local causal SDPA; the hybrid passes ring attention)."""
    u = axis.size
    heads, kv_heads = q_BHSE.shape[1], k_BKSE.shape[1]
    moved_kv = check_ulysses_heads(heads, kv_heads, u)
    if moved_kv != kv_heads:
        k_BKSE = k_BKSE.repeat_interleave(moved_kv // kv_heads, dim=1)
        v_BKSE = v_BKSE.repeat_interleave(moved_kv // kv_heads, dim=1)
    scale = default_scale(q_BHSE.shape[-1]) if scale is None else scale
    if attend is None:
        def attend(q, k, v):
            return local_causal_attention(q, k, v, scale)
    out_BhTE = attend(seq_to_heads(q_BHSE, axis, "cp_q"), seq_to_heads(k_BKSE, axis, "cp_k"),
                      seq_to_heads(v_BKSE, axis, "cp_v"))
    return heads_to_seq(out_BhTE, axis, "cp_out")
