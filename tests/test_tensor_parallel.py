"""Tensor parallelism with and without sequence parallelism: parity with one process,
activation bytes against 2205.05198's per-layer formula adapted to this block, and the ledger
against the analytic collective volumes, exactly.

Parity tolerance (as tests/test_data_parallel.py): fp32 on CPU at lr 1e-3, after 5 optimizer
steps losses agree to 2e-5 relative, gradient norms to 1e-4 relative, and parameters
(gathered back to full, unpadded tensors) to 1e-5 absolute + 1e-4 relative. Tensor
parallelism sums the row-parallel partial products and the vocabulary statistics in another
order than one process, so gradients differ by rounding, |δg| ~ 1e-7 of their scale (2e-9
here). Adam's step lr·m/(sqrt(v) + eps) moves by at most lr·|δg|/eps for such a change, and
with the default eps 1e-8 an element whose first gradient is nearly zero (an embedding row
seen once, measured: 8e-8 against 0.02 in its row) then differs by 2.5e-5 after 5 steps. The
runs here use eps 1e-6, which bounds that to lr·|δg|/eps = 2e-6 per step for every element.

Ranks start once per world size (2 and 4) and run every layout of that size in turn; models
are tiny (2 layers, hidden 64, MLP 96, 32 tokens) with grouped-query or multi-head attention,
SwiGLU or GELU, tied or untied embeddings, query/key/value biases (split with their
columns), and a vocabulary (509) that tp 2 and 4 must pad.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import CPU, STEPS, assert_params_close, resumed_losses, train_steps

from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.models.init import init_tensor
from fivefold.models.llama import build_model
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.tensor import (GatheredLogits, activation_bytes_per_layer,
                                      apply_tensor_parallel, padded_vocab, shard_tensor,
                                      split_dim, unshard_tensor)
from fivefold.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer

MODELS = {
    "gqa-tied": ["model.heads=4", "model.kv_heads=2", "model.tied_embeddings=true"],
    "mha-untied": ["model.heads=4", "model.kv_heads=4", "model.tied_embeddings=false"],
    "gqa8-untied-pad": ["model.heads=8", "model.kv_heads=4", "model.tied_embeddings=false",
                        "model.vocab=509", "model.qkv_bias=true"],
    "gelu-tied-pad": ["model.heads=4", "model.kv_heads=4", "model.tied_embeddings=true",
                      "model.ffn_type='gelu'", "model.vocab=509"],
}
ACTIVATION_MODELS = ("gqa8-untied-pad", "mha-untied")  # 2 or 1 heads per rank at tp 4
# (model, tp, sequence_parallel, zero_stage, micro_batch); dp = world / tp
LAYOUTS_2 = [(m, 2, sp, 0, None) for m in MODELS for sp in (False, True)] + [
    ("gqa-tied", 2, True, 0, 2)]
LAYOUTS_4 = [
    ("mha-untied", 4, False, 0, None), ("mha-untied", 4, True, 0, None),
    ("gqa8-untied-pad", 4, False, 0, None), ("gqa8-untied-pad", 4, True, 0, None),
    ("gelu-tied-pad", 4, True, 0, None),
    ("gqa-tied", 2, False, 1, None), ("gqa-tied", 2, True, 3, None),
    ("gqa8-untied-pad", 2, True, 1, 2), ("mha-untied", 2, False, 3, None)]


def _sets(overrides, model, tp=1, sp=False, stage=0, micro=None):
    sets = overrides + MODELS[model] + [f"parallel.tp={tp}", f"parallel.zero_stage={stage}",
                                        f"parallel.sequence_parallel={str(sp).lower()}",
                                        f"train.steps={STEPS}"]
    return sets + ([f"parallel.micro_batch={micro}"] if micro else [])


# ---------------------------------------------------------------- activation bytes

def saved_bytes_per_layer(model, tokens_BT) -> list[int]:
    """Bytes of the distinct storages each block saves for backward (parameters and buffers
    excluded), recorded with saved_tensors_hooks."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    T = tokens_BT.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x_BTD = model.tok_embeddings(tokens_BT)
    out = []
    for layer in model.layers:
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in state:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x_BTD = layer(x_BTD, cos, sin)
        out.append(sum(seen.values()))
    return out


