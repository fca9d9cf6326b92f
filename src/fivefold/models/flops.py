"""Parameter counts and model FLOPs per token, from the model description alone.

Convention (docs/flops.md): model FLOPs are the forward pass's matrix multiplications, times
three for forward plus backward; attention scores (QK^T) and values (AV) are included over the
full s x s square (causal masking not discounted); the embedding lookup is free, the output
head is a matrix multiply. A token passes through the router and `top_k` of an MoE layer's
routed experts, and through all of its shared experts. Recomputation is not counted (that is
hardware FLOPs).
"""

from __future__ import annotations

import dataclasses

from fivefold.config import ModelConfig
from fivefold.models.description import Param, block_parameters, parameters


def multiplied_weights(cfg: ModelConfig, params: list[Param]) -> int:
    """Weights of `params` that one token multiplies: every matrix of a block, `top_k` of
    `experts` of the routed experts; vectors (norm gains, biases) are no multiplication."""
    total = 0
    for p in params:
        if p.part == "experts":
            total += p.numel // cfg.moe.experts * cfg.moe.top_k
        elif len(p.shape) == 2:
            total += p.numel
    return total


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one dense block's matrix multiplications (attention + MLP)."""
    return multiplied_weights(cfg, block_parameters(dataclasses.replace(cfg, moe=None), 0))


def param_count(cfg: ModelConfig) -> int:
    """All parameters of the model (embeddings counted once when tied)."""
    return sum(p.numel for p in parameters(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs (forward + backward) per trained token, by the convention above."""
    s = seq_len or cfg.seq_len
    blocks = sum(multiplied_weights(cfg, block_parameters(cfg, i)) for i in range(cfg.layers))
    matmul_params = blocks + cfg.vocab * cfg.hidden  # the head, tied or not
    attention = 2 * 2 * s * cfg.heads * cfg.d_head * cfg.layers  # QK^T and AV, forward
    return 3 * (2 * matmul_params + attention)
