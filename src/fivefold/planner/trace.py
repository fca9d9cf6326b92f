"""A Chrome / Perfetto trace of one simulated step (`fivefold simulate --trace FILE`).

One process lane per pipeline rank (the ranks of one data-parallel replica; the others run
the same timeline), one thread per stream of the event scheduler (fivefold.planner.events:
compute, tp, cp, ep, dp). Each replayed compute action (F, B; zero-bubble's I, W) per
micro-batch and virtual stage spans its interval on the compute thread, and inside it each
block's scheduled ops (fivefold.planner.block_ops) are drawn where the scheduler put them,
scaled to the action's interval (a token slice, DualPipe-V's pairs), followed by the stage's
root parts. After the last backward: the gradient buckets' reductions as the rank's tail
scheduled them (fivefold.planner.rank_cost), the rest of the tail, then the optimizer. Open
the file in https://ui.perfetto.dev or chrome://tracing.

`--op-trace FILE` writes the other schedule (`write_op_trace`): the op trace's ops where
fivefold.planner.trace_step put them, with the same lanes (a process per pipeline rank, a
thread per stream) and each op's shape, bytes and group in its slice's args.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fivefold.models.description import is_moe_layer
from fivefold.parallel.pipeline.schedules import COMPUTE, F, W
from fivefold.planner.block_ops import backward_ops, forward_ops
from fivefold.planner.estimate import Estimate
from fivefold.planner.events import schedule

STREAMS = ("compute", "tp", "cp", "ep", "dp")


def _block_timelines(sm) -> dict[tuple[bool, bool], list[tuple[str, str, float, float]]]:
    """(moe, backward) -> the block's ops as (name, stream, start, end), scheduled."""
    out = {}
    for moe in {is_moe_layer(sm.model, i) for i in range(sm.model.layers)}:
        _, compute, comm = sm.with_data_parallel(moe)
        for backward, ops in ((False, forward_ops(comm, compute)),
                              (True, backward_ops(comm, compute))):
            t = schedule(ops, sm.prof.eff.overlap_eff)
            out[moe, backward] = [(op.name, op.stream, s, e)
                                  for op, s, e in zip(ops, t.start, t.end)]
    return out


def _action_ops(sm, blocks, stage: int, kind: str, start: float, end: float, pid: int,
                label: str) -> list[dict]:
    """The stage's blocks' scheduled ops, one block after the other, scaled into
    [start, end]; what is left of the interval is the stage's root parts."""
    if kind == W:  # the weight gradients alone: nothing scheduled beside them
        return []
    backward = kind != F
    layers = list(sm.stage_ranges[stage])
    lines = [blocks[is_moe_layer(sm.model, i), backward] for i in layers]
    spans = [max((e for *_, e in line), default=0.0) for line in lines]
    stage_s = sm.stage_times(stage)[1 if backward else 0]
    scale = (end - start) / stage_s if stage_s > 0 else 0.0
    out, at = [], start
    for i, line, span in zip(layers, lines, spans):
        for name, stream, s, e in line:
            out.append(slice_event(f"{name} (block {i})", pid, STREAMS.index(stream),
                          at + s * scale, at + e * scale, {"action": label}))
        at += span * scale
    if end - at > 1e-12:
        out.append(slice_event("root parts", pid, 0, at, end, {"action": label}))
    return out


def trace_events(est: Estimate, sm) -> list[dict]:
    out = []
    for r in range(est.layout.pp):
        out += lane_names(r, f"pipeline rank {r}", STREAMS)
    blocks = _block_timelines(sm)
    finish = [0.0] * est.layout.pp
    for e in est.replay.events:
        act = e.action
        if act.kind not in COMPUTE:  # sends, receives and 2BW's UPDATE take no time here
            continue
        label = f"{act.kind} mb{act.mb} s{act.stage}" + (f".{act.slice}" if act.slice else "")
        out.append({**slice_event(label, e.rank, 0, e.start, e.end,
                         {"stage_layers": sm.stage_layers[act.stage]}), "cat": "action"})
        out += _action_ops(sm, blocks, act.stage, act.kind, e.start, e.end, e.rank, label)
        finish[e.rank] = max(finish[e.rank], e.end)
    for r in range(est.layout.pp):
        tail = est.dp_tail_s[r] if est.dp_tail_s else 0.0
        done = max((end for _, end in est.replay.last_grads[r].values()), default=0.0)
        if est.layout.zero_stage <= 1:  # the buckets as the rank's tail scheduled them
            op = "all_reduce" if est.layout.zero_stage == 0 else "reduce_scatter"
            ops = sm.grad_sync_ops(r, op, est.replay.last_grads[r], sm.root_sync_s(r, op))
            t = schedule(ops, sm.prof.eff.overlap_eff)
            out += [slice_event(o.name, r, STREAMS.index("dp"), s, e, {}) for o, s, e in
                    zip(ops, t.start, t.end) if o.stream == "dp" and e > s]
            shown = max(t.makespan - done, 0.0)
        else:
            shown = 0.0
        if tail > shown:
            out.append(slice_event("gradient sync", r, STREAMS.index("dp"), finish[r] + shown,
                          finish[r] + tail, {}))
        opt = sm.optimizer_s(r)
        out.append(slice_event("optimizer", r, 0, finish[r] + tail, finish[r] + tail + opt, {}))
    return out


def lane_names(pid: int, process: str, threads) -> list[dict]:
    """The metadata naming process `pid` and its threads (tid = place in `threads`)."""
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}] + [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for tid, name in enumerate(threads)]


def slice_event(name: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    """One complete event ("X") from `start` to `end` seconds."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6, "args": args}


def write_trace(est: Estimate, path: str | Path) -> None:
    """Write the trace of `est` (simulated with keep_events=True)."""
    _write(trace_events(est, est.step_model), path)


OP_ARGS = ("kind", "phase", "shape", "dtype", "bytes", "causal", "kernel", "axis", "group",
           "purpose", "micro_batch", "ragged", "step")  # the op's fields a slice shows, if set


def op_trace_events(step) -> list[dict]:
    """The slices of `step` (fivefold.planner.trace_step.OpStep): a process per pipeline
    rank, a thread per stream (compute, then the others as the rank first uses them), each
    op a slice with its op's fields (OP_ARGS, those not at their default) and its price."""
    streams = [list(dict.fromkeys(["compute"] + [s.stream for s in step.ops if s.pp_rank == p]))
               for p in range(len(step.ranks))]
    out = []
    for p, rank in enumerate(step.ranks):
        out += lane_names(p, f"pipeline rank {p} (global rank {rank})", streams[p])
    for s in step.ops:
        op = s.op
        args = {f.name: getattr(op, f.name) for f in dataclasses.fields(op)
                if f.name in OP_ARGS and getattr(op, f.name) != f.default}
        out.append(slice_event(op.name, s.pp_rank, streams[s.pp_rank].index(s.stream), s.start,
                               s.end, {**args, "seconds": s.seconds}))
    return out


def write_op_trace(step, path: str | Path) -> None:
    """Write the op-level schedule `step` (fivefold.planner.trace_step.op_step)."""
    _write(op_trace_events(step), path)


def _write(events: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
