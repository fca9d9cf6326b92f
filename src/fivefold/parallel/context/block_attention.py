"""Attention of one block of queries against one block of keys, with its log-sum-exp, and the
backward of that block from the final output and log-sum-exp: the kernels of ring attention.

Blockwise attention (Milakov & Gimelshein's online softmax, arXiv 1805.02867; FlashAttention,
arXiv 2205.14135, Sec. 3.1 and Alg. 2 for the backward; Ring Attention, arXiv 2310.01889,
Sec. 3) computes softmax(q k^T) v block by block: each block returns its output and the
log-sum-exp of its scores per query, and `merge_blocks` combines two such partial results
exactly. The backward of a block needs no partial statistics: given the final output `out`
and final log-sum-exp `lse` of the query rows, p = exp(q k^T * scale - lse) are the final
probabilities restricted to the block, and with D = rowsum(dout * out),

    dv = p^T dout    ds = p * (dout v^T - D)    dq = ds k * scale    dk = ds^T q * scale

so the blocks' gradients simply add up.

Grouped-query attention: k and v may have fewer heads than q (a divisor); they are expanded
to q's heads inside a block and the key/value gradients summed back over each group.

Kernel choice: `attention_kernel` is the single place that picks how a block is computed.
Today it is always "math" (explicit matmuls and logsumexp, in fp32 or fp64, on any device).
A GPU path would go there: SDPA's flash and memory-efficient kernels return the log-sum-exp
(torch.ops.aten._scaled_dot_product_flash_attention / _efficient_attention and their
_backward ops take out, dout and lse), which is all these two functions need.

Layout: q (B, H, Tq, E), k and v (B, K, Tk, E), H a multiple of K. `causal` masks a diagonal
block (Tq == Tk, query i sees keys 0..i of the block); off-diagonal blocks are fully visible.

Memory: the math path runs the query rows in chunks (rows are independent in both passes;
the key/value gradients add up over the chunks), so a block holds at most a chunk's rows x Tk
scores per head instead of Tq x Tk, the difference between a long sequence training and a
rank killed for memory. A chunk is at most `QUERY_CHUNK` rows, and on the CPU also at most
`CPU_SCORE_BYTES` of scores for all heads (`query_chunk_rows`): glibc's malloc serves a
request at or above its mmap threshold (dynamic, at most 32 MiB on 64-bit: mallopt(3),
M_MMAP_THRESHOLD) with a fresh mapping whose every page faults and is zeroed on first touch,
and its heap gives memory back above the trim threshold; each of a chunk's half-dozen score
temporaries paid that. Measured on the 2-core development machine (one thread, 4 x 8 heads,
a 512 x 512 diagonal block, forward and backward): 512-row chunks (32 MiB of scores)
310-410 ms and 117k page faults a pass, 128 rows (8 MiB) 185-205 ms and 42k.
"""

from __future__ import annotations

import math

import torch

QUERY_CHUNK = 512  # query rows whose scores the math path holds at once, at most
CPU_SCORE_BYTES = 8 << 20  # on the CPU also at most this many bytes of a chunk's scores


def attention_kernel(device: torch.device) -> str:
    """How blocks are computed on `device`: only "math" exists yet (see module docstring)."""
    return "math"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, else the input dtype: the dtype of outputs, lse and grads."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _expand_kv(x_BKTE: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x_BKTE.shape[1]
    return x_BKTE.repeat_interleave(groups, dim=1) if groups > 1 else x_BKTE


