"""The planner and simulator: memory, compute and communication formulas, schedules, the
layer partition, the search and validation against published runs (the CLI:
tests/test_planner_cli.py; profiles from measurements: tests/test_planner_calibration.py).

Formula tests compare against closed forms written out in the test (ZeRO's table, the ring
volumes, the pipeline bubble), so a change to a model shows up as a changed number.
Tolerances are float rounding (1e-9 relative) unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fivefold.config import load_config
from fivefold.hardware import PROFILES
from fivefold.models.flops import flops_per_token, param_count
from fivefold.parallel.pipeline.partition import balanced_counts
from fivefold.parallel.pipeline.schedules import B
from fivefold.parallel.plan import PRECISION_BYTES, plan_from_config
from fivefold.planner import calibrate as cal
from fivefold.planner.comm import Group, Links, collective_time
from fivefold.planner.compute import Gemm, attention_time, gemm_time
from fivefold.planner.memory import Unit, model_state_bytes, stage_units
from fivefold.planner.params import total_params
from fivefold.planner.schedules import bubble_fraction, replay_step, runtime_schedule
from fivefold.planner.search import search
from fivefold.planner.search_space import candidates
from fivefold.planner.simulate import model_flops_per_token, simulate
from fivefold.planner.spec import spec_config
from fivefold.planner.validation import mape, read_runs, validate_runs
from fivefold.validate import validate

from planner_specs import BREAKDOWN_FIELDS, MEMORY_FIELDS, OUTPUT_FIELDS, spec

H100 = PROFILES["H100-SXM"]


# ------------------------------------------------------------------ model sizes and FLOPs

@pytest.mark.parametrize("sets", [["model.preset='8B'"], ["model.preset='125M'"],
                                  ["model.preset='tiny'", "model.ffn_type='gelu'"],
                                  ["model.preset='70B'", "model.tied_embeddings=true"]])
def test_params_and_flops_match_the_model_package(sets):
    m = load_config(None, sets).model
    assert total_params(m) == param_count(m)
    assert model_flops_per_token(m, H100) == pytest.approx(flops_per_token(m), rel=1e-12)


# ------------------------------------------------------------------ memory (ZeRO, Sec. 5.1)

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_the_zero_table(stage):
    """bf16 compute, bf16 reduce, AdamW: 2/2/4+8 bytes per parameter, divided by n as the
    stage says (units sized to need no padding)."""
    cfg = load_config(None, ["parallel.precision='bf16'", f"parallel.zero_stage={stage}",
                             "cluster.gpus=8"])
    lay = plan_from_config(cfg, cfg.cluster.gpus)
    n = 8
    units = [Unit(8 * 1000, n if stage else 1), Unit(8 * 3000, n if stage else 1)]
    psi = 32000
    got = model_state_bytes(units, lay)
    assert got["params"] == 2 * psi // (n if stage == 3 else 1)
    assert got["grads"] == 2 * psi // (n if stage >= 2 else 1)
    assert got["master"] == 4 * psi // (n if stage >= 1 else 1)
    assert got["optimizer"] == 8 * psi // (n if stage >= 1 else 1)
    assert got["total"] == sum(got[k] for k in ("params", "grads", "master", "optimizer"))


def test_units_pad_to_the_shard_degree():
    assert Unit(10, 4).padded == 12 and Unit(10, 4).shard_numel == 3
    assert Unit(10, 4, multiple=256).padded == 1024


def test_pipeline_stage_units_hold_their_blocks_and_root():
    cfg = load_config(None, ["model.preset='8B'", "cluster.gpus=8", "parallel.pp=4"])
    lay = plan_from_config(cfg, cfg.cluster.gpus)
    m = cfg.model
    first = sum(u.numel for u in stage_units(m, lay, list(range(8)), True, False))
    last = sum(u.numel for u in stage_units(m, lay, list(range(24, 32)), False, True))
    table = m.vocab * m.hidden
    assert first - table == last - table - m.hidden  # same blocks; embedding vs norm + head


def test_pipedream_2bw_holds_two_weight_versions_three_with_prediction():
    """One step's gradients, two weight versions; weight prediction keeps the optimizer's
    masters apart from its two predicted versions (fivefold.parallel.pipeline.pipedream_2bw)."""
    base = ["cluster.gpus=4", "parallel.pp=2", "parallel.micro_batch=1"]
    units = [Unit(1000, 1), Unit(3000, 1)]
    got = {}
    for name, extra in [("1f1b", []), ("2bw", ["parallel.schedule='pipedream-2bw'"]),
                        ("2bw+wp", ["parallel.schedule='pipedream-2bw'",
                                    "parallel.weight_prediction=true"])]:
        cfg = load_config(None, base + extra)
        validate(cfg)
        got[name] = model_state_bytes(units, plan_from_config(cfg, cfg.cluster.gpus))
    one = got["1f1b"]["params"]
    assert one == 4000 * PRECISION_BYTES[plan_from_config(cfg, cfg.cluster.gpus).precision]
    assert [got[k]["params"] for k in ("2bw", "2bw+wp")] == [2 * one, 3 * one]
    assert got["2bw+wp"]["grads"] == got["1f1b"]["grads"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "galore", "sgd"])
def test_optimizer_state_matches_the_runtime(optimizer):
    """The planner's optimizer-state bytes on one rank equal, to the byte, what the runtime's
    optimizer holds after a step (its tensors, step counters aside): AdamW two fp32 moments,
    SGD one momentum, Muon one momentum on the blocks' matrices and AdamW's moments on the
    embedding and norm gains."""
    import torch

    from fivefold.models.llama import build_model
    from fivefold.optim import build_optimizer

    cfg = load_config(None, ["cluster.gpus=1", f"train.optimizer={optimizer}"])
    model = build_model(cfg.model, 0)
    opt = build_optimizer(model, cfg.train, torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    held = sum(t.numel() * t.element_size()
               for o in getattr(opt, "optimizers", [opt]) for state in o.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    lay = plan_from_config(cfg, cfg.cluster.gpus)
    units = stage_units(cfg.model, lay, list(range(cfg.model.layers)), True, True)
    assert model_state_bytes(units, lay)["optimizer"] == held


# ------------------------------------------------------------------ communication

LINKS = Links(intra_Bps=100e9, inter_Bps=10e9, latency_intra_s=1e-6, latency_inter_s=5e-6,
              gpus_per_node=8)


def test_ring_inside_a_node():
    s, n = 1e9, 8
    g = Group(n, n)
    assert collective_time("all_reduce", s, g, LINKS) == pytest.approx(
        2 * (n - 1) / n * s / 100e9 + 2 * (n - 1) * 1e-6)
    assert collective_time("all_gather", s, g, LINKS) == pytest.approx(
        (n - 1) / n * s / 100e9 + (n - 1) * 1e-6)
    assert collective_time("reduce_scatter", s, Group(1, 1), LINKS) == 0.0


def test_a_backends_measured_rate_for_an_op_divides_its_bandwidth_term():
    """gloo's reduce-scatter runs below the ring model's rate (`reduce_scatter_eff`): its
    bandwidth term, not its latency, is divided by that; the other ops keep theirs."""
    s, g = 1e9, Group(2, 2)
    slow = dataclasses.replace(LINKS, op_eff=(("reduce_scatter", 0.25), ("all_to_all", 0.5)))
    assert collective_time("reduce_scatter", s, g, slow) == pytest.approx(
        1 / 2 * s / (100e9 * 0.25) + 1e-6)
    assert collective_time("all_to_all", s, g, slow) == pytest.approx(
        1 / 2 * s / (100e9 * 0.5) + 1e-6)
    for op in ("all_reduce", "all_gather"):
        assert collective_time(op, s, g, slow) == collective_time(op, s, g, LINKS)
    prof = dataclasses.replace(H100, eff=dataclasses.replace(H100.eff, all_gather_eff=0.5))
    assert Links.of(prof, 8).eff("all_gather") == 0.5 and Links.of(H100, 8).eff("all_gather") == 1


def test_calibrate_reads_each_collectives_rate_against_the_all_reduces(monkeypatch):
    """`measure_collectives` fits the all-reduce's bandwidth and latency, then each other
    op's rate at 16 MiB over the ring model's at that bandwidth (fake 2-rank timings)."""
    bw, lat, n = 1e9, 2e-4, 2
    ring = (n - 1) / n * (16 << 20) / bw + (n - 1) * lat
    times = {"all_reduce": [2 * (n - 1) / n * b / bw + 2 * (n - 1) * lat
                            for b in (4096, 1 << 20, 16 << 20)],
             "reduce_scatter": [3 * (ring - lat) + lat], "all_gather": [ring],
             "all_to_all": [2 * (ring - lat) + lat]}
    monkeypatch.setattr("fivefold.local_ranks.run_local", lambda *args, **kw: [times] * n)
    got_bw, got_lat, effs = cal.measure_collectives(n)
    assert (got_bw, got_lat) == (pytest.approx(bw), pytest.approx(lat))
    assert effs == pytest.approx({"reduce_scatter": 1 / 3, "all_gather": 1.0,
                                  "all_to_all": 0.5})


def test_across_nodes_the_nics_of_a_node_share_the_ring():
    s = 1e9
    strided = Group(16, 1)  # one rank per node (tp = 8 inside): one NIC each
    packed = Group(16, 8)  # 8 ranks per node: 8 NICs (full aggregation)
    t_strided = collective_time("all_gather", s, strided, LINKS)
    t_packed = collective_time("all_gather", s, packed, LINKS)
    assert t_strided == pytest.approx(15 / 16 * s / 10e9 + 15 * 5e-6)
    assert t_packed < t_strided / 5
    one_nic = dataclasses.replace(LINKS, nic_aggregation=0.0)  # then two hops win:
    node_hop = 7 / 8 * s / 100e9 + 7 * 1e-6  # all-gather in the node, full buffer
    network_hop = 1 / 2 * s / 10e9 + 5e-6  # the 2 nodes exchange halves over one NIC
    assert collective_time("all_gather", s, packed, one_nic) == pytest.approx(
        node_hop + network_hop)


def test_tree_wins_small_all_reduce_on_many_nodes():
    g = Group(1024, 8)
    small = collective_time("all_reduce", 4, g, LINKS)
    ring_latency = 2 * 127 * 5e-6
    assert small < ring_latency / 5


def test_group_placement_follows_the_mesh():
    assert Group.strided(8, 1, 8) == Group(8, 8)  # tp: inside one node
    assert Group.strided(4, 8, 8) == Group(4, 1)  # dp over tp=8: one per node
    assert Group.strided(8, 2, 8) == Group(8, 4)  # dp over tp=2: 4 per node, 2 nodes


# ------------------------------------------------------------------ compute

def test_gemm_roofline_and_fp8():
    e = H100.eff
    g = Gemm("x", 8192, 8192, 8192)
    expected = (g.flops / (989e12 * e.gemm_eff) + 2 * 3 * 8192**2 / (3350e9 * e.gemm_mem_eff)
                + e.kernel_overhead_s) * H100.gemm_surfaces["bf16"].factor(8192, 8192, 8192)
    assert gemm_time(g, H100, False, 2) == pytest.approx(expected)  # roofline x surface
    assert 1.2 < gemm_time(g, H100, False, 2) / gemm_time(g, H100, True, 2) <= 2.0


def test_causal_attention_counts_half_the_square_and_cp_splits_it():
    prof = PROFILES["H200"]
    f1, b1 = attention_time(1, 32, 16384, 128, 1, prof)
    f4, _ = attention_time(1, 32, 16384, 128, 4, prof)
    assert f4 == pytest.approx(f1 / 4, rel=0.01)
    flops = 2 * 32 * 16384**2 * 128  # causal forward, as h200_measured.json counts it
    measured = flops / 644.85e12  # its 16k-token forward
    assert f1 == pytest.approx(measured, rel=0.1)
    assert b1 / f1 == pytest.approx(2.5, rel=0.15)


# ------------------------------------------------------------------ schedules and partition

@pytest.mark.parametrize("pp, m", [(4, 8), (8, 8), (2, 5)])
def test_1f1b_replay_makespan(pp, m):
    times = {"F": 1.0, "B": 2.0}
    r = replay_step(runtime_schedule("1f1b", pp, 1, m), lambda a: times[a.kind], 0.0)
    assert max(r.finish_s) == (m + pp - 1) * 3.0
    assert r.peak_weight == [min(pp - k, m) for k in range(pp)]
    assert 1 - sum(r.busy_s) / (pp * max(r.finish_s)) == pytest.approx(
        bubble_fraction("1f1b", pp, m))


def test_interleaved_and_zero_bubble_shrink_the_bubble():
    pp, m = 4, 8
    unit = {"F": 1.0, "B": 2.0, "W": 1.0}
    one = max(replay_step(runtime_schedule("1f1b", pp, 1, m), lambda a: unit[a.kind],
                          0.0).finish_s)
    inter = max(replay_step(runtime_schedule("interleaved", pp, 2, m),
                            lambda a: unit[a.kind] / 2, 0.0).finish_s)
    split = {"F": 1.0, "I": 1.0, "W": 1.0}
    zb = max(replay_step(runtime_schedule("zb", pp, 1, m), lambda a: split[a.kind],
                         0.0).finish_s)
    assert one == 33.0
    assert inter == pytest.approx(m * 3 + (pp - 1) * 3 / 2)  # Megatron: bubble / v
    assert zb == pytest.approx(m * 3 + (pp - 1) * 1)  # ZB-H1: (p-1) T_F


def test_partition_is_optimal_and_respects_memory():
    costs = [1.0, 3.0, 2.0, 2.0, 1.0, 4.0, 1.0, 1.0]
    best = min(max(sum(costs[a:b]) + (2.0 if b == len(costs) else 0.0)
                   for a, b in zip((0,) + cuts, cuts + (len(costs),)))
               for cuts in itertools.combinations(range(1, len(costs)), 2))
    sizes = balanced_counts(costs, 3, 0.0, 2.0)
    bounds = list(itertools.accumulate(sizes))
    got = max(sum(costs[a:b]) + (2.0 if b == len(costs) else 0.0)
              for a, b in zip([0] + bounds[:-1], bounds))
    assert got == best and sum(sizes) == len(costs)
    capped = balanced_counts([1.0] * 8, 2, fits=lambda s, a, b: s == 1 or b - a <= 2)
    assert capped == [2, 6]


# ------------------------------------------------------------------ simulate

def test_simulate_fields_and_their_arithmetic():
    cfg = spec_config(spec(parallel={"tp": 2, "pp": 4, "schedule": "interleaved", "vpp": 2,
                                     "zero_stage": 1, "micro_batch": 1,
                                     "sequence_parallel": True}))
    est = simulate(cfg)
    out = est.to_json()
    assert set(out) == OUTPUT_FIELDS
    assert set(out["memory_per_gpu_bytes"]) == MEMORY_FIELDS
    assert set(out["breakdown_s"]) == BREAKDOWN_FIELDS
    assert sum(out["breakdown_s"].values()) == pytest.approx(out["step_time_s"], rel=1e-9)
    mem = out["memory_per_gpu_bytes"]
    assert mem["total"] == sum(mem[k] for k in MEMORY_FIELDS - {"total"})
    assert out["tokens_per_s"] == pytest.approx(128 * 8192 / out["step_time_s"])
    flops = flops_per_token(cfg.model) * 128 * 8192 / 64 / out["step_time_s"]
    assert out["model_tflops_per_gpu"] == pytest.approx(flops / 1e12)
    assert out["mfu"] == pytest.approx(flops / 989e12)
    assert out["parallel"]["stage_layers"] == est.stage_layers and sum(est.stage_layers) == 32
    assert out["parallel"]["dp"] == 8 and out["parallel"]["zero_group"] == 8
    assert out["fits"] == (mem["total"] <= H100.memory_bytes)


def test_tied_head_exchange_is_replayed_and_the_borrowed_head_is_a_buffer():
    """With tied embeddings and pipelining the first rank lends the table to the last stage
    and the last stage returns the head's gradient (ceil(V/t) x D values in the compute
    dtype each), as the runtime's lists do (schedules.runtime_schedule with `tied`): the
    first rank's last backward starts no earlier than the last stage's last backward's end
    plus that transfer. The first and last stage of pp 2 x tp 2 x dp 16 sit on different
    nodes, so it crosses the network. The last stage's copy is a buffer (with its gradient
    in 'other'), not model state: no optimizer state, no data-parallel sync."""
    par = {"tp": 2, "pp": 2, "micro_batch": 1, "zero_stage": 1}
    tied = simulate(spec_config(spec(model={"tied_embeddings": True}, parallel=par)),
                    keep_events=True)
    untied = simulate(spec_config(spec(model={"tied_embeddings": False}, parallel=par)))
    sim, model = tied.step_model, tied.step_model.model
    table = -(-model.vocab // 2) * model.hidden
    assert sim.tied_exchange_s == pytest.approx(
        sim._coll("send", table * 2, Group.strided(2, 2 * 16, 8)), rel=1e-9)  # bf16
    assert sim.tied_exchange_s > 0 and untied.step_model.tied_exchange_s == 0.0
    last_stage_b = max(e.end for e in tied.replay.events if e.rank == 1 and e.action.kind == B)
    first_last_b = max((e for e in tied.replay.events if e.rank == 0 and e.action.kind == B),
                       key=lambda e: e.end)
    assert first_last_b.start >= last_stage_b + sim.tied_exchange_s - 1e-12
    assert sum(tied.breakdown_s.values()) == pytest.approx(tied.step_time_s, rel=1e-9)
    mem_tied, mem_untied = sim.memory(1, 0.0), untied.step_model.memory(1, 0.0)
    assert mem_tied["params"] == mem_untied["params"] - table * 2  # the head is not a unit
    assert mem_tied["optimizer"] < mem_untied["optimizer"]
    assert mem_tied["other"] == mem_untied["other"] + 2 * table * 2  # buffer and gradient


def test_recompute_trades_memory_for_time():
    runs = {r: simulate(spec_config(spec(parallel={"zero_stage": 3, "micro_batch": 2,
                                                   "recompute": r})))
            for r in ("none", "selective", "full")}
    acts = [runs[r].memory_per_gpu_bytes["activations"] for r in ("none", "selective", "full")]
    times = [runs[r].step_time_s for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2] and times[0] < times[1] < times[2]
    # full recomputation repeats the forward (HFU = 4/3 MFU, the head aside: 2%), but under
    # the fivefold stack it stops before each block's w2 (Stack.recompute_early_stop), whose
    # FLOPs it does not repeat; Megatron reruns the whole block
    m = load_config(None, ["model.preset='8B'"]).model
    forward = model_flops_per_token(m, H100) / 3
    w2 = m.layers * 2 * m.hidden * m.ffn_hidden
    full = runs["full"]
    assert full.hfu == pytest.approx(full.mfu * (1 + (forward - w2) / (3 * forward)), rel=0.02)
    meg = simulate(spec_config(spec(parallel={"zero_stage": 3, "micro_batch": 2,
                                              "recompute": "full"},
                                    train={"stack": "megatron"})))
    assert meg.hfu == pytest.approx(meg.mfu * 4 / 3, rel=0.02)


def test_more_devices_of_data_parallelism_shorten_the_step():
    small = simulate(spec_config(spec(cluster={"gpus": 16}, parallel={"zero_stage": 3})))
    large = simulate(spec_config(spec(cluster={"gpus": 64}, parallel={"zero_stage": 3})))
    assert large.step_time_s < small.step_time_s / 3


# ------------------------------------------------------------------ search

def test_search_returns_fitting_layouts_fastest_first():
    cfg = spec_config(spec(model={"preset": "8B", "layers": 8}, cluster={"gpus": 16},
                           parallel={"global_batch": 32}))
    result = search(cfg, H100, top_k=3)
    assert result.scored == len(candidates(cfg, plan_from_config(cfg, cfg.cluster.gpus)))
    assert result.scored > 1000 and 0 < result.fitting <= result.scored
    times = [e.step_time_s for e in result.best]
    assert len(times) == 3 and times == sorted(times) and all(e.fits for e in result.best)
    default = simulate(cfg)  # the spec's own layout is in the space and no faster
    assert times[0] <= default.step_time_s * 1.000001


def test_search_pipelines_a_model_that_does_not_fit_unsplit():
    """70B in bf16 with AdamW holds 16 bytes per parameter: 1.1 TB, 35 GB on each of 32
    devices only when sharded or split; the plain data-parallel layout cannot fit."""
    cfg = spec_config(spec(model={"preset": "70B"}, cluster={"gpu": "A100-80GB", "gpus": 32},
                           parallel={"global_batch": 32}))
    assert not simulate(cfg).fits
    best = search(cfg, PROFILES["A100-80GB"], top_k=1).best
    assert len(best) == 1 and best[0].fits
    p = best[0].parallel
    assert p["tp"] * p["pp"] > 1 or p["zero_stage"] == 3


# ------------------------------------------------------------------ validation

def test_validate_against_published_runs():
    checks = validate_runs(read_runs())
    assert len(checks) == 140
    assert mape(checks) == pytest.approx(sum(abs(c.predicted_s / c.published_s - 1)
                                             for c in checks) / 140)
    # in-sample, with the constants `plan validate --cross` fitted to the 140 rows: 9.9% on
    # 2026-12-07 (docs/planner.md lists the per-source and per-family errors and the
    # leave-one-source-out figure); the bound leaves 1.1 points for later model changes
    assert mape(checks) < 0.11
    # 139 of 140 fit; the one that does not, and why the spec cannot state it: docs/planner.md
    assert {c.id for c in checks if not c.fits} == {"llama3_405B_8192gpu_cp1"}
