"""The op trace scheduled (fivefold.planner.trace_step) against the block model (simulate).

Two predictions of one step from one set of prices and one scheduler (events.schedule): the
block model schedules block_ops' per-block lists, trace_step the ops op_trace lists (each
held equal to the runtime's kernels by tests/test_op_trace.py). For each layout below (the
layouts of tests/test_op_trace.py, at a realistic size: Llama 3.2 1B's shape, seq 2048, 8
H100-SXM) the op-level step time must lie within

    block (1 - TOLERANCE) - unlisted  <=  op-level  <=  block (1 + TOLERANCE) + serialized

and, with one pipeline rank, whose one compute stream runs all of `unlisted` on the block
model's path, also op-level <= block (1 + TOLERANCE) - unlisted + serialized.

`unlisted`: the block model's seconds for work the trace does not list (an upper bound of
what it takes off the op-level step: each piece sits at most once per micro-batch on any
path through the schedule):
  - the loss and the final norm over the logits (the trace lists the head's GEMMs and the
    loss's all-gather, not the fp32 cross-entropy's passes): compute.head_times less the
    trace's head GEMMs, per micro-batch, 4-5% of these steps;
  - recomputation's element-wise ops (the runtime's checkpoint runs the norms, rotary and
    activations again; the trace repeats the GEMMs and attention only): as many as the
    forward's, per block and micro-batch, up to 7.5%;
  - offload's clipping on the host (offload.CLIP_BYTES per element, offload_summary's
    clip_s): 10% of the offload layout's step.
`serialized`: the op-level seconds the trace orders more strictly than the runtime does:
  - DDP's and ZeRO-1's gradient collectives after the last backward (the runtime, and the
    block model, reduce each unit's bucket behind the rest of the backward: grad_sync);
  - ZeRO-3's and offload's parameter gathers, each waiting for the compute op before it
    (the runtime prefetches the next block's; the block model hides it beside the forward),
    and under ZeRO-3 the gradient reduce-scatters that a backward gather queues behind on
    their one stream;
  - offload's host step and upload, which end the trace's one step (the runtime overlaps
    them with the next step's forward, as the block model does).
`TOLERANCE` covers what both list but price apart, each measured at these layouts: the
trace's element-wise bytes (an estimate without the attention output's 2 q bytes per token
that compute.block_eltwise_bytes counts: 0.5-1.5%), the backward GEMMs at their own
transposed shapes on the GEMM surface (the block model prices all three at the forward's:
under 1%), the embedding's gradient (the trace's op carries the lookup's bytes, not the
table's: 0.3%) and pipeline sends contending with compute (under 0.1%). (The block model's
full recomputation stops before each dense block's w2 as the runtime's checkpoint does:
Stack.recompute_early_stop, op_compute.early_stop.)
Both replay the runtime's lists with the tied-embedding exchange in them, so ZB-H1 with
tied embeddings waits for the returned head gradient only before the first rank's last W,
as the executor does.
"""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, load_config
from fivefold.parallel.pipeline.schedules import B, F, I, W
from fivefold.planner.events import Op, schedule
from fivefold.planner.op_trace import rank_trace
from fivefold.planner.schedules import replay_step, runtime_schedule
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare
from fivefold.planner.trace_prices import group_of, mesh_axes
from fivefold.planner.trace_step import op_step

