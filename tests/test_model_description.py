"""The torch-free model description against the torch model it describes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fivefold.config import load_config
from fivefold.hardware import PROFILES
from fivefold.models import description
from fivefold.models.description import block_parameters, parameters
from fivefold.models.flops import flops_per_token, param_count
from fivefold.models.llama import Transformer
from fivefold.planner.params import total_params
from fivefold.planner.simulate import model_flops_per_token
from fivefold.validate import validate

SMALL = ["model.layers=3", "model.hidden=32", "model.heads=4", "model.ffn_hidden=48",
         "model.vocab=96", "model.seq_len=16"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.dense_layers=1",
       "model.moe.layer_freq=2", "model.moe.expert_ffn_hidden=48"]
CONFIGS = {
    "tiny preset": [],
    "qkv bias, untied": SMALL + ["model.qkv_bias=true", "model.tied_embeddings=false"],
    "tied, gqa": SMALL + ["model.kv_heads=2", "model.tied_embeddings=true"],
    "untied, mqa, head_dim": SMALL + ["model.kv_heads=1", "model.head_dim=4",
                                      "model.tied_embeddings=false"],
    "gelu": SMALL + ["model.ffn_type='gelu'"],
    "moe": SMALL + MOE + ["model.kv_heads=2", "model.qkv_bias=true"],
    "moe, expert width": SMALL + MOE + ["model.moe.expert_ffn_hidden=24",
                                        "model.tied_embeddings=false", "model.layers=4"],
}


def model_config(overrides):
    cfg = load_config(None, overrides)
    validate(cfg)
    return cfg.model


@pytest.mark.parametrize("name", CONFIGS)
def test_names_and_shapes_are_the_models(name):
    cfg = model_config(CONFIGS[name])
    built = [(n, tuple(p.shape)) for n, p in Transformer(cfg).named_parameters()]
    assert [(p.name, p.shape) for p in parameters(cfg)] == built
    assert sum(p.numel for p in parameters(cfg)) == param_count(cfg)


@pytest.mark.parametrize("name", CONFIGS)
def test_parts_layers_and_splits(name):
    cfg = model_config(CONFIGS[name])
    for p in parameters(cfg):
        assert (p.layer is None) == (not p.name.startswith("layers.")), p.name
        if p.layer is not None:
            assert p.name.startswith(f"layers.{p.layer}."), p.name
        moe = p.layer is not None and description.is_moe_layer(cfg, p.layer)
        assert (p.part in description.MOE_PARTS) == (moe and p.name.split(".")[2] == "mlp")
        if p.tp_dim is not None:
            assert p.tp_dim < len(p.shape), p.name
        if p.part in ("norm", "router"):
            assert p.tp_dim is None, p.name
    if cfg.moe is not None:
        assert [(p.part, p.tp_dim) for p in block_parameters(cfg, 1)][-4:] == [
            ("experts", 1), ("experts", 1), ("experts", 2), ("router", None)]
        assert block_parameters(cfg, 0)[-1].part == "mlp"  # a leading dense layer


def test_tensor_parallel_splits():
    cfg = model_config(CONFIGS["qkv bias, untied"])
    dims = {description.name_in_part(p.name): p.tp_dim for p in block_parameters(cfg, 0)}
    assert dims == {"attention_norm.weight": None, "attention.wq.weight": 0,
                    "attention.wq.bias": 0, "attention.wk.weight": 0, "attention.wk.bias": 0,
                    "attention.wv.weight": 0, "attention.wv.bias": 0, "attention.wo.weight": 1,
                    "mlp_norm.weight": None, "mlp.w1.weight": 0, "mlp.w3.weight": 0,
                    "mlp.w2.weight": 1}
    root = {p.name: (p.part, p.tp_dim) for p in parameters(cfg) if p.layer is None}
    assert root == {"tok_embeddings.weight": ("embedding", 0), "norm.weight": ("norm", None),
                    "output.weight": ("head", 0)}


def test_shared_experts_are_one_wide_dense_mlp():
    """Shared experts, which the planner models and the torch MoE does not build yet."""
    cfg = model_config(SMALL + MOE + ["model.moe.shared_experts=2"])
    shared = [p for p in block_parameters(cfg, 1) if p.part == "shared_experts"]
    assert [(p.name, p.shape, p.tp_dim) for p in shared] == [
        ("layers.1.mlp.shared.w1.weight", (96, 32), 0),
        ("layers.1.mlp.shared.w3.weight", (96, 32), 0),
        ("layers.1.mlp.shared.w2.weight", (32, 96), 1)]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_planner_counts_the_same_parameters(name):
    cfg = model_config(CONFIGS[name])
    assert total_params(cfg) == param_count(cfg)


def test_moe_flops_count_the_active_experts():
    """Router plus top_k of the routed experts per token, as the planner's GEMMs count them."""
    cfg = model_config(["model.preset='mixtral-8x7B'"])
    D, F, L, V = cfg.hidden, cfg.moe.expert_ffn_hidden, cfg.layers, cfg.vocab
    attention = 2 * D * cfg.heads * cfg.d_head + 2 * D * cfg.n_kv_heads * cfg.d_head
    matmul = L * (attention + D * cfg.moe.experts + cfg.moe.top_k * 3 * D * F) + V * D
    assert flops_per_token(cfg, seq_len=1) == 3 * (2 * matmul + 4 * cfg.heads * cfg.d_head * L)
    assert model_flops_per_token(cfg, PROFILES["H100-SXM"]) == pytest.approx(
        flops_per_token(cfg), rel=1e-12)


def test_the_description_imports_no_torch():
    source = Path(description.__file__).read_text()
    imported = {alias.name for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "fivefold.config"}
