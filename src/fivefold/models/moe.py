"""A mixture-of-experts MLP in plain PyTorch: a top-k router over SwiGLU experts.

Routing. Router logits z = x W_r (fp32, ST-MoE's selective precision, arXiv 2202.08906
Sec. 3.2) become scores, softmax (Mixtral, arXiv 2401.04088, Sec. 2.1) or sigmoid
(DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.2); each token takes its `top_k` experts and their
scores, renormalized over the k, weight the experts' outputs. With `bias_update_rate` the
choice ranks score + bias_e, a per-expert bias the trainer moves after every step towards
even load (DeepSeek-V3's auxiliary-loss-free balancing); the gates stay the plain scores.
`shared_experts` adds one always-active SwiGLU of width shared_experts x F (DeepSeek-V3).

Two regimes. Dropless (capacity_factor absent): every assignment reaches its expert. With a
capacity factor c, each expert takes at most C = ceil(c N k / X) of the N tokens' k
assignments of one forward call (one micro-batch: GShard's group, arXiv 2006.16668,
Sec. 2.2), first choices before second ones and, within a choice, tokens in order; dropped
assignments contribute nothing (the residual carries the token). Because the group is the
micro-batch a rank routes, a data- or expert-parallel run drops exactly what one process
running the same micro-batches drops. Under sequence or context parallelism a forward call
sees the rank's share of the micro-batch's tokens, and that share is the group (GShard's
local groups): C counts the rank's N, so drops can differ from one process's; dropless
routing is the same. `capacity_factor` is an attribute, adjustable between steps.

Auxiliary losses, summed over tokens so that micro-batches add up like the token loss: the
load-balancing loss (Switch, arXiv 2101.03961, Sec. 2.2) N * X * sum_e f_e P_e, with f_e
the share of the micro-batch's assignments routed to e and P_e its mean normalized score,
weighted by `aux_loss_weight`, and the router z-loss sum_n logsumexp(z_n)^2 (ST-MoE
Sec. 3.1) weighted by `z_loss_weight`. The balancing loss is computed as
X * sum_e f_e sum_n p_ne, a sum over the tokens this call sees with f_e from
`balance_counts(assignments per expert)`, a seam: the identity here; where parallelism
splits a micro-batch's tokens over ranks (sequence or context parallelism,
fivefold.parallel.moe_tokens) it sums the counts over those ranks, so each rank's term
is its tokens' share of the one-process loss and the terms add up to it. The losses do not
change the block's output: their gradient is attached to it (`AttachAuxLoss`, the same
device as Megatron-Core's MoEAuxLossAutoScaler) with the coefficient `aux_grad_scale`, which
the trainer sets to the token loss's 1 / (tokens of the global batch); so a pipeline stage
backpropagates its own layers' terms.

The experts (stacked per matrix, (X, out, in): expert parallelism splits dim 0) run on the
tokens sorted by expert through `expert_compute(x_sorted, counts)`, a seam: by default
fivefold.models.expert_matmul on this module's experts; expert parallelism
(fivefold.parallel.expert) installs its all-to-all dispatcher there. `expert_mm`, a second
seam, is the grouped product itself (None: expert_matmul's own; fp8 training installs its
fp8 GEMMs there, fivefold.parallel.fp8.experts). Per-step load statistics
accumulate in `load` (assignments per expert, before dropping), `dropped` and `aux_sum`;
the trainer reads and resets them. This module knows nothing about ranks.

Tensor names: N tokens, D model width, F expert width, X experts, K experts per token,
A assignments (N K).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.description import expert_ffn
from fivefold.models.expert_matmul import expert_swiglu
from fivefold.models.mlp import SwiGLU


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; backward also gives `aux` the gradient `scale` (d loss / d aux)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def capacity_keep(experts_NK: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Bool (N, K): the assignments kept when each expert takes at most `capacity`, first
    choices before second ones, tokens in order within a choice."""
    order_A = experts_NK.t().reshape(-1)  # choice-major priority
    one_hot_AX = F.one_hot(order_A, experts)
    position_A = (one_hot_AX.cumsum(0) * one_hot_AX).sum(-1) - 1
    return (position_A < capacity).view(experts_NK.shape[1], -1).t()


