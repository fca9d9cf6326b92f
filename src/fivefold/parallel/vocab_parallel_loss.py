"""Cross-entropy over vocabulary-sharded logits, never holding the full logits on one rank.

The output head of a tensor-parallel model is split by vocabulary rows (Megatron-LM, arXiv
1909.08053, Sec. 3, "parallelize the output embedding"), so rank r holds the logits of
columns [r*Vs, (r+1)*Vs) of the (possibly padded) vocabulary for every token. The loss of a
token is logsumexp over the whole vocabulary minus the target's logit. Each rank reduces its
own columns to three numbers per token: its maximum m_r, its sum of exp(z - m_r), and the
target's logit if the target falls in its columns (else 0). One all-gather of these (3 x N
floats per rank, purpose "vocab_loss") lets every rank combine them exactly:

  M = max_r m_r,   logsumexp = M + log sum_r s_r exp(m_r - M),   loss = logsumexp - sum_r z_r

Megatron issues three all-reduces (a MAX, then two sums); fivefold's collectives only sum, and
one all-gather of the three statistics replaces all of them with a single call.

Backward needs no communication: d loss / d z = softmax(z) - onehot(target), restricted to
this rank's columns, where softmax = exp(z - logsumexp) is computed in forward and saved
(N x Vs, the same size as the local logits). Columns beyond the true vocabulary (padding that
makes it divisible by tp, see fivefold.parallel.tensor) are left out of the sums and get a
zero gradient, so they are never predicted and their head rows never change.
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.tensor_comm import gather_stacked


def vocab_columns(axis: Axis, shard_columns: int, vocab: int) -> tuple[int, int]:
    """(first vocabulary id, number of real ids) of this rank's `shard_columns` logit columns."""
    start = axis.rank * shard_columns
    return start, max(0, min(shard_columns, vocab - start))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NVs, targets_N, vocab, axis):
        start, valid = vocab_columns(axis, logits_NVs.shape[-1], vocab)
        z_NV = logits_NVs.float()[:, :valid]
        local_N = targets_N - start
        mine_N = (local_N >= 0) & (local_N < valid)
        index_N = torch.where(mine_N, local_N, 0)
        N = z_NV.shape[0]
        if valid:
            max_N = z_NV.max(dim=-1).values
            sum_exp_N = (z_NV - max_N[:, None]).exp().sum(dim=-1)
            target_N = z_NV.gather(1, index_N[:, None]).squeeze(1) * mine_N
        else:  # every column of this rank is padding
            max_N = torch.full((N,), float("-inf"), device=z_NV.device)
            sum_exp_N = target_N = torch.zeros(N, device=z_NV.device)
        stats_3N = torch.stack((max_N, sum_exp_N, target_N))
        all_n3N = gather_stacked(stats_3N, axis, "vocab_loss")
        global_max_N = all_n3N[:, 0].max(dim=0).values
        total_N = (all_n3N[:, 1] * (all_n3N[:, 0] - global_max_N).exp()).sum(dim=0)
        logsumexp_N = global_max_N + total_N.log()
        softmax_NV = (z_NV - logsumexp_N[:, None]).exp()
        ctx.save_for_backward(softmax_NV, index_N, mine_N)
        ctx.shard_columns, ctx.logits_dtype = logits_NVs.shape[-1], logits_NVs.dtype
        return logsumexp_N - all_n3N[:, 2].sum(dim=0)

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NV, index_N, mine_N = ctx.saved_tensors
        grad_NVs = torch.zeros((softmax_NV.shape[0], ctx.shard_columns), dtype=torch.float32,
                               device=softmax_NV.device)
        valid = softmax_NV.shape[1]
        grad_NVs[:, :valid] = softmax_NV
        if valid:
            rows = torch.arange(grad_NVs.shape[0], device=grad_NVs.device)
            grad_NVs[rows, index_N] -= mine_N.float()
        grad_NVs *= grad_N[:, None]
        return grad_NVs.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_NVs: torch.Tensor, targets_N: torch.Tensor, vocab: int,
                                 axis: Axis) -> torch.Tensor:
    """Per-token cross-entropy (N,), in fp32, from this rank's vocabulary shard of the logits.

    `logits_NVs` holds the columns [rank*Vs, (rank+1)*Vs) of the padded vocabulary; ids at or
    beyond `vocab` are padding and are ignored. Every rank of the axis returns the same losses.
    """
    return _VocabParallelCrossEntropy.apply(logits_NVs, targets_N, vocab, axis)
