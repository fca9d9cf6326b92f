"""The simulator's terms for what published stacks did differently (issue 20): torch's
all-gather context parallelism (torchtitan), DeepSpeed 2021's per-tensor ZeRO-3 gathers
and reduce-scatters, the gradient-reduction stream over model chunks, Megatron-LM 2021's
exposed tensor-parallel all-reduces, torchtitan's ZeRO-3 blocks kept gathered through a
pipelined step, the routed experts' gradient group and busiest-rank timing, and the search
over virtual pipeline stages (the stacks' tensor-parallel and fp8 traffic:
tests/test_planner_tp_stacks.py).

Each formula is held against an independent count on a tiny case (exact up to float
rounding, rel 1e-9), and the "fivefold" stack is shown not to take any of them, so that its
predictions stay the runtime's (tests/test_planner_ledger.py and friends hold those).
"""

from __future__ import annotations

import pytest
import torch

from fivefold.hardware import PROFILES
from fivefold.models.description import block_parameters
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.comm import Group, Links
from fivefold.planner.compute import attention_time, torch_cp_merge_bytes
from fivefold.planner.fitted import FITTED, Fitted, in_training
from fivefold.planner.params import block_params, local_numel
from fivefold.planner.search import exact_estimate
from fivefold.planner.search_space import candidates
from fivefold.planner.simulate import simulate
from fivefold.planner.step import LayoutStep
from fivefold.planner.spec import spec_config
from fivefold.kernel_tables import FLASH2_RATE_H100
from fivefold.planner.stack import FIVEFOLD, STACKS

H100 = PROFILES["H100-SXM"]
# The stack mechanisms below (which collectives a stack exposes) are checked at an overlap
# efficiency below one: the 140-row fit puts overlap_eff at its upper bound of 1, where every
# collective that runs behind enough compute hides completely and the mechanisms' exposed
# seconds all read zero, whatever the stack does.
PARTIAL_OVERLAP = Fitted(**{**FITTED.as_dict(), "overlap_eff": 0.85})


def _cfg(stack: str, gpus: int = 8, gpn: int = 8, **parallel):
    return spec_config({
        "model": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512,
                  "vocab": 1024, "seq_len": 4096},
        "cluster": {"gpu": "H100-SXM", "gpus": gpus, "gpus_per_node": gpn},
        "parallel": {"global_batch": 8, "micro_batch": 1, **parallel},
        "train": {"stack": stack}})


def _walk_torch_cp_bytes(out: float, kv: float, cp: int, a: int) -> tuple[float, float]:
    """Bytes of torch's `_templated_ring_attention` (and backward) for the last rank, walked
    step by step as the loop runs: every op's reads and writes, one line per op."""
    fwd = bwd = 0.0
    for i in range(cp):
        fwd += a * out + 4 * out  # step(): block output to fp32
        if i > 0:
            fwd += (4 + 4 + 4) * out  # out - block_out
            fwd += (4 + 4) * out  # sigmoid(...) * (out - block_out)
            fwd += (4 + 4 + 4) * out  # out - that
        if i < cp - 1:
            fwd += 2 * (a * kv + a * kv)  # torch.cat([key, value]) to send
    fwd += 4 * out + a * out  # results(): back to the output dtype
    bwd += 4 * out + 4 * kv + 4 * kv  # zeros_like(q/k/v, float32)
    for i in range(cp):
        if i != cp - 1:
            bwd += 2 * (a * kv + a * kv)  # torch.cat([key, value]) to send
        if i == 0:
            bwd += 2 * (4 * kv + a * kv + 4 * kv)  # grad_key += grad_key_ (and value)
        else:  # _partial_update(add=True): half updated in place, then torch.cat
            bwd += 2 * ((4 + a + 4) * kv / 2 + (4 + 4) * kv)
        bwd += 2 * (4 * kv + 4 * kv)  # torch.cat of the fp32 dK, dV to send
        bwd += (4 + a + 4) * out  # grad_query += grad_query_
    bwd += (4 + a) * out + 2 * (4 + a) * kv  # casts back to the input dtype
    return fwd, bwd


