"""The Llama model: shapes, variants, causality, GQA, rotary, parameter and FLOP counts, presets."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.config import ModelConfig, load_config
from fivefold.models.flops import block_matmul_params, flops_per_token, param_count
from fivefold.models.llama import Attention, Transformer, apply_rotary, build_model, rotary_tables
from fivefold.models.presets import PRESETS
from fivefold.validate import validate

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
        "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32"]


def tiny(*overrides: str) -> ModelConfig:
    cfg = load_config(None, TINY + list(overrides))
    validate(cfg)
    return cfg.model


def tokens(cfg: ModelConfig, B: int = 2, T: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (B, T or cfg.seq_len), generator=g)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- shapes and variants

@pytest.mark.parametrize("ffn_type", ["swiglu", "gelu"])
@pytest.mark.parametrize("tied", [True, False])
def test_forward_shape_and_param_count(ffn_type, tied):
    cfg = tiny(f"model.ffn_type={ffn_type!r}", f"model.tied_embeddings={str(tied).lower()}")
    model = build_model(cfg, seed=0)
    x = tokens(cfg, B=3)
    logits = model(x)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # shorter sequences than seq_len work too (sampling, eval of a tail)
    assert model(x[:, :5]).shape == (3, 5, cfg.vocab)
    assert n_params(model) == param_count(cfg)
    mlp = model.layers[0].mlp
    if ffn_type == "swiglu":
        assert {n for n, _ in mlp.named_children()} == {"w1", "w2", "w3"}
    else:
        assert {n for n, _ in mlp.named_children()} == {"w1", "w2"}


def test_tied_embeddings_share_the_output_weight():
    cfg = tiny("model.tied_embeddings=true")
    model = build_model(cfg, seed=0)
    assert model.output is None
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("output") for n in names), names
    assert model.output_weight() is model.tok_embeddings.weight
    # the logits really are the hidden states times the embedding matrix
    x = tokens(cfg)
    expected = model.hidden_states(x) @ model.tok_embeddings.weight.T
    torch.testing.assert_close(model(x), expected)
    # and gradients from the head reach the embedding
    model(x).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_untied_embeddings_have_a_separate_head():
    cfg = tiny("model.tied_embeddings=false")
    model = build_model(cfg, seed=0)
    assert model.output is not None
    assert model.output.weight.shape == (cfg.vocab, cfg.hidden)
    assert model.output_weight() is model.output.weight
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # MQA, GQA, plain multi-head
@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_model_gqa_and_mha(kv_heads, tied):
    cfg = tiny(f"model.kv_heads={kv_heads}", f"model.tied_embeddings={str(tied).lower()}")
    model = Transformer(cfg)
    assert n_params(model) == param_count(cfg)
    attn = model.layers[0].attention
    assert attn.wk.weight.shape == (kv_heads * cfg.d_head, cfg.hidden)
    assert attn.wv.weight.shape == (kv_heads * cfg.d_head, cfg.hidden)
    assert attn.wq.weight.shape == (cfg.heads * cfg.d_head, cfg.hidden)


def test_param_count_with_explicit_head_dim():
    cfg = tiny("model.head_dim=8")  # q/k/v narrower than hidden
    model = Transformer(cfg)
    assert model.layers[0].attention.wq.weight.shape == (4 * 8, 64)
    assert n_params(model) == param_count(cfg)
    assert model(tokens(cfg)).shape == (2, cfg.seq_len, cfg.vocab)


# ---------------------------------------------------------------- causality

@pytest.mark.parametrize("kv_heads", [2, 4])
def test_causal_changing_token_t_leaves_earlier_logits(kv_heads):
    cfg = tiny(f"model.kv_heads={kv_heads}")
    model = build_model(cfg, seed=1).eval()
    x = tokens(cfg, B=2)
    with torch.no_grad():
        base = model(x)
        for t in (0, 7, cfg.seq_len - 1):
            y = x.clone()
            y[:, t] = (y[:, t] + 1) % cfg.vocab
            out = model(y)
            assert torch.equal(out[:, :t], base[:, :t]), f"position < {t} changed"
            assert not torch.allclose(out[:, t], base[:, t]), f"position {t} did not change"


# ---------------------------------------------------------------- attention vs a naive reference

def naive_attention(attn: Attention, x_BTD: torch.Tensor, cos, sin) -> torch.Tensor:
    """softmax(QK^T / sqrt(E) + causal mask) V with kv heads repeated per group, by hand."""
    B, T, _ = x_BTD.shape
    H, K, E = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x_BTD @ attn.wq.weight.T).view(B, T, H, E).transpose(1, 2)
    k = (x_BTD @ attn.wk.weight.T).view(B, T, K, E).transpose(1, 2)
    v = (x_BTD @ attn.wv.weight.T).view(B, T, K, E).transpose(1, 2)

    def rotate(t):  # the Llama "rotate half" layout, written independently
        t1, t2 = t[..., : E // 2], t[..., E // 2:]
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return t * c + torch.cat([-t2, t1], -1) * s

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(H // K, dim=1)  # head h reads kv head h // (H/K)
    v = v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(B, T, H * E) @ attn.wo.weight.T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_naive_reference(kv_heads):
    cfg = tiny(f"model.kv_heads={kv_heads}")
    model = build_model(cfg, seed=3)
    attn = model.layers[0].attention
    with torch.no_grad():
        for p in attn.parameters():  # larger weights: non-trivial attention patterns
            p.mul_(10)
        x = torch.randn(2, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(0))
        got = attn(x, model.rope_cos, model.rope_sin)
        want = naive_attention(attn, x, model.rope_cos, model.rope_sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gqa_equals_mha_with_shared_kv_heads():
    """A kv_heads=2 model equals a kv_heads=4 model whose heads in a group share k and v."""
    gqa_cfg, mha_cfg = tiny("model.kv_heads=2"), tiny("model.kv_heads=4")
    gqa, mha = build_model(gqa_cfg, seed=5), build_model(mha_cfg, seed=6)
    E, groups = gqa_cfg.d_head, gqa_cfg.heads // gqa_cfg.n_kv_heads
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("attention.wk.weight", "attention.wv.weight")):
                per_head = src.view(gqa_cfg.n_kv_heads, E, -1)
                p.copy_(per_head.repeat_interleave(groups, dim=0).reshape_as(p))
            else:
                p.copy_(src)
        x = tokens(gqa_cfg)
        torch.testing.assert_close(mha(x), gqa(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- rotary embeddings

def test_rotary_tables_shape_and_position_zero():
    cos, sin = rotary_tables(16, 8, 10000.0)
    assert cos.shape == sin.shape == (16, 4)
    assert torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
    # the first frequency is 1 rad per position, the others fall geometrically
    torch.testing.assert_close(torch.atan2(sin[1], cos[1]),
                               torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)]))


def test_apply_rotary_preserves_norms():
    E, T = 16, 40
    cos, sin = rotary_tables(T, E, 10000.0)
    x = torch.randn(2, 3, T, E, generator=torch.Generator().manual_seed(0))
    y = apply_rotary(x, cos, sin)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # position 0 is the identity
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    # bf16 in, bf16 out
    assert apply_rotary(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_apply_rotary_relative_position_property():
    E, T = 16, 64
    cos, sin = rotary_tables(T, E, 10000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(E, generator=g), torch.randn(E, generator=g)
    # the same q and k at every position: rotated versions at each position
    q_T = apply_rotary(q.expand(1, 1, T, E).contiguous(), cos, sin)[0, 0].double()
    k_T = apply_rotary(k.expand(1, 1, T, E).contiguous(), cos, sin)[0, 0].double()
    dots = q_T @ k_T.T  # dots[i, j] = <R_i q, R_j k>
    for offset in (-5, 0, 3, 17):
        diag = torch.diagonal(dots, offset=-offset)  # entries with i - j == offset
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-4, atol=1e-4)
    # and it really depends on the offset (not a constant)
    assert not torch.allclose(dots[5, 5], dots[5, 0])


# ---------------------------------------------------------------- FLOPs

@pytest.mark.parametrize("ffn_type,tied", [("swiglu", True), ("gelu", False)])
def test_flops_per_token_hand_computation(ffn_type, tied):
    cfg = tiny(f"model.ffn_type={ffn_type!r}", f"model.tied_embeddings={str(tied).lower()}")
    L, D, H, K, E, Fh, V, s = 2, 64, 4, 2, 16, 96, 512, 32
    attention_w = D * H * E + 2 * D * K * E + H * E * D  # wq, wk, wv, wo
    mlp_w = (3 if ffn_type == "swiglu" else 2) * D * Fh
    assert block_matmul_params(cfg) == attention_w + mlp_w
    matmul_params = L * (attention_w + mlp_w) + V * D  # the head; the embedding lookup is free
    expected = 6 * matmul_params + 12 * L * s * H * E
    assert flops_per_token(cfg) == expected
    # an explicit sequence length replaces cfg.seq_len in the attention term only
    assert flops_per_token(cfg, seq_len=128) == 6 * matmul_params + 12 * L * 128 * H * E
    # the matmul part counts exactly the model's Linear weights (+ the head once)
    model = Transformer(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear + (V * D if tied else 0) == matmul_params


def test_flops_per_token_of_8b_is_about_6n():
    cfg = load_config(None, ["model.preset='8B'"]).model
    n = param_count(cfg)
    fpt = flops_per_token(cfg, seq_len=1)  # attention term negligible
    # 6 * (params without the input embedding)
    assert fpt == pytest.approx(6 * (n - cfg.vocab * cfg.hidden), rel=1e-3)


# ---------------------------------------------------------------- presets

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads_and_validates(name):
    cfg = load_config(None, [f"model.preset={name!r}"])
    validate(cfg)
    m = cfg.model
    assert m.preset == name
    for key, value in PRESETS[name].items():
        if key != "moe":
            assert getattr(m, key) == value, key
    assert (m.moe is not None) == ("moe" in PRESETS[name])
    assert m.hidden % m.heads == 0 and m.heads % m.n_kv_heads == 0 and m.d_head % 2 == 0
    assert param_count(m) > 0 and flops_per_token(m) > 0


@pytest.mark.parametrize("name,published", [("1B", 1.236e9), ("8B", 8.03e9),
                                            ("70B", 70.6e9), ("405B", 405.9e9)])
def test_llama_preset_sizes_match_published(name, published):
    cfg = load_config(None, [f"model.preset={name!r}"]).model
    assert param_count(cfg) == pytest.approx(published, rel=0.03)


def test_tiny_preset_is_the_default_and_small():
    cfg = load_config(None, []).model
    assert cfg.preset == "tiny"
    n = param_count(cfg)
    assert n < 10e6
    assert n == n_params(Transformer(cfg))
