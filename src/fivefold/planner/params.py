"""Parameter counts per data-parallel unit on one rank, from the model config alone.

The runtime groups parameters into flat units (fivefold.parallel.data_parallel.split_units):
a root unit with everything outside the blocks (token embeddings, final norm, the output head
when it is not tied) and one unit per block. These functions list the same parameters as
fivefold.models.llama and fivefold.models.moe build them, with tensor parallelism splitting
the head dimension and MLP width and expert parallelism splitting the experts, so that the
planner's memory and communication predictions can be exact (tests/test_planner_ledger.py
holds them against the runtime's ledger).
"""

from __future__ import annotations

from fivefold.config import ModelConfig
from fivefold.planner.compute import is_moe_layer


def _qkv_widths(model: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(query width, key/value width, their biases) on one tensor-parallel rank."""
    q = model.heads * model.d_head // tp
    kv = max(1, model.n_kv_heads // tp) * model.d_head
    return q, kv, (q + 2 * kv) if getattr(model, "qkv_bias", False) else 0


def attention_params(model: ModelConfig, tp: int = 1) -> int:
    D = model.hidden
    q, kv, bias = _qkv_widths(model, tp)
    return D * q + 2 * D * kv + q * D + bias


def block_matrix_shapes(model: ModelConfig, layer: int, tp: int = 1) -> list[tuple[int, int]]:
    """(rows, columns) of block `layer`'s 2-D weight matrices on one tensor-parallel rank:
    attention, then the dense MLP, or the router and shared experts of an MoE layer (routed
    experts are one 3-D tensor per projection)."""
    D = model.hidden
    q, kv, _ = _qkv_widths(model, tp)
    shapes = [(q, D), (kv, D), (kv, D), (D, q)]
    if is_moe_layer(model, layer):
        m = model.moe
        shapes.append((m.experts, D))
        if m.shared_experts:
            f = m.shared_experts * (m.expert_ffn_hidden or model.ffn_hidden) // tp
            shapes += [(f, D), (f, D), (D, f)]
        return shapes
    f = model.ffn_hidden // tp
    return shapes + ([(f, D)] * (2 if model.ffn_type == "swiglu" else 1) + [(D, f)])


def block_vector_params(model: ModelConfig, tp: int = 1) -> int:
    """The vectors of one block (two norm gains, the query/key/value biases): with Muon they
    stay with AdamW, as everything outside the blocks' matrices (fivefold.optim)."""
    return 2 * model.hidden + _qkv_widths(model, tp)[2]


def mlp_params(model: ModelConfig, tp: int = 1) -> int:
    mats = 3 if model.ffn_type == "swiglu" else 2
    return mats * model.hidden * model.ffn_hidden // tp


def expert_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Routed experts of one MoE layer held by one rank (SwiGLU experts)."""
    m = model.moe
    ffn = m.expert_ffn_hidden or model.ffn_hidden
    return m.experts // ep * 3 * model.hidden * ffn // tp


def moe_dense_params(model: ModelConfig, tp: int = 1) -> int:
    """Router and shared experts of one MoE layer (held by every expert-parallel rank)."""
    m = model.moe
    ffn = m.expert_ffn_hidden or model.ffn_hidden
    return model.hidden * m.experts + m.shared_experts * 3 * model.hidden * ffn // tp


def block_params(model: ModelConfig, layer: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of block `layer` on one rank; norms are replicated."""
    dense = attention_params(model, tp) + 2 * model.hidden
    if is_moe_layer(model, layer):
        return dense + moe_dense_params(model, tp), expert_params(model, tp, ep)
    return dense + mlp_params(model, tp), 0


def root_params(model: ModelConfig, tp: int = 1, first: bool = True, last: bool = True) -> int:
    """Embeddings (first pipeline stage), final norm and untied head (last stage). Tensor
    parallelism splits the vocabulary rows, padded to a multiple of tp as the runtime does
    (fivefold.parallel.tensor.padded_vocab)."""
    table = -(-model.vocab // tp) * model.hidden
    n = table if first else 0
    if last:
        n += model.hidden + (0 if model.tied_embeddings else table)
        if model.tied_embeddings and not first:
            n += table  # the last stage keeps its own copy of the tied table
    return n


def total_params(model: ModelConfig) -> int:
    """Every parameter of the model on one device (embeddings once when tied)."""
    blocks = sum(sum(block_params(model, i)) for i in range(model.layers))
    return blocks + root_params(model)


def active_params(model: ModelConfig) -> int:
    """Parameters one token passes through: top-k of the routed experts."""
    total = total_params(model)
    if model.moe is None:
        return total
    m = model.moe
    moe_layers = sum(is_moe_layer(model, i) for i in range(model.layers))
    inactive = (m.experts - m.top_k) * expert_params(model) // m.experts
    return total - moe_layers * inactive