@pytest.mark.parametrize("cp, a", [(2, 2), (4, 2), (8, 4)])
def test_torch_cp_merge_bytes_match_a_walk_of_torchs_loop(cp, a):
    out, kv = 3 * 64 * 128, 3 * 16 * 128
    assert torch_cp_merge_bytes(out, kv, cp, a) == pytest.approx(
        _walk_torch_cp_bytes(out, kv, cp, a), rel=1e-12)


def test_allgather_cp_exposes_what_only_its_first_step_hides():
    """cp = 4 across four nodes (one rank each): the forward's K/V all-gather against
    the first of four attention steps; backward adds the second all-gather and the fp32
    dK/dV passes, each behind one step, the last one bare. K/V repeated to 8 heads."""
    cfg = _cfg("torchtitan", gpus=4, gpn=1, cp=4, cp_mode="ring", zero_stage=1)
    sm = LayoutStep(cfg, H100, plan_from_config(cfg, 4))
    prof = in_training(H100)
    links = Links.of(prof, 1)
    n, d, hide = 1024, 32, prof.eff.overlap_eff  # local tokens, head dim, overlap
    kv_bytes = 2 * n * 8 * d * 2  # this rank's K and V, repeated to the 8 query heads
    # ring all-gather over 4 nodes, each on its own NIC: 3 of 4 shards in, 3 hops
    ag = 3 / 4 * 4 * kv_bytes / links.inter_Bps + 3 * links.latency_inter_s
    dkv = 2 * n * 8 * d * 4 / links.inter_Bps + links.latency_inter_s
    fa2 = FLASH2_RATE_H100  # torchtitan's FlashAttention-2-class kernel on Hopper
    at_f, at_b = attention_time(1, 8, 4096, d, 4, prof, True, "bf16", fa2, False)
    fwd, bwd = sm.cp_exposed(False)

    def behind(c, w):
        return max(c - hide * w, (1 - hide) * c)
    assert fwd == pytest.approx(behind(ag, at_f / 4), rel=1e-9)
    assert bwd == pytest.approx(behind(ag, at_b / 4) + 3 * behind(dkv, at_b / 4) + dkv,
                                rel=1e-9)


def test_allgather_cp_costs_more_than_the_ring_and_fivefold_keeps_the_ring():
    mine = simulate(_cfg("fivefold", gpus=8, gpn=2, cp=4, cp_mode="ring", zero_stage=1))
    tt_switches = STACKS["torchtitan"]
    assert (tt_switches.cp_kv_exchange, tt_switches.sdpa_repeats_kv) == ("allgather", True)
    assert (FIVEFOLD.cp_kv_exchange, FIVEFOLD.sdpa_repeats_kv) == ("ring", False)
    ring = LayoutStep(_cfg("fivefold", gpus=8, gpn=2, cp=4, cp_mode="ring", zero_stage=1),
                     H100, mine.layout, fit=PARTIAL_OVERLAP)
    gathered = LayoutStep(_cfg("torchtitan", gpus=8, gpn=2, cp=4, cp_mode="ring",
                              zero_stage=1), H100, mine.layout, fit=PARTIAL_OVERLAP)
    assert sum(gathered.cp_exposed(False)) > sum(ring.cp_exposed(False)) > 0


