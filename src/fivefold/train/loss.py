"""Summed token cross-entropy of the output head, a chunk of tokens at a time.

The plain loss multiplies every hidden state by the head at once and keeps the logits, and an
fp32 copy of them for the softmax, alive until backward: for the 1B preset (vocabulary
128256) at 8 x 2048 tokens that is 4 GiB of bf16 logits plus 8 GiB in fp32. Here the head's
matrix multiply, the softmax and the gradient are done `chunk` tokens at a time inside one
autograd function whose forward also computes the gradients of the hidden states and of the
head weight; this is possible because the loss is the last operation of the step, so the
upstream gradient is one scalar that backward only multiplies in. At most one chunk of
logits exists at any moment, and nothing the size of the logits is kept for backward. This
is the fused linear cross-entropy of Liger-Kernel (arXiv 2410.10989), written with plain
torch operations; with `compile` the per-chunk softmax and gradient become one fused kernel
(torch.compile), the matrix multiplies stay cuBLAS.

Numerics match the unchunked loss under autocast: the head's matrix multiplies run in the
compute dtype, the softmax and the loss in fp32, the gradient of the logits is rounded to the
compute dtype before it meets the weight and the hidden states, and the weight's gradient is
accumulated in the weight's dtype (fp32). Only summation order differs, so results agree to
float rounding, not bit for bit (tests/test_loss.py states the tolerances).

Tensor names: N tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

LOGITS_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk: at most 1 GiB


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk such that one chunk's fp32 logits take at most LOGITS_CHUNK_BYTES."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def chunk_loss_and_grad(logits_NV: torch.Tensor,
                        targets_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of a chunk (fp32) and d loss / d logits (in the logits' dtype)."""
    z_NV = logits_NV.float()
    lse_N = torch.logsumexp(z_NV, dim=-1)
    loss = (lse_N - z_NV.gather(1, targets_N[:, None]).squeeze(1)).sum()
    grad_NV = torch.exp(z_NV - lse_N[:, None])
    grad_NV = grad_NV.scatter_add(1, targets_N[:, None],
                                  torch.full_like(grad_NV[:, :1], -1.0))
    return loss, grad_NV.to(logits_NV.dtype)


@functools.cache
def _compiled_kernel():
    return torch.compile(chunk_loss_and_grad, dynamic=False)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_n CE(hidden_n @ weight^T, target_n); gradients computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                chunk: int, dtype: torch.dtype, compile: bool) -> torch.Tensor:
        kernel = _compiled_kernel() if compile else chunk_loss_and_grad
        with torch.autocast(hidden_ND.device.type, enabled=False):
            w_VD = weight_VD.to(dtype)
            grad_hidden_ND = torch.empty_like(hidden_ND)
            grad_weight_VD = torch.zeros_like(weight_VD)
            loss = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
            for start in range(0, hidden_ND.shape[0], chunk):
                rows = slice(start, start + chunk)
                h_nD = hidden_ND[rows].to(dtype)
                chunk_loss, grad_nV = kernel(h_nD @ w_VD.T, targets_N[rows])
                loss += chunk_loss
                grad_hidden_ND[rows] = grad_nV @ w_VD
                grad_weight_VD += grad_nV.T @ h_nD
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        return (grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype),
                grad_weight_VD * grad_loss.to(grad_weight_VD.dtype), None, None, None, None)


def linear_cross_entropy_sum(hidden_BTD: torch.Tensor, weight_VD: torch.Tensor,
                             targets_BT: torch.Tensor, chunk: int, dtype: torch.dtype,
                             compile: bool = False) -> torch.Tensor:
    """Summed token cross-entropy (fp32 scalar) of `hidden @ weight^T` against `targets`.

    `dtype` is the compute dtype of the head's matrix multiplies (the autocast dtype, or the
    weight's). Without gradients (evaluation) only the loss is computed, chunk by chunk.
    """
    hidden_ND, targets_N = hidden_BTD.flatten(0, -2), targets_BT.flatten()
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return LinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, chunk, dtype, compile)
    loss = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    with torch.autocast(hidden_ND.device.type, enabled=False):
        w_VD = weight_VD.to(dtype)
        for start in range(0, hidden_ND.shape[0], chunk):
            logits_nV = hidden_ND[start:start + chunk].to(dtype) @ w_VD.T
            loss += F.cross_entropy(logits_nV.float(), targets_N[start:start + chunk],
                                    reduction="sum")
    return loss
