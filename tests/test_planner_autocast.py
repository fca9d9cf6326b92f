"""The planner's activation count where the runtime keeps fp32 weights under autocast (the
plain, LOMO, GaLore and PipeDream-2BW update paths, fivefold.planner.activations_autocast),
and the MoE router's fp32 weight copy a compute-dtype model saves
(fivefold.planner.activations.moe_saved_constant), against what autograd saves
(fivefold.memory.activation_count), per block and for the root. Tolerance 0: the counts are
exact to the byte on the CPU. A warm-up forward and backward runs first, so the
grouped-matmul probe the first MoE forward runs (fivefold.models.expert_matmul, cached for
the process) is not in the count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import load_config
from fivefold.memory.activation_count import SavedActivations
from fivefold.memory.recompute import apply_full_recompute, apply_selective_recompute
from fivefold.models.llama import build_model
from fivefold.planner.activations import block_saved_bytes, root_saved_bytes
from fivefold.hardware import PROFILES
from fivefold.parallel.plan import plan_from_config, training_plan
from fivefold.planner.activations_autocast import autocast_block_bytes, autocast_root_bytes
from fivefold.planner.rank_memory import predicted_rank_memory
from fivefold.planner.search import FastScorer
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare

MOE = ["model.moe.experts=4", "model.moe.expert_ffn_hidden=48", "model.moe.shared_experts=1",
       "model.moe.aux_loss_weight=0.01", "model.moe.z_loss_weight=0.001"]

CASES = [  # (overrides, autocast dtype)
    ([], torch.bfloat16),
    ([], torch.float16),
    (["model.ffn_type='gelu'"], torch.bfloat16),
    (["model.kv_heads=4", "model.tied_embeddings=false", "model.qkv_bias=true"], torch.float16),
    (MOE, torch.bfloat16),
    (["parallel.recompute='full'"], torch.bfloat16),
    (["parallel.recompute='selective'"], torch.float16),
]


def _count(model, cfg, dtype, batch=3):
    """Saved bytes by label of one forward under autocast at `dtype`, and the resident
    bytes at its end; a warm-up pass first (module docstring)."""
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))

    def loss():
        with torch.autocast("cpu", dtype=dtype):
            logits = model(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    loss().backward()
    labels = {f"layers.{i}": block for i, block in enumerate(model.layers)}
    with SavedActivations(model, labels) as acts:
        out = loss()
    del out
    return acts, batch * cfg.seq_len


@pytest.mark.parametrize("sets, dtype", CASES)
def test_fp32_weights_under_autocast_save_what_the_planner_counts(sets, dtype, tiny_overrides):
    """The fp32 model under autocast, as Trainer.autocast runs it off the engine: each block
    and the root equal block_saved_bytes / root_saved_bytes at the autocast dtype plus the
    autocast terms, to the byte; the resident bytes at the forward's end equal the count
    (the selective cache included)."""
    whole = load_config(None, tiny_overrides + sets)
    cfg, recompute = whole.model, whole.parallel.recompute
    model = build_model(cfg, seed=0)
    if recompute == "full":
        apply_full_recompute(model.layers)
    elif recompute == "selective":
        apply_selective_recompute(model.layers)
    acts, n = _count(model, cfg, dtype)
    for i in range(cfg.layers):
        want = (block_saved_bytes(cfg, n, 2, recompute=recompute, layer=i)
                + autocast_block_bytes(cfg, n, 2, recompute, i))
        assert acts.bytes_by_label[f"layers.{i}"] == want, i
    assert acts.bytes_by_label["root"] == root_saved_bytes(cfg, n, 2) + autocast_root_bytes(
        cfg, n, 2)
    assert acts.resident_bytes == acts.total_bytes


def test_compute_dtype_moe_saves_the_router_weight_copy(tiny_overrides):
    """The model cast to bf16, as the data-parallel engine holds it: the router's
    `weight.float()` is a new fp32 tensor its linear saves (4 x experts x width bytes per
    MoE layer), which block_saved_bytes counts, to the byte."""
    cfg = load_config(None, tiny_overrides + MOE).model
    acts, n = _count(build_model(cfg, seed=0).to(torch.bfloat16), cfg, torch.bfloat16)
    for i in range(cfg.layers):
        assert acts.bytes_by_label[f"layers.{i}"] == block_saved_bytes(cfg, n, 2, layer=i), i
    assert acts.bytes_by_label["root"] == root_saved_bytes(cfg, n, 2)


@pytest.mark.parametrize("sets", [["parallel.precision='bf16'"], ["parallel.precision='fp16'"],
                                  ["parallel.precision='bf16'", *MOE]])
def test_simulate_and_plan_count_them_on_one_gpu(sets):
    """`simulate` and `plan`'s fast pass price a one-GPU layout as the runtime trains it (the
    plain path: fp32 weights under autocast, Stack.autocast_fp32_weights): one micro-batch's
    activations equal the memory report's prediction (fivefold.planner.rank_memory) to the
    byte, as are its model-state rows (fp32 weights and gradients, no master copies), and
    under ZeRO-1 (the engine, compute-dtype weights) the activations are less by autocast's
    terms exactly, in simulate and in the fast pass."""
    base = ["model.preset='1B'", "model.layers=4", "cluster.gpus=1", "cluster.gpu='H100-SXM'",
            "parallel.global_batch=2", "parallel.micro_batch=1", "model.seq_len=1024", *sets]
    cfg = prepare(load_config(None, base))
    est, lay = simulate(cfg), training_plan(cfg, 1, "cuda")
    assert lay.update == "plain"
    rows = predicted_rank_memory(cfg, lay, 0, "cuda")
    report = rows["activations_per_micro_batch"]
    assert est.memory_per_gpu_bytes["activations"] == int(report)
    for key in ("params", "grads", "optimizer"):  # fp32 weights and gradients, no masters
        assert est.memory_per_gpu_bytes[key] == rows[key], key
    n, a = lay.micro_batch * cfg.model.seq_len, 2
    extra = sum(autocast_block_bytes(cfg.model, n, a, "none", i) for i in range(4)) + \
        autocast_root_bytes(cfg.model, n, a)
    engine = simulate(prepare(load_config(None, base + ["parallel.zero_stage=1"])))
    assert engine.memory_per_gpu_bytes["activations"] == int(report - extra)
    scorer, plain = FastScorer(cfg, PROFILES["H100-SXM"]), plan_from_config(cfg, 1)
    peaks = [scorer.score(lay)[1] for lay in (plain, plain.replace(zero_stage=1))]
    assert peaks[0] - peaks[1] == pytest.approx(extra, rel=1e-9)