def _activations(rt, cfg, tp):
    mesh = Mesh({"pp": 1, "dp_replicate": rt.world_size // tp, "dp_shard": 1, "cp": 1, "tp": tp},
                "cpu", Ledger())
    tokens = torch.randint(0, cfg.model.vocab, (2, cfg.model.seq_len),
                           generator=torch.Generator().manual_seed(0))
    out = {}
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(cfg.model, 0), mesh.axis("tp"), sp)
        out[sp] = saved_bytes_per_layer(model, tokens)
    return out


# ---------------------------------------------------------------- vocabulary-parallel loss

def _vocab_loss(rt, vocab, tp):
    """Loss and gradient of the vocabulary-parallel CE against F.cross_entropy on full logits."""
    mesh = Mesh({"pp": 1, "dp_replicate": rt.world_size // tp, "dp_shard": 1, "cp": 1, "tp": tp},
                "cpu", Ledger())
    axis = mesh.axis("tp")
    gen = torch.Generator().manual_seed(1)
    full_NV = torch.randn(40, vocab, generator=gen) * 3
    targets_N = torch.randint(0, vocab, (40,), generator=gen)
    local = shard_tensor("output.weight", full_NV.t(), tp, axis.rank).t().contiguous()
    local.requires_grad_()
    loss_N = vocab_parallel_cross_entropy(local, targets_N, vocab, axis)
    (loss_N * torch.linspace(0.5, 1.5, 40)).sum().backward()
    ref = full_NV.clone().requires_grad_()
    ref_N = F.cross_entropy(ref, targets_N, reduction="none")
    (ref_N * torch.linspace(0.5, 1.5, 40)).sum().backward()
    ref_grad = shard_tensor("output.weight", ref.grad.t(), tp, axis.rank).t()
    padding_grad = local.grad[:, max(0, vocab - axis.rank * local.shape[1]):]
    return ((loss_N - ref_N).abs().max().item(), (local.grad - ref_grad).abs().max().item(),
            padding_grad.shape[1], padding_grad.abs().sum().item())


# ---------------------------------------------------------------- sampling and resuming

def _gathered_logits(rt, cfg, tp):
    """Largest |difference| between GatheredLogits of the split model and the plain model's
    logits, on a 7-token window (padded to a multiple of tp with sequence parallelism)."""
    mesh = Mesh({"pp": 1, "dp_replicate": rt.world_size // tp, "dp_shard": 1, "cp": 1, "tp": tp},
                "cpu", Ledger())
    tokens = torch.randint(0, cfg.model.vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = build_model(cfg.model, 0)(tokens)
        errors = []
        for sp in (False, True):
            split = apply_tensor_parallel(build_model(cfg.model, 0), mesh.axis("tp"), sp)
            logits = GatheredLogits(split, mesh.axis("tp"), sp)(tokens)
            assert logits.shape == ref.shape
            errors.append((logits - ref).abs().max().item())
    return max(errors)


def _resume(rt, overrides, tmp):
    """Losses of 4 straight steps, and of 2 steps, a checkpoint, a new trainer resuming from
    it and 2 more steps (tp 2 x dp 2, ZeRO-3, sequence parallelism)."""
    cfg = load_config(None, _sets(overrides, "gelu-tied-pad", 2, True, 3))
    straight = Trainer(cfg, rt, f"{tmp}/straight")
    resumed, _, _ = resumed_losses(rt, cfg, f"{tmp}/resumed", save_at=2, steps=4)
    return [straight.train_step(s).loss for s in range(4)], resumed


# ---------------------------------------------------------------- one spawn per world size

def _on_ranks(rt, overrides, layouts, tmp):
    trained = [train_steps(rt, load_config(None, _sets(overrides, *layout)), tmp)
               for layout in layouts]
    extra = {"activations": {m: _activations(rt, load_config(None, _sets(overrides, m)),
                                             rt.world_size) for m in ACTIVATION_MODELS},
             "vocab_loss": _vocab_loss(rt, 509, rt.world_size),
             "sampling": _gathered_logits(rt, load_config(None, _sets(overrides, "gelu-tied-pad")),
                                          rt.world_size)}
    if rt.world_size == 4:
        extra["resume"] = _resume(rt, overrides, tmp)
    return (trained if rt.rank == 0 else None), extra


@pytest.fixture(scope="module")
def overrides(parity_overrides):
    """The parity overrides (vocabulary 512 tokenized there) with Adam's eps 1e-6; the padded
    vocabulary (509) is tokenized here, once, before the ranks start."""
    sets = parity_overrides + ["train.eps=1e-6"]
    prepare_data(load_config(None, sets + MODELS["gelu-tied-pad"]))
    return sets


@pytest.fixture(scope="module")
def reference(overrides, tmp_path_factory):
    """The single-process Trainer, per model."""
    return {m: train_steps(CPU, load_config(None, _sets(overrides, m)),
                           tmp_path_factory.mktemp("r"))
            for m in MODELS}


@pytest.fixture(scope="module")
def ranks(overrides, tmp_path_factory):
    return {world: run_on_ranks(_on_ranks, world, overrides, layouts,
                                str(tmp_path_factory.mktemp(f"w{world}")), timeout_s=900)
            for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4))}


@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)])
def test_parity_with_one_process(world, layouts, ranks, reference):
    """Losses rel 2e-5, gradient norms rel 1e-4, parameters atol 1e-5 + rtol 1e-4 (module
    docstring)."""
    for layout, run in zip(layouts, ranks[world][0][0]):
        ref = reference[layout[0]]
        label = "model {} tp {} sp {} zero {} micro {}".format(*layout)
        assert run.losses == pytest.approx(ref.losses, rel=2e-5), label
        assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-4), label
        assert_params_close(run.params, ref.params, label, atol=1e-5, rtol=1e-4)


