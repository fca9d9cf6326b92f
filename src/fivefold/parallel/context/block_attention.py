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
"""

from __future__ import annotations

import math

import torch


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


def _scores(q_BHTE, k_BKSE, causal: bool, scale: float, acc: torch.dtype) -> torch.Tensor:
    s_BHTS = (q_BHTE.to(acc) @ _expand_kv(k_BKSE, q_BHTE.shape[1]).to(acc).transpose(-2, -1))
    s_BHTS = s_BHTS * scale
    if causal:
        T, S = s_BHTS.shape[-2:]
        assert T == S, "a causal block is a diagonal block"
        mask = torch.ones(T, S, dtype=torch.bool, device=s_BHTS.device).triu(1)
        s_BHTS = s_BHTS.masked_fill(mask, float("-inf"))
    return s_BHTS


def block_attention_forward(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                            causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, T, E), lse (B, H, T)) of this block, both in the accumulation dtype."""
    assert attention_kernel(q_BHTE.device) == "math"
    acc = accumulation_dtype(q_BHTE.dtype)
    s_BHTS = _scores(q_BHTE, k_BKSE, causal, scale, acc)
    lse_BHT = torch.logsumexp(s_BHTS, dim=-1)
    p_BHTS = torch.exp(s_BHTS - lse_BHT.unsqueeze(-1))
    out_BHTE = p_BHTS @ _expand_kv(v_BKSE, q_BHTE.shape[1]).to(acc)
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
    s_BHTS = _scores(q_BHTE, k_BKSE, causal, scale, acc)
    p_BHTS = torch.exp(s_BHTS - lse_BHT.to(acc).unsqueeze(-1))
    dout = dout_BHTE.to(acc)
    d_BHT1 = (dout * out_BHTE.to(acc)).sum(-1, keepdim=True)
    dv_BHSE = p_BHTS.transpose(-2, -1) @ dout
    ds_BHTS = p_BHTS * (dout @ _expand_kv(v_BKSE, H).to(acc).transpose(-2, -1) - d_BHT1)
    dq_BHTE = (ds_BHTS @ _expand_kv(k_BKSE, H).to(acc)) * scale
    dk_BHSE = (ds_BHTS.transpose(-2, -1) @ q_BHTE.to(acc)) * scale
    return dq_BHTE, _reduce_kv(dk_BHSE, K), _reduce_kv(dv_BHSE, K)


def merge_blocks(out_BHTE: torch.Tensor, lse_BHT: torch.Tensor, block_out_BHTE: torch.Tensor,
                 block_lse_BHT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact combination of two partial attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_BHT, block_lse_BHT)
    out = (out_BHTE * torch.exp(lse_BHT - lse).unsqueeze(-1)
           + block_out_BHTE * torch.exp(block_lse_BHT - lse).unsqueeze(-1))
    return out, lse
