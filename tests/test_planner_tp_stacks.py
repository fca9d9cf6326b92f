"""How each published stack runs tensor parallelism and its fp8 traffic: Megatron's
Transformer Engine ring-exchange chunks (tp_overlap_chunks) and its fp8 parameter re-gather
from 2024-09, torchtitan's torchao casts on the sequence shard, and each stack's fp8
sequence-parallel gather width. Each formula is held against an independent count on a tiny
case (exact up to float rounding, rel 1e-9 unless stated), and the "fivefold" stack is shown
not to take them.
"""

from __future__ import annotations

import pytest

from fivefold.hardware import PROFILES
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.params import root_params
from fivefold.planner.spec import spec_config
from fivefold.planner.stack import FIVEFOLD, STACKS
from fivefold.planner.step import LayoutStep

H100 = PROFILES["H100-SXM"]


def _megatron_tp(release: str, tp: int = 4, **parallel):
    return spec_config({
        "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1024,
                  "vocab": 1024, "seq_len": 2048},
        "cluster": {"gpu": "H100-SXM", "gpus": 8, "gpus_per_node": 8},
        "parallel": {"global_batch": 8, "micro_batch": 1, "tp": tp,
                     **{"sequence_parallel": True, **parallel}},
        "train": {"stack": "megatron", "stack_release": release}})


def test_megatron_tp_overlap_runs_its_gemms_as_ring_exchange_chunks():
    """Under Transformer Engine's ring exchange each TP-overlapped GEMM is tp GEMMs of 1/tp
    of the rows: forward for all seven of a Llama block, input gradients for wo and w2; the
    weight gradients and the other input gradients stay whole. Before TP overlap (TE v0.9,
    2023-05) and under the fivefold stack the GEMMs are whole."""
    from fivefold.planner.compute import (Gemm, ROW_PARALLEL, TP_RING_FORWARD,
                                          block_gemms, block_times, gemm_time)
    new, old = _megatron_tp("2023-05"), _megatron_tp("2023-04")
    sm_new, sm_old = (LayoutStep(c, H100, plan_from_config(c, 8)) for c in (new, old))
    t_new = block_times(sm_new.model, sm_new.shard, sm_new.prof, False)
    t_old = block_times(sm_old.model, sm_old.shard, sm_old.prof, False)
    attn, mlp = block_gemms(sm_new.model, sm_new.shard, False)
    whole = chunks = 0.0
    for g in attn + mlp:
        assert g.name in TP_RING_FORWARD
        part = Gemm(g.name, g.m // 4, g.k, g.n)
        n = 2 if g.name in ROW_PARALLEL else 1
        whole += n * gemm_time(g, sm_new.prof, False, 2)
        chunks += n * 4 * gemm_time(part, sm_new.prof, False, 2)
    assert chunks > whole
    assert t_new.fwd + t_new.bwd - (t_old.fwd + t_old.bwd) == pytest.approx(chunks - whole,
                                                                           rel=1e-9)
    assert t_new.wgrad == pytest.approx(t_old.wgrad, rel=1e-12)
    assert not FIVEFOLD.tp_overlap_chunks


def test_megatron_fp8_regathers_one_byte_a_parameter_from_2024_09():
    """NeMo's fp8 recipes from 2024-09 gather fp8 parameters after the step: the
    distributed optimizer's re-gather of the blocks moves half the bytes of a bf16 one."""
    kw = dict(tp=1, dp=8, zero_stage=1, precision="fp8", sequence_parallel=False)
    new, old = _megatron_tp("2025-02", **kw), _megatron_tp("2024-03", **kw)
    assert STACKS["megatron"].fp8_param_gather_since == "2024-09"
    sm_new, sm_old = (LayoutStep(c, H100, plan_from_config(c, 8)) for c in (new, old))
    last = {0: (0.0, 1.0)}
    _, regather_new = sm_new.dp_sync(0, last)
    _, regather_old = sm_old.dp_sync(0, last)
    root = sm_new._coll("all_gather", root_params(sm_new.model, 1, True, True) * 2,
                        sm_new.shard_group)
    blocks = [sm_new.block_sync_s("all_gather", i) for i in range(2)]
    assert regather_old == pytest.approx(sum(blocks) + root, rel=1e-9)
    assert regather_new == pytest.approx(
        sum(sm_new.block_sync_s("all_gather", i, 0.5) for i in range(2)) + root, rel=1e-9)
    assert regather_new < regather_old


def _torchtitan_tp(stack: str = "torchtitan", release: str | None = None, **parallel):
    train = {"stack": stack, **({"stack_release": release} if release else {})}
    return spec_config({
        "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1024,
                  "vocab": 1024, "seq_len": 2048},
        "cluster": {"gpu": "H100-SXM", "gpus": 8, "gpus_per_node": 8},
        "parallel": {"global_batch": 8, "micro_batch": 1, "tp": 4, "sequence_parallel": True,
                     "precision": "fp8", "recompute": "none", **parallel},
        "train": train})