def _reduce_kv(dx_BHTE: torch.Tensor, kv_heads: int) -> torch.Tensor:
    B, H, T, E = dx_BHTE.shape
    if H == kv_heads:
        return dx_BHTE
    return dx_BHTE.view(B, kv_heads, H // kv_heads, T, E).sum(2)


def _scores(q_BHTE, k_BHSE, causal: bool, scale: float, acc: torch.dtype,
            first_row: int = 0) -> torch.Tensor:
    """Scaled scores of query rows [first_row, first_row + T) of the block against its keys
    (k already expanded to q's heads), with the causal mask of a diagonal block."""
    s_BHTS = (q_BHTE.to(acc) @ k_BHSE.to(acc).transpose(-2, -1)) * scale
    if causal:
        T, S = s_BHTS.shape[-2:]
        rows = torch.arange(first_row, first_row + T, device=s_BHTS.device).unsqueeze(1)
        mask = torch.arange(S, device=s_BHTS.device).unsqueeze(0) > rows
        s_BHTS = s_BHTS.masked_fill(mask, float("-inf"))
    return s_BHTS


def query_chunk_rows(device_type: str, batch_heads: int, keys: int, elem_bytes: int) -> int:
    """Query rows per chunk of a block with `keys` keys over batch x heads = `batch_heads`,
    scores of `elem_bytes` each (see the module docstring)."""
    if device_type != "cpu":
        return QUERY_CHUNK
    return max(1, min(QUERY_CHUNK, CPU_SCORE_BYTES // (batch_heads * keys * elem_bytes)))


def _row_chunks(q_BHTE: torch.Tensor, keys: int, acc: torch.dtype) -> list[slice]:
    B, H, T = q_BHTE.shape[:3]
    rows = query_chunk_rows(q_BHTE.device.type, B * H, keys, acc.itemsize)
    return [slice(i, min(i + rows, T)) for i in range(0, T, rows)]


def visible_keys(rows: slice, keys: int, causal: bool) -> slice:
    """The keys a chunk of query rows attends to: on a diagonal block only those up to its
    last row (the rest are masked for every row of the chunk, and never computed), else all."""
    return slice(0, rows.stop if causal else keys)


def block_attention_forward(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                            causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, T, E), lse (B, H, T)) of this block, both in the accumulation dtype."""
    assert attention_kernel(q_BHTE.device) == "math"
    acc = accumulation_dtype(q_BHTE.dtype)
    B, H, T, E = q_BHTE.shape
    if causal:
        assert k_BKSE.shape[2] == T, "a causal block is a diagonal block"
    k_BHSE, v_BHSE = _expand_kv(k_BKSE, H).to(acc), _expand_kv(v_BKSE, H).to(acc)
    out_BHTE = torch.empty(B, H, T, v_BKSE.shape[-1], dtype=acc, device=q_BHTE.device)
    lse_BHT = torch.empty(B, H, T, dtype=acc, device=q_BHTE.device)
    # the forward runs inside the engine's autocast, which would cast the matmuls back to
    # the 16-bit compute dtype; the block's arithmetic is in `acc`, as in its backward
    with torch.autocast(q_BHTE.device.type, enabled=False):
        for rows in _row_chunks(q_BHTE, k_BHSE.shape[2], acc):
            seen = visible_keys(rows, k_BHSE.shape[2], causal)
            s_BHtS = _scores(q_BHTE[:, :, rows], k_BHSE[:, :, seen], causal, scale, acc,
                             rows.start)
            lse_BHt = torch.logsumexp(s_BHtS, dim=-1)
            out_BHTE[:, :, rows] = (torch.exp(s_BHtS - lse_BHt.unsqueeze(-1))
                                    @ v_BHSE[:, :, seen])
            lse_BHT[:, :, rows] = lse_BHt
    return out_BHTE, lse_BHT


def block_attention_backward(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                             out_BHTE: torch.Tensor, dout_BHTE: torch.Tensor,
                             lse_BHT: torch.Tensor, causal: bool, scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (B, H, T, E), dk, dv (B, K, S, E)) of this block, in the accumulation dtype;
    `out` and `lse` are the final (merged over all blocks) output and log-sum-exp."""
    assert attention_kernel(q_BHTE.device) == "math"
    acc = accumulation_dtype(q_BHTE.dtype)
    H, K = q_BHTE.shape[1], k_BKSE.shape[1]
    k_BHSE, v_BHSE = _expand_kv(k_BKSE, H).to(acc), _expand_kv(v_BKSE, H).to(acc)
    dq_BHTE = torch.empty(q_BHTE.shape, dtype=acc, device=q_BHTE.device)
    dk_BHSE, dv_BHSE = torch.zeros_like(k_BHSE), torch.zeros_like(v_BHSE)
    for rows in _row_chunks(q_BHTE, k_BHSE.shape[2], acc):
        seen = visible_keys(rows, k_BHSE.shape[2], causal)
        k, v = k_BHSE[:, :, seen], v_BHSE[:, :, seen]
        q, dout = q_BHTE[:, :, rows].to(acc), dout_BHTE[:, :, rows].to(acc)
        s_BHtS = _scores(q, k, causal, scale, acc, rows.start)
        p_BHtS = torch.exp(s_BHtS - lse_BHT[:, :, rows].to(acc).unsqueeze(-1))
        d_BHt1 = (dout * out_BHTE[:, :, rows].to(acc)).sum(-1, keepdim=True)
        dv_BHSE[:, :, seen].add_(p_BHtS.transpose(-2, -1) @ dout)  # in place: no setitem
        ds_BHtS = p_BHtS * (dout @ v.transpose(-2, -1) - d_BHt1)
        dq_BHTE[:, :, rows] = (ds_BHtS @ k) * scale
        dk_BHSE[:, :, seen].add_((ds_BHtS.transpose(-2, -1) @ q) * scale)
    return dq_BHTE, _reduce_kv(dk_BHSE, K), _reduce_kv(dv_BHSE, K)


def merge_blocks(out_BHTE: torch.Tensor, lse_BHT: torch.Tensor, block_out_BHTE: torch.Tensor,
                 block_lse_BHT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact combination of two partial attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_BHT, block_lse_BHT)
    out = (out_BHTE * torch.exp(lse_BHT - lse).unsqueeze(-1)
           + block_out_BHTE * torch.exp(block_lse_BHT - lse).unsqueeze(-1))
    return out, lse