def analytic_tp_bytes(cfg, layout, world) -> dict[tuple[str, str], int]:
    """Bytes per step on the tp axis: per layer and micro-batch, no SP: 4 all-reduces of the
    (b, s, h) activations (f and g of attention and MLP, forward and backward); SP: 4
    all-gathers + 4 reduce-scatters of the same full size, plus 2 backward re-gathers of the
    region inputs and the all-reduce of the 2 norm gains. Around the layers: the embedding's g
    and the head's f (one of each kind with SP, plus the final norm's gain), the vocabulary
    statistics (3 floats per token per rank) and the squared gradient norm (one float)."""
    _, tp, sp, _, micro = layout
    m, p = cfg.model, cfg.parallel
    per_rank = p.global_batch // (world // tp)
    micro = micro or per_rank
    n_micro, tokens = per_rank // micro, micro * m.seq_len
    act, L = 4 * tokens * m.hidden, m.layers
    out = {("all_gather", "vocab_loss"): n_micro * tp * 3 * tokens * 4,
           ("all_reduce", "grad_norm"): 4}
    if not sp:
        out[("all_reduce", "tp_activations")] = n_micro * (4 * L + 2) * act
        return out
    out[("all_gather", "sp_activations")] = n_micro * (4 * L + 2) * act
    out[("reduce_scatter", "sp_activations")] = n_micro * (4 * L + 2) * act
    out[("all_gather", "sp_regather")] = n_micro * 2 * L * act
    out[("all_reduce", "sp_norm_grads")] = n_micro * (2 * L + 1) * 4 * m.hidden
    return out