class MoE(nn.Module):
    """shared(x) + sum over the token's kept top-k experts e of gate_e * expert_e(x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        experts, ffn = moe.experts, expert_ffn(cfg)
        self.experts, self.top_k, self.score = experts, moe.top_k, moe.score
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_weight, self.z_loss_weight = moe.aux_loss_weight, moe.z_loss_weight
        self.matmul = moe.expert_matmul
        self.w1 = nn.Parameter(torch.empty(experts, ffn, cfg.hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, cfg.hidden))
        self.w2 = nn.Parameter(torch.empty(experts, cfg.hidden, ffn))
        self.router = nn.Linear(cfg.hidden, experts, bias=False)
        self.shared = SwiGLU(cfg.hidden, moe.shared_experts * ffn) if moe.shared_experts else None
        self.balance_bias = moe.bias_update_rate > 0
        self.register_buffer("expert_bias", torch.zeros(experts), persistent=self.balance_bias)
        self.expert_compute = self.local_experts  # a seam (module docstring)
        self.expert_mm = None  # a seam (module docstring)
        self.balance_counts = lambda counts_X: counts_X  # a seam (module docstring)
        self.aux_grad_scale = 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.load = torch.zeros(self.experts, dtype=torch.int64)
        self.dropped = 0
        self.aux_sum = 0.0

    def local_experts(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return expert_swiglu(x_MD, counts, self.w1, self.w3, self.w2, self.matmul,
                             self.expert_mm)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, X) fp32, gates (N, K) fp32, expert ids (N, K))."""
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NX = F.linear(x_ND.float(), self.router.weight.float())
        scores_NX = (F.softmax(logits_NX, dim=-1) if self.score == "softmax"
                     else torch.sigmoid(logits_NX))
        choice_NX = scores_NX + self.expert_bias.float() if self.balance_bias else scores_NX
        experts_NK = torch.topk(choice_NX, self.top_k, dim=-1).indices
        gates_NK = scores_NX.gather(1, experts_NK)
        return logits_NX, gates_NK / gates_NK.sum(dim=-1, keepdim=True), experts_NK

    def aux_loss(self, logits_NX: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """The weighted load-balancing loss plus router z-loss, summed over the N tokens (the
        balancing loss's shares f_e over the seam's token group, module docstring)."""
        aux = logits_NX.new_zeros(())
        if self.aux_loss_weight:
            scores_NX = (F.softmax(logits_NX, dim=-1) if self.score == "softmax"
                         else torch.sigmoid(logits_NX))
            probs_X = (scores_NX / scores_NX.sum(-1, keepdim=True)).sum(0)
            counts_X = self.balance_counts(torch.bincount(experts_NK.flatten(),
                                                          minlength=self.experts))
            share_X = counts_X / counts_X.sum()
            aux = aux + self.aux_loss_weight * self.experts * (share_X * probs_X).sum()
        if self.z_loss_weight:
            aux = aux + self.z_loss_weight * torch.logsumexp(logits_NX, dim=-1).square().sum()
        return aux

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        N = x_ND.shape[0]
        logits_NX, gates_NK, experts_NK = self.route(x_ND)
        keep_NK = torch.ones_like(experts_NK, dtype=torch.bool)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * N * self.top_k / self.experts)
            keep_NK = capacity_keep(experts_NK, self.experts, capacity)
        kept_A = keep_NK.flatten().nonzero().squeeze(1)  # token-major assignment ids
        expert_A = experts_NK.flatten()[kept_A]
        order = torch.argsort(expert_A, stable=True)
        assignment_M = kept_A[order]
        token_M = assignment_M // self.top_k
        counts = torch.bincount(expert_A, minlength=self.experts)
        y_MD = self.expert_compute(x_ND[token_M], counts.tolist())
        gate_M = gates_NK.flatten()[assignment_M]
        out_ND = torch.zeros_like(x_ND).index_add_(0, token_M,
                                                   (y_MD * gate_M[:, None]).to(x_ND.dtype))
        if self.shared is not None:
            out_ND = out_ND + self.shared(x_ND)
        if self.training:
            self.count(experts_NK, kept_A.numel())
        if self.training and torch.is_grad_enabled() and (self.aux_loss_weight
                                                          or self.z_loss_weight):
            aux = self.aux_loss(logits_NX, experts_NK)
            self.aux_sum += aux.item()
            out_ND = AttachAuxLoss.apply(out_ND, aux, self.aux_grad_scale)
        return out_ND.view_as(x_BTD)

    @torch.no_grad()
    def count(self, experts_NK: torch.Tensor, kept: int) -> None:
        """Add a training micro-batch's assignments to the step's load statistics."""
        self.load = self.load.to(experts_NK.device) + torch.bincount(experts_NK.flatten(),
                                                                     minlength=self.experts)
        self.dropped += experts_NK.numel() - kept
