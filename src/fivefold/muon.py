"""Muon's orthogonalization, and Muon over stacked expert matrices.

Muon (Jordan et al. 2024; at scale Liu et al., "Muon is Scalable for LLM Training", arXiv
2502.16982, Sec. 2) replaces a weight matrix's update by its Nesterov momentum made
orthogonal: five quintic Newton-Schulz iterations X <- aX + (bXX^T + c(XX^T)^2)X on the
momentum scaled to unit Frobenius norm, in bf16, on the orientation with fewer rows. The
update is then scaled to AdamW's update RMS, 0.2 sqrt(max(A, B)) for an A x B matrix (Sec.
2.2), so that Muon takes AdamW's learning rate and weight decay.

`orthogonalize` runs that iteration on one matrix or on a batch of them (..., A, B), each
matrix on its own: torch.optim.Muon's arithmetic (the same coefficients, bf16, fused
multiply-adds), so the sharded step (fivefold.parallel.muon_sharded) reproduces the one-rank
optimizer. `StackedMuon` is Muon for a mixture-of-experts layer's stacked expert weights
(E, A, B), which torch.optim.Muon refuses (it takes 2-D parameters only): every expert's
A x B matrix is orthogonalized as the 2-D matrix it is, in one batched iteration.
"""

from __future__ import annotations

import math

import torch

from fivefold.muon_flops import NS_STEPS

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (a, b, c)
NS_EPS = 1e-7


def orthogonalize(update: torch.Tensor) -> torch.Tensor:
    """The Newton-Schulz orthogonalization (module docstring) of each matrix of `update`
    (A, B) or (E, A, B), returned in bf16."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    fused = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def rms_matched_lr(lr: float, rows: int, cols: int) -> float:
    """Muon's learning rate for a rows x cols matrix, matched to AdamW's update RMS."""
    return lr * 0.2 * math.sqrt(max(rows, cols))


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float) -> torch.Tensor:
    """Advance the momentum `buf` in place by `grad`; return the Nesterov update to
    orthogonalize (torch.optim.Muon's element-wise form, so a shard of it is exact)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum)


class StackedMuon(torch.optim.Optimizer):
    """Muon on (E, A, B) stacked expert weights, each expert's A x B matrix orthogonalized
    on its own (module docstring); decoupled weight decay and the RMS-matched learning rate
    as torch.optim.Muon with adjust_lr_fn="match_rms_adamw"."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 3:
                    raise ValueError(f"StackedMuon takes (E, A, B) tensors, not {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                update = momentum_update(state["momentum_buffer"], p.grad, group["momentum"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(orthogonalize(update),
                       alpha=-rms_matched_lr(group["lr"], p.shape[1], p.shape[2]))