def test_deepspeed_zero3_gathers_each_tensor_on_the_critical_path():
    cfg = _cfg("deepspeed", gpus=8, zero_stage=3, recompute="full")
    lay = plan_from_config(cfg, 8)
    sm = LayoutStep(cfg, H100, lay)
    prof = in_training(H100)
    links = Links.of(prof, 8)
    # norms stay whole (persistence threshold); each gathered tensor's list gather copies
    # the flat result back with one kernel per rank (fivefold.planner.stack)
    ds = STACKS["deepspeed"]
    assert (ds.zero3_persist_numel, ds.zero3_list_gather) == (100_000, True)
    gathered = [p for p in block_parameters(cfg.model, 0)
                if local_numel(cfg.model, p) >= ds.zero3_persist_numel]
    assert 0 < len(gathered) < len(block_parameters(cfg.model, 0))
    one = sum(7 / 8 * local_numel(cfg.model, p) * 2 / links.intra_Bps
              + 7 * links.latency_intra_s + 8 * prof.eff.kernel_overhead_s for p in gathered)
    assert sm.tensor_collectives_s(False, "all_gather") == pytest.approx(one, rel=1e-9)
    _, f_comm, _ = sm.core_cost(False)
    cost = sm.dense_cost
    assert cost.f_comm - f_comm == pytest.approx(one, rel=1e-9)  # nothing hidden
    # gradients: a list reduce-scatter per tensor (its flatten copies one kernel per rank),
    # hidden only behind the block's own backward (the next gather synchronises the device)
    rs = sum(7 / 8 * local_numel(cfg.model, p) * 2 / links.intra_Bps
             + 7 * links.latency_intra_s + 8 * prof.eff.kernel_overhead_s for p in gathered)
    assert sm.tensor_collectives_s(False, "reduce_scatter") == pytest.approx(rs, rel=1e-9)
    # the FSDP-style stacks prefetch: the same layout exposes less
    fsdp = LayoutStep(_cfg("fivefold", gpus=8, zero_stage=3, recompute="full"), H100, lay)
    assert fsdp.dense_cost.f_comm < cost.f_comm
    assert FIVEFOLD.zero3_overlap and not STACKS["deepspeed"].zero3_overlap
    assert Group.strided(8, 1, 8) == sm.shard_group


def test_plan_searches_interleaved_virtual_stages():
    cfg = _cfg("fivefold", gpus=4, pp=2)
    lays = candidates(cfg, plan_from_config(cfg, 4))
    inter = [lay for lay in lays if lay.vpp > 1]
    assert {lay.vpp for lay in inter} == {2} and all(lay.schedule == "interleaved"
                                                    for lay in inter)
    est = exact_estimate(cfg, H100, inter[0], {})
    assert est is not None and est.layout.vpp == 2 and len(est.stage_layers) == 4


def test_fivefold_ring_is_timed_as_its_math_kernel():
    """fivefold's ring runs block_attention's explicit fp32 path on every device: its step
    is timed by the math model (fp32 matmuls, eager element-wise ops), slower than a fused
    ring of the same layout; the chunk size the model assumes is the runtime's, on a GPU and
    on the CPU, and so are the scores of a diagonal block, whose chunks stop at their last
    row's keys."""
    from fivefold.parallel.context.block_attention import (_row_chunks, _scores,
                                                           query_chunk_rows, visible_keys)
    from fivefold.planner.op_prices import (diagonal_masked, diagonal_scores,
                                            math_ring_attention_time, ring_query_rows)
    for batch_heads, keys in [(32, 512), (32, 256), (1, 64), (64, 4096), (4096, 4096)]:
        for prof, device in [(H100, "cuda"), (PROFILES["cpu"], "cpu")]:
            assert (ring_query_rows(prof, batch_heads, keys)
                    == query_chunk_rows(device, batch_heads, keys, 4))
        q = torch.empty(1, batch_heads, keys, 1)  # the CPU runtime's own chunks
        chunks = _row_chunks(q, keys, torch.float32)
        assert diagonal_scores(ring_query_rows(PROFILES["cpu"], batch_heads, keys), keys) == sum(
            (c.stop - c.start) * visible_keys(c, keys, True).stop for c in chunks)
    assert diagonal_scores(128, 512) == 128 * (128 + 256 + 384 + 512)
    q = torch.randn(1, 70, 300, 8)  # the -inf scores the CPU runtime's 99-row chunks compute
    rows = ring_query_rows(PROFILES["cpu"], 70, 300)
    masked = sum(int(torch.isinf(_scores(q[:, :, c], q[:, :, visible_keys(c, 300, True)], True,
                                         1.0, torch.float32, c.start)).sum())
                 for c in _row_chunks(q, 300, torch.float32))
    assert rows == 99 and masked == 70 * diagonal_masked(rows, 300)
    assert FIVEFOLD.ring_kernel == "math" and STACKS["megatron"].ring_kernel == "fused"
    mf, mb = math_ring_attention_time(1, 8, 2, 4096, 32, 4, H100)
    ff, fb = attention_time(1, 8, 4096, 32, 4, H100, True, "bf16")
    assert mf > ff and mb > fb
    # diagonal block whole, then cp - 1 half blocks: (cp + 1) / 2 of T^2 scores per head
    one, two = (math_ring_attention_time(1, 8, 2, 4096 * k, 32, 2 * k, PROFILES["cpu"])[0]
                for k in (1, 2))
    assert two > one  # twice the ring, twice the sequence: more scores per rank
    ring = simulate(_cfg("fivefold", cp=4, cp_mode="ring"))
    fused = simulate(_cfg("megatron", cp=4, cp_mode="ring"))
    assert ring.breakdown_s["compute"] > fused.breakdown_s["compute"]


