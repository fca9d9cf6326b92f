"""A mixture-of-experts MLP in plain PyTorch: a top-k router over SwiGLU experts.

Each token's router logits pick its `top_k` experts; their softmax probabilities, renormalized
over the chosen k, weight the experts' outputs (Mixtral, arXiv 2401.04088, Sec. 2.1: the
gating is softmax(TopK(x W_g)), which equals the top-k softmax probabilities renormalized).
No capacity limit: every token reaches its experts (dropless). The experts' weights are
stacked per matrix, (experts, out, in), the layout expert parallelism shards along its first
dimension. This module knows nothing about ranks; it runs every expert on the tokens routed
to it, one after another (the reference computation, not a fast one).

Tensor names: N tokens, D model width, F expert width, X experts, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.description import expert_ffn


class MoE(nn.Module):
    """sum over the token's top-k experts e of gate_e * w2_e(silu(w1_e x) * w3_e x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        if moe.shared_experts or moe.capacity_factor is not None:
            raise ValueError("the plain MoE block is dropless with routed experts only; "
                             "set model.moe.shared_experts = 0 and leave capacity_factor unset")
        experts, ffn = moe.experts, expert_ffn(cfg)
        self.top_k = moe.top_k
        self.router = nn.Linear(cfg.hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, ffn, cfg.hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, cfg.hidden))
        self.w2 = nn.Parameter(torch.empty(experts, cfg.hidden, ffn))

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate weights (N, K) in fp32, expert ids (N, K)) of each token."""
        probs_NX = F.softmax(self.router(x_ND).float(), dim=-1)
        gates_NK, experts_NK = torch.topk(probs_NX, self.top_k, dim=-1)
        return gates_NK / gates_NK.sum(dim=-1, keepdim=True), experts_NK

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        gates_NK, experts_NK = self.route(x_ND)
        out_ND = torch.zeros_like(x_ND)
        for e in range(self.w1.shape[0]):
            token_n, slot_n = torch.where(experts_NK == e)
            h = x_ND[token_n]
            y = F.linear(F.silu(F.linear(h, self.w1[e])) * F.linear(h, self.w3[e]), self.w2[e])
            out_ND.index_add_(0, token_n, (y * gates_NK[token_n, slot_n, None]).to(out_ND.dtype))
        return out_ND.view_as(x_BTD)
