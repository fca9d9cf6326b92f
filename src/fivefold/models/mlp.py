"""The dense MLPs of a block: SwiGLU (Shazeer 2020, arXiv 2002.05202) and the GPT GELU MLP.

Shared by the dense blocks (fivefold.models.llama) and the always-active shared experts of an
MoE layer (fivefold.models.moe). Tensor names: B batch, T tokens, D model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): three matrices (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)): the two-matrix GPT MLP (tanh approximation)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x_BTD), approximate="tanh"))
