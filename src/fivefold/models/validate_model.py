"""The checks of a model's shape (`check_model`), and the value checks every validator uses.

They live with the model, below parallelism and communication: a Hugging Face import
(fivefold.models.hf) checks the model a config.json describes with them and needs nothing
else; fivefold.validate calls them for the `[model]` table of a whole config. Each failure
raises `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import math

from fivefold.config import ConfigError, ModelConfig

FFN_TYPES = ("swiglu", "gelu")
MOE_SCORES = ("softmax", "sigmoid")
EXPERT_MATMULS = ("grouped", "loop")  # fivefold.models.expert_matmul's forms


def positive(key: str, value: int | float | None, allow_zero: bool = False) -> None:
    """A number > 0 (or >= 0): finite, since every such key sizes or scales something that
    an infinity would overflow or turn to NaN (found by tests/test_config_fuzz.py)."""
    if value is None:
        return
    if not (value > 0 or (allow_zero and value == 0)):  # also rejects NaN
        bound = "zero or more" if allow_zero else "greater than zero"
        raise ConfigError(key, f"must be {bound}, got {value}")
    if math.isinf(value):
        raise ConfigError(key, f"must be finite, got {value}")


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")


def divisors(n: int) -> str:
    """The divisors of n, for an error message: found up to sqrt(n) (a drawn 2**40 heads
    must not stall the check that names it) and listed up to 16, then "...", then n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted(set(small + [n // d for d in small]))
    shown = found if len(found) <= 16 else found[:15] + ["...", n]
    return ", ".join(map(str, shown))


def check_model(m: ModelConfig) -> None:
    """Every `model.*` key: values, and the shape a transformer can be built with."""
    for key in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
        positive(f"model.{key}", getattr(m, key))
    positive("model.kv_heads", m.kv_heads)
    positive("model.head_dim", m.head_dim)
    positive("model.rope_theta", m.rope_theta)
    positive("model.norm_eps", m.norm_eps)
    choice("model.ffn_type", m.ffn_type, FFN_TYPES)
    if m.heads % m.n_kv_heads:
        raise ConfigError("model.kv_heads", f"{m.n_kv_heads} does not divide model.heads = "
                                            f"{m.heads}; choose one of {divisors(m.heads)}")
    if m.head_dim is None and m.hidden % m.heads:
        raise ConfigError("model.heads", f"{m.heads} does not divide model.hidden = {m.hidden}; "
                                         "change one of them or set model.head_dim")
    if m.d_head % 2:
        raise ConfigError("model.head_dim", f"head dimension {m.d_head} must be even for rotary "
                                            "embeddings")
    if m.moe is not None:
        _check_moe(m)


def _check_moe(m: ModelConfig) -> None:
    moe = m.moe
    for key in ("experts", "top_k", "expert_ffn_hidden", "layer_freq"):
        positive(f"model.moe.{key}", getattr(moe, key))
    positive("model.moe.shared_experts", moe.shared_experts, allow_zero=True)
    positive("model.moe.dense_layers", moe.dense_layers, allow_zero=True)
    positive("model.moe.capacity_factor", moe.capacity_factor)
    if moe.top_k > moe.experts:
        raise ConfigError("model.moe.top_k", f"{moe.top_k} exceeds model.moe.experts = "
                                             f"{moe.experts}")
    positive("model.moe.aux_loss_weight", moe.aux_loss_weight, allow_zero=True)
    positive("model.moe.z_loss_weight", moe.z_loss_weight, allow_zero=True)
    positive("model.moe.bias_update_rate", moe.bias_update_rate, allow_zero=True)
    positive("model.moe.rank_imbalance", moe.rank_imbalance)
    if moe.rank_imbalance < 1:
        raise ConfigError("model.moe.rank_imbalance", f"must be 1 (balanced) or more, got "
                                                      f"{moe.rank_imbalance}")
    choice("model.moe.score", moe.score, MOE_SCORES)
    choice("model.moe.expert_matmul", moe.expert_matmul, EXPERT_MATMULS)
    if moe.dense_layers >= m.layers:
        raise ConfigError("model.moe.dense_layers", f"{moe.dense_layers} leaves no MoE layer "
                                                    f"among {m.layers}")
