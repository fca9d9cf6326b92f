"""Parameter counts and model FLOPs per token, from the config alone.

Convention (docs/flops.md): model FLOPs are the forward pass's matrix multiplications, times
three for forward plus backward; attention scores (QK^T) and values (AV) are included over the
full s x s square (causal masking not discounted); the embedding lookup is free, the output
head is a matrix multiply. Recomputation is not counted (that is hardware FLOPs).
"""

from __future__ import annotations

from fivefold.config import ModelConfig


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one dense block's matrix multiplications (attention + MLP)."""
    q_out = cfg.heads * cfg.d_head
    kv_out = cfg.n_kv_heads * cfg.d_head
    attention = cfg.hidden * (2 * q_out + 2 * kv_out)
    mlp = (3 if cfg.ffn_type == "swiglu" else 2) * cfg.hidden * cfg.ffn_hidden
    return attention + mlp


def param_count(cfg: ModelConfig) -> int:
    """All parameters of the dense model (embeddings counted once when tied)."""
    norms = (2 * cfg.layers + 1) * cfg.hidden
    embeddings = cfg.vocab * cfg.hidden * (1 if cfg.tied_embeddings else 2)
    return cfg.layers * block_matmul_params(cfg) + norms + embeddings


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs (forward + backward) per trained token, by the convention above."""
    s = seq_len or cfg.seq_len
    matmul_params = cfg.layers * block_matmul_params(cfg) + cfg.vocab * cfg.hidden
    attention = 2 * 2 * s * cfg.heads * cfg.d_head * cfg.layers  # QK^T and AV, forward
    return 3 * (2 * matmul_params + attention)
