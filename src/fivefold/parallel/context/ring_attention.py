"""Ring attention over a context-parallel axis, causal and load-balanced (zigzag), with a
hand-written ring backward.

Ring self-attention (Li et al., arXiv 2105.13120, Sec. 3.1) and Ring Attention (Liu et al.,
arXiv 2310.01889, Sec. 3, Alg. 1): each of the n ranks of the ring holds a shard of the
sequence's queries, keys and values; the key/value blocks travel around the ring (rank r
sends to r+1 and receives from r-1), and at step s rank r attends its queries to the block of
rank (r - s) mod n. Blocks are merged by the log-sum-exp online softmax
(fivefold.parallel.context.block_attention), so the result is exact. The next block's
transfer is issued (batch_isend_irecv) before the current block is computed, and waited for
after it: communication overlaps compute.

Causal balance (Striped Attention, arXiv 2311.09431; the zigzag form, see .zigzag): rank r
holds chunks r and 2n-1-r of 2n. Against the block of rank src the visible part is decided per
pair of chunks, and only that part is computed:

    src == r  diagonal: causal attention over the rank's own 2 chunks (positions increase)
    src <  r  both local query chunks see the block's first chunk fully, its second not at all
    src >  r  only the local second query chunk sees anything: both block chunks, fully

so every step after the first is a (T/2n) x (T/n) block on every rank: no rank idles.

Backward (Ring Attention Sec. 3; the ring backward of ring-flash-attn): an autograd.Function,
so autograd never runs through the forward's communication. It saves q, k, v, the output and
the log-sum-exp; the key/value blocks travel the ring again, and with each block travels the
accumulator of its dk/dv: at step s rank r adds its queries' contribution to block (r-s)'s
gradient and passes it on with the block; after the n-th hop every accumulator is back on
its owner. dq stays local.

The ledger (op, purpose, bytes per call on this rank; s the element size of k's dtype, s_acc
that of its accumulation dtype: fp32 for 16-bit inputs, else the same):
    forward   n-1 x ("send", "cp_kv") and n-1 x ("recv", "cp_kv"), 2·B·K·T_local·E·s each
    backward  the same n-1 pairs for the blocks, and n x ("send"/"recv", "cp_dkv"),
              2·B·K·T_local·E·s_acc each
(k and v travel as one stacked buffer, un-expanded: K key/value heads, not H.)
"""

from __future__ import annotations

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.parallel.context.block_attention import (accumulation_dtype,
                                                       block_attention_backward,
                                                       block_attention_forward, default_scale,
                                                       merge_blocks)

TAG_KV, TAG_DKV = 0, 1


def _pass_on(buffer: torch.Tensor, axis: Axis, purpose: str, tag: int):
    """Send `buffer` to the next rank of the ring and receive the previous rank's: (handles,
    the receive buffer)."""
    incoming = torch.empty_like(buffer)
    handles = C.batch_send_recv([(True, buffer, (axis.rank + 1) % axis.size, purpose, tag),
                                 (False, incoming, (axis.rank - 1) % axis.size, purpose, tag)],
                                axis)
    return handles, incoming


def _wait_all(handles) -> None:
    for handle in handles:
        C.wait(handle)


def _visible(src: int, rank: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, block key rows, causal) that the local queries see of block `src`."""
    full = slice(None)
    if src == rank:
        return full, full, True
    if src < rank:
        return full, slice(0, c), False
    return slice(c, None), full, False


def ring_attention_forward(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                           axis: Axis, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the local zigzag queries over the whole ring, in the accumulation dtype."""
    n, r, c = axis.size, axis.rank, q_BHTE.shape[2] // 2
    kv = torch.stack((k_BKTE, v_BKTE))
    out = lse = None
    for step in range(n):
        if step + 1 < n:  # the next block is on its way while this one is computed
            handles, incoming = _pass_on(kv, axis, "cp_kv", TAG_KV)
        rows, keys, causal = _visible((r - step) % n, r, c)
        block_out, block_lse = block_attention_forward(
            q_BHTE[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal, scale)
        if out is None:  # the diagonal block comes first and covers every query row
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge_blocks(out[:, :, rows], lse[:, :, rows],
                                                            block_out, block_lse)
        if step + 1 < n:
            _wait_all(handles)
            kv = incoming
    return out, lse


def ring_attention_backward(q_BHTE, k_BKTE, v_BKTE, out_BHTE, dout_BHTE, lse_BHT,
                            axis: Axis, scale: float):
    """(dq, dk, dv) in the accumulation dtype, by the ring described in the module docstring."""
    n, r, c = axis.size, axis.rank, q_BHTE.shape[2] // 2
    acc = accumulation_dtype(q_BHTE.dtype)
    dq = torch.zeros(q_BHTE.shape, dtype=acc, device=q_BHTE.device)
    kv = torch.stack((k_BKTE, v_BKTE))
    dkv_handles, dkv_incoming = [], None
    for step in range(n):
        if step + 1 < n:
            kv_handles, kv_incoming = _pass_on(kv, axis, "cp_kv", TAG_KV)
        rows, keys, causal = _visible((r - step) % n, r, c)
        dq_part, dk_part, dv_part = block_attention_backward(
            q_BHTE[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out_BHTE[:, :, rows],
            dout_BHTE[:, :, rows], lse_BHT[:, :, rows], causal, scale)
        dq[:, :, rows] += dq_part
        if step == 0:
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        else:  # the block's gradient so far, from the ranks it visited before this one
            _wait_all(dkv_handles)
            dkv = dkv_incoming
        dkv[0][:, :, keys] += dk_part
        dkv[1][:, :, keys] += dv_part
        if n == 1:  # a ring of one: the block never left
            return dq, dkv[0], dkv[1]
        dkv_handles, dkv_incoming = _pass_on(dkv, axis, "cp_dkv", TAG_DKV)
        if step + 1 < n:
            _wait_all(kv_handles)
            kv = kv_incoming
    _wait_all(dkv_handles)  # the n-th hop brought this rank's own block's gradient home
    return dq, dkv_incoming[0], dkv_incoming[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis, scale):
        out, lse = ring_attention_forward(q, k, v, axis, scale)
        out = out.to(q.dtype)
        ctx.axis, ctx.scale = axis, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, dout, lse, ctx.axis, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                   axis: Axis, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard (q: B, H, T/n, E; k, v: B, K, T/n, E with
    K dividing H) against the whole sequence held by the ring `axis`; returns (B, H, T/n, E)."""
    if q_BHTE.shape[2] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks; {q_BHTE.shape[2]} local "
                         f"tokens do not split in two")
    if q_BHTE.shape[1] % k_BKTE.shape[1]:
        raise ValueError(f"{q_BHTE.shape[1]} query heads do not split into groups over "
                         f"{k_BKTE.shape[1]} key/value heads")
    scale = default_scale(q_BHTE.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q_BHTE, k_BKTE.contiguous(), v_BKTE.contiguous(), axis, scale)