def _slow_network(**parallel):
    """A layout whose gradient reductions cross a very slow network: the stream is the
    bottleneck, so what hides is exactly the compute it runs behind."""
    return spec_config({
        "model": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512,
                  "vocab": 1024, "seq_len": 4096},
        "cluster": {"gpu": "H100-SXM", "gpus": 16, "gpus_per_node": 1,
                    "inter_node_GBps": 0.01},
        "parallel": {"global_batch": 16, "micro_batch": 1, "pp": 2, "zero_stage": 1,
                     **parallel},
        "train": {"stack": "megatron"}})


def test_gradient_reduction_stream_hides_early_chunks_behind_later_ones():
    cfg = _slow_network(schedule="1f1b")
    sm = LayoutStep(cfg, H100, plan_from_config(cfg, 16))
    rp = sm.run_pipeline(False)
    hide = sm.prof.eff.overlap_eff
    # one model chunk: its blocks finish in reverse order, evenly over its last backward, and
    # the stream starts with the first one: the rest of that backward hides the reductions,
    # each second of it slowed by their contention (fivefold.planner.events)
    for r in range(2):
        (start, end), = rp.last_grads[r].values()
        blocks = [sm._coll("reduce_scatter", sm.layer_cost(i).grad_sync_bytes,
                           sm.shard_group) for i in sm.stage_ranges[r]]
        assert min(blocks) > end - start
        window = (end - start) * (1 - 1 / len(blocks))
        assert sm.grad_sync_tail_s(r, "reduce_scatter", rp.last_grads[r]) == pytest.approx(
            sum(blocks) - hide * window, rel=1e-9)
    # two chunks per rank: the chunk that finishes first reduces behind the other's backward
    inter = _slow_network(vpp=2, schedule="interleaved")
    ism = LayoutStep(inter, H100, plan_from_config(inter, 16))
    chunks = ism.run_pipeline(False).last_grads[0]
    assert chunks[2][1] < chunks[0][0]  # virtual stage 2 (chunk 1) finishes its gradients first
    own = sum((e - s) * (1 - 1 / len(ism.stage_ranges[g])) for g, (s, e) in chunks.items())
    total = sum(ism.block_sync_s("reduce_scatter", i) for g in chunks
                for i in ism.stage_ranges[g])
    assert ism.grad_sync_tail_s(0, "reduce_scatter", chunks) < total - hide * own


def test_megatron_2021_exposes_its_tensor_parallel_all_reduces():
    assert STACKS["megatron"].tp_overlap_since == "2023-05"
    assert not FIVEFOLD.overlaps_tp

    def megatron(release: str):
        return spec_config({
            "model": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2,
                      "ffn_hidden": 512, "vocab": 1024, "seq_len": 4096},
            "cluster": {"gpu": "H100-SXM", "gpus": 8, "gpus_per_node": 8},
            "parallel": {"global_batch": 8, "micro_batch": 1, "tp": 8,
                         "sequence_parallel": True},  # tp_overlap needs it (stack.py)
            "train": {"stack": "megatron", "stack_release": release}})

    new, old = megatron("2025-11"), megatron("2021-04")
    lay = plan_from_config(new, 8)
    hidden = LayoutStep(new, H100, lay, fit=PARTIAL_OVERLAP).dense_cost
    exposed = LayoutStep(old, H100, lay, fit=PARTIAL_OVERLAP).dense_cost
    assert exposed.f_comm > hidden.f_comm > 0


