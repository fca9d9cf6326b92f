"""A Llama-family decoder in plain PyTorch, free of any parallelism.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (RoFormer, arXiv 2104.09864),
grouped-query attention (GQA, arXiv 2305.13245) through `scaled_dot_product_attention`, and
a SwiGLU MLP (arXiv 2002.05202) or the GPT-style GELU MLP, or a mixture-of-experts MLP in
the layers `model.moe` names (fivefold.models.moe). `model.qkv_bias` adds learned biases to
the query, key and value projections, as Qwen2 has. Parallel layouts rewrite or wrap this
module from outside (`fivefold.parallel`); nothing here knows about ranks.

Two seams let parallelism be installed from outside without the model knowing of it: each
`Attention.attend` is the attention core, q (B, H, T, E) and k, v (B, K, T, E) to the
output (default `causal_attention`, over exactly the tokens given), and
`Transformer.token_positions` are the positions of the tokens the model is handed (default
0..T-1), the rows of the rotary tables; context parallelism (fivefold.parallel.context)
sets both, so a rank computes its shard of every sequence.

On CUDA, grouped-query attention hands the shared key/value heads to SDPA as they are
(`enable_gqa`, which its flash kernel reads in place) instead of repeating them in memory; on
the CPU they are repeated, as before, which keeps CPU results unchanged.

Tensor names carry their shape: B batch, T tokens, D model width, H heads, K kv heads,
E head width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.description import is_moe_layer
from fivefold.models.init import init_model_
from fivefold.models.mlp import GeluMLP, SwiGLU
from fivefold.models.moe import MoE


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 for stability under mixed precision."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x = x_BTD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.type_as(x_BTD) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape (T, E/2), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rotary_rows(cos_TE2: torch.Tensor, sin_TE2: torch.Tensor, T: int, start: int = 0,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables for T tokens: positions [start, start + T), or the
    given `positions` (a context-parallel rank's tokens, see the module docstring)."""
    if positions is None:
        return cos_TE2[start:start + T], sin_TE2[start:start + T]
    return cos_TE2[positions], sin_TE2[positions]


def apply_rotary(x_BHTE: torch.Tensor, cos_TE2: torch.Tensor, sin_TE2: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :E/2], x[..., E/2:]) by the position's angle (the Llama layout)."""
    x1, x2 = x_BHTE.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_TE2 - x2 * sin_TE2, x2 * cos_TE2 + x1 * sin_TE2), dim=-1)
    return out.type_as(x_BHTE)


def causal_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor,
                     v_BKTE: torch.Tensor) -> torch.Tensor:
    """Causal attention of the given tokens through SDPA, key/value heads shared by groups."""
    groups = q_BHTE.shape[1] // k_BKTE.shape[1]
    gqa_in_kernel = groups > 1 and q_BHTE.is_cuda
    if groups > 1 and not gqa_in_kernel:
        k_BKTE = k_BKTE.repeat_interleave(groups, dim=1)
        v_BKTE = v_BKTE.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, is_causal=True,
                                          enable_gqa=gqa_in_kernel)


class Attention(nn.Module):
    """Causal multi-head attention with `kv_heads` key/value heads shared by head groups."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attend = causal_attention  # the attention core: a seam (module docstring)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, cfg.d_head
        self.wq = nn.Linear(cfg.hidden, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTE = self.wq(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        k_BKTE = self.wk(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        v_BKTE = self.wv(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        q_BHTE, k_BKTE = apply_rotary(q_BHTE, cos, sin), apply_rotary(k_BKTE, cos, sin)
        out_BHTE = self.attend(q_BHTE, k_BKTE, v_BKTE)
        return self.wo(out_BHTE.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        mlp = SwiGLU if cfg.ffn_type == "swiglu" else GeluMLP
        self.mlp = MoE(cfg) if is_moe_layer(cfg, layer) else mlp(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos, sin)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Transformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = None if cfg.tied_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.token_positions: torch.Tensor | None = None  # a seam (module docstring)

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (B, T, D), before the output head."""
        cos, sin = rotary_rows(self.rope_cos, self.rope_sin, tokens_BT.shape[1],
                               positions=self.token_positions)
        x_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, cos, sin)
        return self.norm(x_BTD)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden_states(tokens_BT), self.output_weight())


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """A deterministically initialized fp32 model on `device` (see fivefold.models.init)."""
    return init_model_(Transformer(cfg), seed, cfg.layers).to(device)
