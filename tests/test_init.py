"""Deterministic initialization: a parameter's value depends on (seed, name, full shape, layers)."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.config import load_config
from fivefold.models.init import RESIDUAL_PROJECTIONS, STD, init_tensor, param_seed
from fivefold.models.llama import build_model

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
        "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32"]


def model_cfg(*overrides: str):
    return load_config(None, TINY + list(overrides)).model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def is_residual(name: str) -> bool:
    return name.endswith(RESIDUAL_PROJECTIONS)


# ---------------------------------------------------------------- reproducibility

@pytest.mark.parametrize("tied", [True, False])
def test_same_seed_is_bit_identical(tied):
    cfg = model_cfg(f"model.tied_embeddings={str(tied).lower()}")
    a, b = params(build_model(cfg, seed=7)), params(build_model(cfg, seed=7))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_init_ignores_the_global_rng():
    cfg = model_cfg()
    torch.manual_seed(0)
    a = params(build_model(cfg, seed=7))
    torch.manual_seed(12345)
    torch.rand(100)
    b = params(build_model(cfg, seed=7))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_different_seed_differs():
    cfg = model_cfg()
    a, b = params(build_model(cfg, seed=0)), params(build_model(cfg, seed=1))
    for name in a:
        if name.endswith("norm.weight"):
            assert torch.equal(a[name], b[name])  # ones whatever the seed
        else:
            assert not torch.equal(a[name], b[name]), name


def test_parameters_are_mutually_independent():
    """No two parameters share a random stream (e.g. wk and wv of one layer, or two layers)."""
    cfg = model_cfg("model.kv_heads=4", "model.ffn_hidden=64")  # many equal shapes
    p = params(build_model(cfg, seed=0))
    firsts = {}
    for name, value in p.items():
        if name.endswith("norm.weight"):
            continue
        key = round(value.flatten()[0].item() / value.std().item(), 6)
        assert key not in firsts, f"{name} starts like {firsts.get(key)}"
        firsts[key] = name
    assert not torch.equal(p["layers.0.attention.wk.weight"], p["layers.0.attention.wv.weight"])
    assert not torch.equal(p["layers.0.attention.wq.weight"], p["layers.1.attention.wq.weight"])


# ---------------------------------------------------------------- depends on (seed, name, shape)

def test_param_seed_depends_on_each_input():
    base = param_seed(0, "layers.0.attention.wq.weight", (64, 64))
    assert base == param_seed(0, "layers.0.attention.wq.weight", (64, 64))
    assert 0 <= base < 2**63
    assert base != param_seed(1, "layers.0.attention.wq.weight", (64, 64))
    assert base != param_seed(0, "layers.1.attention.wq.weight", (64, 64))
    assert base != param_seed(0, "layers.0.attention.wq.weight", (64, 32))
    assert base != param_seed(0, "layers.0.attention.wq.weight", (32, 128))


@pytest.mark.parametrize("seed", [0, 3])
def test_model_parameters_equal_init_tensor(seed):
    cfg = model_cfg("model.tied_embeddings=false")
    model = build_model(cfg, seed=seed)
    for name, p in model.named_parameters():
        expected = init_tensor(name, tuple(p.shape), seed, cfg.layers)
        assert expected.dtype == torch.float32
        assert torch.equal(p.detach(), expected), name


def test_a_shard_is_a_slice_of_the_full_init():
    """What a tensor- or data-parallel rank would hold is a slice of the single-process init."""
    cfg = model_cfg()
    model = build_model(cfg, seed=11)
    p = params(model)
    tp = 4
    for name in ("layers.1.attention.wq.weight", "layers.0.mlp.w1.weight",  # column parallel
                 "layers.0.attention.wo.weight", "layers.1.mlp.w2.weight",  # row parallel
                 "tok_embeddings.weight"):  # vocab parallel
        full = init_tensor(name, tuple(p[name].shape), 11, cfg.layers)
        dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
        for r, shard in enumerate(full.chunk(tp, dim=dim)):
            assert torch.equal(shard, p[name].chunk(tp, dim=dim)[r]), (name, r)
        # a flat (ZeRO-3 style) shard of the flattened tensor, too
        flat = p[name].flatten()
        n = flat.numel() // 3
        assert torch.equal(full.flatten()[n:2 * n], flat[n:2 * n])


def test_init_depends_on_the_full_shape_not_the_shard_shape():
    """Initializing a shard by its own shape would be wrong: the values differ."""
    name = "layers.0.attention.wq.weight"
    full = init_tensor(name, (64, 64), 0, 2)
    own = init_tensor(name, (16, 64), 0, 2)
    assert not torch.equal(full[:16], own)


def test_deeper_model_keeps_shared_layers_up_to_residual_scale():
    """Adding layers leaves layers 0..k-1 identical, except residual projections, which carry the
    same random draws scaled by sqrt(2 * L_small) / sqrt(2 * L_big)."""
    small_cfg, big_cfg = model_cfg("model.layers=2"), model_cfg("model.layers=4")
    small, big = params(build_model(small_cfg, seed=4)), params(build_model(big_cfg, seed=4))
    assert set(small) < set(big)
    assert {n for n in big if n.startswith("layers.")} - set(small) == {
        n for n in big if n.startswith(("layers.2.", "layers.3."))}
    scale = math.sqrt(2 / 4)
    residual = 0
    for name, value in small.items():
        if is_residual(name):
            residual += 1
            assert not torch.equal(big[name], value), name
            torch.testing.assert_close(big[name], value * scale, rtol=1e-6, atol=0)
        else:
            assert torch.equal(big[name], value), name
    assert residual == 2 * small_cfg.layers


# ---------------------------------------------------------------- statistics

def test_statistics_of_the_scheme():
    layers = 6
    cfg = model_cfg(f"model.layers={layers}", "model.hidden=256", "model.heads=4",
                    "model.ffn_hidden=512", "model.vocab=1024", "model.tied_embeddings=false")
    model = build_model(cfg, seed=0)
    residual_std = STD / math.sqrt(2 * layers)
    seen_residual = seen_norm = 0
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            seen_norm += 1
            continue
        tol = 4 / math.sqrt(2 * p.numel())  # ~4 standard errors of the sample std
        want = residual_std if is_residual(name) else STD
        seen_residual += is_residual(name)
        assert p.std().item() == pytest.approx(want, rel=tol), name
        assert abs(p.mean().item()) < 4 * want / math.sqrt(p.numel()), name
    assert seen_residual == 2 * layers
    assert seen_norm == 2 * layers + 1
    # the embedding and the output head are plain 0.02
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.01)
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.01)


def test_residual_projections_of_gelu_mlp_are_scaled_too():
    cfg = model_cfg("model.ffn_type='gelu'", "model.layers=8", "model.ffn_hidden=256")
    model = build_model(cfg, seed=0)
    w2 = model.layers[0].mlp.w2.weight
    assert w2.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.layers[0].mlp.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)