def test_torchtitan_keeps_zero3_blocks_gathered_through_a_pipelined_step():
    from fivefold.planner.params import block_params, root_params
    from fivefold.planner.schedules import action_durations
    from fivefold.parallel.pipeline.schedules import Action
    assert STACKS["torchtitan"].zero3_pp_unsharded and not FIVEFOLD.zero3_pp_unsharded
    spec = dict(gpus=8, pp=2, zero_stage=3, global_batch=16, micro_batch=1,
                schedule="1f1b", reduce_dtype="fp32")
    tt_cfg, ff_cfg = _cfg("torchtitan", **spec), _cfg("fivefold", **spec)
    lay = plan_from_config(tt_cfg, 8)
    tt = LayoutStep(tt_cfg, H100, lay, fit=PARTIAL_OVERLAP)
    ff = LayoutStep(ff_cfg, H100, lay, fit=PARTIAL_OVERLAP)
    assert tt.pp_unsharded and not ff.pp_unsharded
    # no gathers per micro-batch; once a step: behind the first forward and the last backward
    assert tt.dense_cost.f_comm < ff.dense_cost.f_comm
    first, last = tt.stage_once(0)
    assert first > 0 and last > 0 and ff.stage_once(0) == (0.0, 0.0)
    duration = action_durations([tt.stage_times(0)], 1, 4, [(first, last)])
    f, b = tt.stage_times(0)[:2]
    assert duration(Action("F", 0, 0)) == pytest.approx(f + first)
    assert duration(Action("F", 0, 1)) == pytest.approx(f)
    assert duration(Action("B", 0, 3)) == pytest.approx(b + last)
    assert duration(Action("B", 0, 2)) == pytest.approx(b)
    # memory: the rank's blocks and root stay unsharded, parameters and fp32 gradients
    m = tt_cfg.model
    unsharded = (sum(sum(block_params(m, i, 1, 1)) for i in tt.rank_layers(0))
                 + root_params(m, 1, True, False))
    extra = tt.other_bytes(0) - tt.prof.eff.reserved_bytes
    assert extra == pytest.approx(unsharded * (2 + 4))


def _moe_spec(stack: str, ep: int, gpus: int = 16, gpn: int = 8) -> dict:
    return {
        "model": {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 2, "ffn_hidden": 512,
                  "vocab": 1024, "seq_len": 1024,
                  "moe": {"experts": 16, "top_k": 2, "expert_ffn_hidden": 512}},
        "cluster": {"gpu": "H100-SXM", "gpus": gpus, "gpus_per_node": gpn},
        "parallel": {"global_batch": 16, "micro_batch": 1, "ep": ep, "zero_stage": 1},
        "train": {"stack": stack}}


def _moe_cfg(stack: str, ep: int, gpus: int = 16, gpn: int = 8):
    return spec_config(_moe_spec(stack, ep, gpus, gpn))