def test_torchtitan_fp8_casts_each_module_input_once_on_its_shard():
    """torchao's Float8 tensor parallelism (torchtitan's TP plan): the attention and MLP
    inputs are cast once each on the 1/tp sequence shard before their fp8 all-gather, where
    a plain Float8Linear casts its whole gathered input in each of wq, wk, wv, w1 and w3;
    wo's and w2's output gradients are cast on their shards. Against an independent count
    of the bytes that saves: forward (2a + 1) n D (5 - 2/tp), backward (2a + 1) 2 n D
    (1 - 1/tp), over n gathered tokens of width D (exact)."""
    import dataclasses

    from fivefold.planner.compute import block_times, eltwise_time
    cfg = _torchtitan_tp()
    sm = LayoutStep(cfg, H100, plan_from_config(cfg, 8))
    assert sm.stack.fp8_shard_casts and not FIVEFOLD.fp8_shard_casts
    per_linear = dataclasses.replace(sm.shard,
                                     stack=dataclasses.replace(sm.stack, fp8_shard_casts=False))
    shard = block_times(sm.model, sm.shard, sm.prof, False)
    whole = block_times(sm.model, per_linear, sm.prof, False)
    n, D, tp, cast = 2048, 512, 4, 2 * 2 + 1
    assert whole.fwd - shard.fwd == pytest.approx(
        eltwise_time(cast * n * D * (5 - 2 / tp), sm.prof, 0, 1.0), rel=1e-9)
    assert whole.bwd - shard.bwd == pytest.approx(
        eltwise_time(cast * 2 * n * D * (1 - 1 / tp), sm.prof, 0, 1.0), rel=1e-9)
    no_sp = LayoutStep(c := _torchtitan_tp(tp=4, sequence_parallel=False), H100,
                      plan_from_config(c, 8))
    assert no_sp.shard.stack.fp8_shard_casts and not no_sp.shard.sp  # no shard to cast on


@pytest.mark.parametrize("stack, release, width", [("fivefold", None, 2),
                                                   ("torchtitan", None, 1),
                                                   ("megatron", "2023-04", 1)])
def test_fp8_sequence_parallel_gather_width_is_the_stacks(stack, release, width):
    """Under fp8 Transformer Engine and torchao all-gather a region's fp8 input (one byte an
    element); fivefold's runtime gathers the compute dtype, as its ledger records. (Megatron
    before its TP overlap, so that the collectives are on the critical path; exact.)"""
    cfg = _torchtitan_tp(stack, release)
    sm = LayoutStep(cfg, H100, plan_from_config(cfg, 8))
    assert not sm.stack.overlaps_tp
    act = 2048 * 512 * 2
    ag = sm._coll("all_gather", act * width / 2, sm.tp_group)
    _, f_comm, _ = sm.core_cost(False)
    assert f_comm == pytest.approx(2 * (ag + sm._coll("reduce_scatter", act, sm.tp_group)),
                                   rel=1e-9)
    assert sm.stack.fp8_sp_gather == (width == 1)