@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)])
def test_ledger_matches_analytic_volumes(world, layouts, ranks, overrides):
    for layout, run in zip(layouts, ranks[world][0][0]):
        cfg = load_config(None, _sets(overrides, *layout))
        recorded: dict[tuple[str, str], int] = {}
        for r in run.records:
            if r["mesh_dim"] == "tp":
                assert r["group_size"] == layout[1]
                key = (r["op"], r["purpose"])
                recorded[key] = recorded.get(key, 0) + r["bytes"]
        assert recorded == analytic_tp_bytes(cfg, layout, world), layout


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ACTIVATION_MODELS)
def test_activation_bytes_follow_the_formula(world, model, ranks, overrides):
    """Bytes saved for backward per layer, within 2% of `activation_bytes_per_layer` (the
    module docstring of fivefold.parallel.tensor derives it; on the CPU it is exact)."""
    cfg = load_config(None, _sets(overrides, model))
    m, b, s, t = cfg.model, 2, cfg.model.seq_len, world
    plain = saved_bytes_per_layer(build_model(m, 0), torch.randint(0, m.vocab, (b, s)))
    measured = ranks[world][0][1]["activations"][model]
    for got in plain:
        assert got == pytest.approx(activation_bytes_per_layer(m, b, s), rel=0.02)
    for sp, per_layer in measured.items():
        for got in per_layer:
            assert got == pytest.approx(activation_bytes_per_layer(m, b, s, t, sp), rel=0.02)
    # tensor parallelism alone keeps the norms and region inputs whole; with sequence
    # parallelism everything divides by t (one head per rank saves the wo copy on top)
    assert plain[0] / t < measured[False][0] < plain[0]
    if m.heads > t:
        assert measured[True][0] == pytest.approx(plain[0] / t, rel=0.02)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_loss_matches_full_softmax(world, ranks):
    """Per-token losses and logit gradients of the vocabulary-parallel CE equal the full
    softmax's (fp32, |error| < 1e-5 and 1e-6); the padding columns (all on the last rank)
    get exactly zero gradient."""
    results = [extra["vocab_loss"] for _, extra in ranks[world]]
    for loss_err, grad_err, _, padding_grad_sum in results:
        assert loss_err < 1e-5 and grad_err < 1e-6
        assert padding_grad_sum == 0.0
    assert sum(r[2] for r in results) == padded_vocab(509, world) - 509 > 0


def test_gathered_logits_equal_the_plain_model(ranks):
    """Sampling's full-vocabulary logits (padding dropped) match the plain model to 1e-5."""
    for world in (2, 4):
        assert ranks[world][0][1]["sampling"] < 1e-5


def test_checkpoint_resumes_exactly(ranks):
    """Each tp rank saves its own shards (keys tagged by tp rank); resuming is bit-exact."""
    straight, resumed = ranks[4][0][1]["resume"]
    assert resumed == straight


# ---------------------------------------------------------------- placements, no ranks

def test_shards_are_slices_of_the_full_init():
    cfg = load_config(None, ["model.layers=1", "model.hidden=64", "model.heads=8",
                             "model.kv_heads=4", "model.ffn_hidden=96", "model.vocab=509",
                             "model.tied_embeddings=false"]).model
    model = build_model(cfg, seed=3)
    names = dict(model.named_parameters())
    tp = 4
    for name, param in names.items():
        full = init_tensor(name, tuple(param.shape), 3, cfg.layers)
        shards = [shard_tensor(name, param.detach(), tp, r) for r in range(tp)]
        if split_dim(name) is None:
            assert all(torch.equal(s, full) for s in shards), name
        assert torch.equal(unshard_tensor(name, shards, cfg.vocab), full), name
    emb = [shard_tensor("tok_embeddings.weight", names["tok_embeddings.weight"].detach(), tp, r)
           for r in range(tp)]
    assert [e.shape[0] for e in emb] == [128] * 4  # 509 padded to 512
    assert torch.equal(emb[3][-3:], torch.zeros(3, 64))  # the padding rows are zeros
    wk = [shard_tensor("layers.0.attention.wk.weight", names["layers.0.attention.wk.weight"]
                       .detach(), tp, r) for r in range(tp)]
    assert [w.shape for w in wk] == [(8, 64)] * 4  # one kv head of width 8 per rank
    assert split_dim("layers.0.attention.wo.weight") == 1
    assert split_dim("layers.0.mlp.w2.weight") == 1
    assert split_dim("layers.0.attention.wq.bias") == 0
    assert split_dim("norm.weight") is None