@pytest.mark.parametrize("stack", ["fivefold", "megatron"])
def test_routed_experts_sync_over_their_expert_data_parallel_group(stack):
    """A block's routed experts are data-parallel over the dp / ep ranks that hold the same
    experts (fivefold.parallel.expert's edp axis), ep apart, so only they reduce them; the
    rest of the block reduces over all dp ranks."""
    sm = LayoutStep(_moe_cfg(stack, 4), H100, plan_from_config(_moe_cfg(stack, 4), 16))
    assert (sm.shard_group.size, sm.expert_shard_group.size) == (16, 4)
    assert sm.expert_shard_group.per_node == 2  # ep = 4 apart: two of them on each node
    dense, expert = block_params(sm.model, 0, 1, 4)
    assert sm.block_numels(True) == (dense, expert) and expert > 0
    alone = sm._coll("reduce_scatter", 2 * dense, sm.shard_group)
    assert sm.block_sync_s("reduce_scatter", 0) == pytest.approx(
        alone + sm._coll("reduce_scatter", 2 * expert, sm.expert_shard_group), rel=1e-9)
    # ep = dp: every rank holds experts no other rank has, and nothing syncs them
    full = LayoutStep(_moe_cfg(stack, 16), H100, plan_from_config(_moe_cfg(stack, 16), 16))
    assert full.expert_shard_group.size == 1
    dense16 = block_params(full.model, 0, 1, 16)[0]
    assert full.block_sync_s("reduce_scatter", 0) == pytest.approx(
        full._coll("reduce_scatter", 2 * dense16, full.shard_group), rel=1e-9)


def test_experts_and_all_to_alls_are_timed_at_the_busiest_ranks_load():
    """`model.moe.rank_imbalance` x: every all-to-all waits for the busiest ep rank, so a MoE
    block's expert GEMMs run x times the mean's routed rows and its dispatch/combine move x
    times the mean's bytes; capped at ep, and without expert parallelism it is 1."""
    from fivefold.config import ConfigError
    from fivefold.planner.compute import Gemm, block_gemms, eltwise_time, gemm_time
    from fivefold.planner.block_cost import expert_load

    def step_model(ep: int, imbalance: float) -> LayoutStep:
        cfg = _moe_cfg("fivefold", ep)
        cfg.model.moe.rank_imbalance = imbalance
        return LayoutStep(cfg, H100, plan_from_config(cfg, 16))

    flat, busy = step_model(4, 1.0), step_model(4, 1.5)
    assert (flat.shard.expert_load, busy.shard.expert_load) == (1.0, 1.5)
    n, D, F = 1024, 256, 512
    mlp_flat, mlp_busy = (block_gemms(sm.model, sm.shard, True)[1] for sm in (flat, busy))
    for g_flat, g_busy in zip(mlp_flat, mlp_busy):
        routed = g_flat.name.startswith("expert.")
        assert (g_flat.m, g_busy.m) == ((2 * n, 3 * n) if routed else (n, n))
    prof = busy.prof
    expert_s = sum(gemm_time(Gemm(name, 3 * n, k, m), prof, False, 2)
                   - gemm_time(Gemm(name, 2 * n, k, m), prof, False, 2)
                   for name, k, m in [("w1", D, F), ("w3", D, F), ("w2", F, D)])
    # the busier rank's element-wise work: the SwiGLU (3 F wide) and the row permutes (2 D)
    # of its extra top_k x 0.5 rows a token
    eltwise_s = eltwise_time(2 * n * (3 * F + 2 * D), prof, 0, busy.shard.passes(prof))
    t_flat, f_flat, _ = flat.core_cost(True)
    t_busy, f_busy, _ = busy.core_cost(True)
    assert t_busy.fwd - t_flat.fwd == pytest.approx(expert_s + eltwise_s, rel=1e-9)
    a2a = 2 * busy._coll("all_to_all", n * 2 * D * 2 * 1.5, busy.ep_group)
    counts = busy._coll("all_to_all", 16 * 8, busy.ep_group)  # an int64 per expert, forward
    assert f_busy == pytest.approx(a2a + counts, rel=1e-9)
    flat_a2a = 2 * flat._coll("all_to_all", n * 2 * D * 2, flat.ep_group)
    assert f_flat == pytest.approx(flat_a2a + counts, rel=1e-9)  # the counts do not scale
    assert expert_load(step_model(4, 9.0).model, 4) == 4.0  # all rows on one rank at most
    assert step_model(1, 1.5).shard.expert_load == 1.0  # every rank holds every expert
    below_balance = _moe_spec("fivefold", 4)
    below_balance["model"]["moe"]["rank_imbalance"] = 0.5
    with pytest.raises(ConfigError, match="model.moe.rank_imbalance"):
        spec_config(below_balance)