SIZE = ["model.preset='1B'", "cluster.gpu='H100-SXM'", "cluster.gpus=8",
        "parallel.global_batch=32", "parallel.micro_batch=1"]
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=2048"]
PP = ["parallel.pp=2"]
LAYOUTS = [  # (label, overrides), as tests/test_op_trace.py's
    ("ddp", ["parallel.zero_stage=0"]),
    ("zero1", ["parallel.zero_stage=1"]),
    ("zero2", ["parallel.zero_stage=2"]),
    ("zero3", ["parallel.zero_stage=3"]),
    ("tp2 sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp2 1f1b", PP),
    ("pp4 gpipe", ["parallel.pp=4", "parallel.schedule='gpipe'"]),
    ("pp2 interleaved vpp2", PP + ["parallel.vpp=2", "parallel.schedule='interleaved'"]),
    ("pp2 zb-h1, untied embeddings", PP + ["parallel.schedule='zb'",
                                           "model.tied_embeddings=false"]),
    ("pp2 zb-h1, tied embeddings", PP + ["parallel.schedule='zb'"]),
    ("pp2 zbv", PP + ["parallel.vpp=2", "parallel.schedule='zbv'"]),
    ("cp2 ring", ["parallel.cp=2"]),
    ("cp2 ulysses", ["parallel.cp=2", "parallel.cp_mode='ulysses'"]),
    ("ep2", MOE + ["parallel.ep=2"]),
    ("ep4 zero1", MOE + ["parallel.ep=4", "parallel.zero_stage=1"]),
    ("full recompute", ["parallel.recompute='full'"]),
    ("selective recompute", ["parallel.recompute='selective'"]),
    ("cpu offload zero1", ["parallel.offload='cpu'", "parallel.zero_stage=1"]),
    ("pp2 x tp2 sp", PP + ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("activation offload 4", ["parallel.offload_activations=4"]),
    ("pp2 1f1b, activation offload 2", PP + ["parallel.offload_activations=2"]),
]
TOLERANCE = 0.03


def _both(sets: list[str]):
    cfg = prepare(load_config(None, SIZE + sets))
    return simulate(cfg), op_step(cfg)


def _bounds(est, step) -> tuple[float, float]:
    """(lowest, highest) op-level step time the module docstring allows against `est`."""
    sm, lay = est.step_model, est.layout
    last = lay.pp - 1 if not lay.v_shape else 0  # the rank that holds the head
    head_gemms = sum(s.seconds for s in step.ops if s.pp_rank == last and s.op.name == "output")
    unlisted = lay.micro_batches * (sm.head.fwd + sm.head.bwd) - head_gemms
    if lay.recompute != "none":
        unlisted += sum(s.seconds for s in step.ops if s.op.kind == "elementwise"
                        and s.op.phase == "forward" and s.op.name.startswith("layers."))
    serialized = max(sum(s.seconds for s in step.ops if s.pp_rank == p and (
        (s.op.purpose == "grads" and (s.op.phase == "step" or lay.zero_stage == 3))
        or (s.op.purpose == "params" and s.op.phase == "pass"))) for p in range(lay.pp))
    if est.offload:
        unlisted += est.offload["clip_s"]
        serialized += est.offload["cpu_step_s"] + est.offload["upload_s"]
    block = est.step_time_s
    shown = unlisted if lay.pp == 1 else 0.0  # one rank: all of it was on its compute's path
    return block * (1 - TOLERANCE) - unlisted, block * (1 + TOLERANCE) - shown + serialized


@pytest.mark.parametrize("label,sets", LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_op_level_step_agrees_with_the_block_model(label, sets):
    est, step = _both(sets)
    low, high = _bounds(est, step)
    assert low <= step.step_time_s <= high, (label, step.step_time_s, est.step_time_s,
                                             low, high)


def test_layouts_span_the_issue():
    """ZeRO 0-3, tp with sp, 1F1B/GPipe/interleaved/zero-bubble, cp ring and Ulysses, ep,
    full and selective recomputation, offload: at least 12 layouts."""
    sets = [" ".join(s) for _, s in LAYOUTS]
    assert len(LAYOUTS) >= 12
    for want in [f"zero_stage={z}" for z in range(4)] + [
            "sequence_parallel=true", "'gpipe'", "parallel.pp=2", "'interleaved'", "'zb'",
            "'zbv'", "cp=2", "'ulysses'", "ep=2", "recompute='full'", "recompute='selective'",
            "offload='cpu'"]:
        assert any(want in s for s in sets), want


@pytest.mark.parametrize("schedule_sets", [["parallel.pp=4"],
                                           ["parallel.pp=4", "parallel.schedule='gpipe'"],
                                           ["parallel.pp=2", "parallel.schedule='zb'"]],
                         ids=["1f1b", "gpipe", "zb-h1"])
def test_joint_pipeline_schedule_is_the_block_models_replay(schedule_sets):
    """A pure pipeline (no dp, tp, cp): the joint schedule's last compute op ends where the
    block model's replay of the runtime's lists (schedules.replay_step) ends when each
    action takes the op-level seconds of its ops and each message the block model's p2p_s:
    a receive waits for its send across ranks exactly as the replay's does. The two differ
    only by the sends contending with compute (events' overlap_eff), well under 0.1%."""
    sets = schedule_sets + ["model.tied_embeddings=false", "parallel.global_batch=16",
                            f"cluster.gpus={schedule_sets[0].split('=')[1]}"]
    cfg = prepare(load_config(None, SIZE + sets))
    step, est = op_step(cfg), simulate(cfg)
    lay, sm = est.layout, est.step_model
    seconds: dict[tuple, float] = {}
    end = 0.0
    for s in step.ops:
        if s.stream != "compute" or s.op.phase == "step":
            continue
        kind = F if s.op.phase == "forward" else (
            (W if s.op.phase == "weight_grad" else I) if lay.split_backward else B)
        key = (s.pp_rank, s.op.micro_batch, kind)
        seconds[key] = seconds.get(key, 0.0) + s.seconds
        end = max(end, s.end)
    replay = replay_step(runtime_schedule(lay.schedule, lay.pp, lay.vpp, lay.micro_batches),
                         lambda a: seconds[a.stage, a.mb, a.kind], sm.p2p_s)
    assert end == pytest.approx(max(replay.finish_s), rel=2e-3)
    assert step.step_time_s > end  # the gradient norm's and loss's reductions, the optimizer


@pytest.mark.parametrize("sets", [["parallel.zero_stage=1", "parallel.tp=2"],
                                  ["parallel.pp=2", "parallel.cp=2", "parallel.zero_stage=3"],
                                  MOE + ["parallel.ep=4", "parallel.zero_stage=2"],
                                  ["parallel.cp=4", "parallel.tp=2", "parallel.zero_stage=1",
                                   "cluster.gpus=16"]])
def test_collectives_run_on_the_block_models_groups(sets):
    """trace_prices.group_of places every axis the ledger names as block_cost._groups places
    the block model's (tp innermost, then cp, dp, pp; the experts' grid)."""
    est = simulate(prepare(load_config(None, SIZE + sets)))
    sm, lay = est.step_model, est.layout
    mesh, gpn = mesh_axes(lay), sm.cfg.cluster.gpus_per_node
    shard = "+".join(lay.shard_axes)
    named = {"tp": sm.tp_group, "cp": sm.cp_group, shard: sm.shard_group,
             lay.expert_shard_axis[0]: sm.expert_shard_group, "ep": sm.ep_group}
    for axis, group in named.items():
        if group.size > 1:
            assert group_of(axis, group.size, mesh, gpn) == group, axis
    if lay.pp > 1:
        assert group_of("pp", 2, mesh, gpn) == sm.pp_pair


@pytest.mark.parametrize("sets,key", [
    (["parallel.precision='fp8'"], "parallel.precision"),
    (["train.optimizer='muon'"], "train.optimizer"),
    (["train.optimizer='galore'"], "train.optimizer"),
    (["train.optimizer='lomo'"], "train.optimizer"),
    (MOE + ["parallel.ep=2", "parallel.etp=2"], "parallel.etp"),
    (["parallel.pp=2", "parallel.schedule='pipedream-2bw'"], "parallel.schedule"),
    (MOE + ["model.moe.capacity_factor=1.25"], "model.moe.capacity_factor"),
    (["train.stack='megatron'"], "train.stack")])
def test_out_of_scope_layouts_are_refused_naming_the_key(sets, key):
    """trace_step refuses, naming the key, every configuration op_trace refuses (which it
    must go on refusing: the two checks stay one scope), and other stacks' runs."""
    cfg = prepare(load_config(None, SIZE + sets))
    with pytest.raises(ConfigError) as err:
        op_step(cfg)
    assert err.value.key == key
    if key != "train.stack":
        lay = simulate(cfg).layout
        with pytest.raises(ValueError):
            rank_trace(cfg, lay, 0, "cuda")


def test_cli_writes_the_op_level_trace_and_refuses_out_of_scope(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"preset": "1B", "layers": 4},
                                "cluster": {"gpu": "H100-SXM", "gpus": 4},
                                "parallel": {"pp": 2, "global_batch": 8, "micro_batch": 1}}))
    out = tmp_path / "ops.json"
    assert main(["simulate", str(spec), "--op-trace", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("op trace: step ") and "block model" in line
    events = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert any(e["args"]["kind"] == "gemm" and len(e["args"]["shape"]) == 4 for e in slices)
    assert any(e["args"]["kind"] == "send" and e["args"]["bytes"] > 0 for e in slices)
    assert main(["simulate", str(spec), "--json", "--op-trace", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step_time_s"] > 0 and "op trace: step" in captured.err
    assert main(["simulate", str(spec), "--op-trace", str(out),
                 "--set", "parallel.precision='fp8'"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.precision" in err[0]


def test_contention_counts_per_device():
    """events.Op.device: a collective slows the compute of its own device only, and ops
    that name no device schedule as one device, as before."""
    pair = [Op("compute", "compute", 1.0), Op("collective", "dp", 1.0)]
    one = schedule(pair, 0.5).makespan
    assert one == pytest.approx(1.5)  # max(W, C) + (1 - overlap_eff) min(W, C)
    two = [Op("compute", "compute", 1.0, device="a"), Op("collective", "dp", 1.0, device="a"),
           Op("compute", "compute", 1.0, device="b")]
    t = schedule(two, 0.5)
    assert t.end[2] == pytest.approx(1.0) and t.end[0] == pytest.approx(1.5)
