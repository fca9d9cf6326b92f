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
"""

from __future__ import annotations

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
            out.append(_x(f"{name} (block {i})", pid, STREAMS.index(stream),
                          at + s * scale, at + e * scale, {"action": label}))
        at += span * scale
    if end - at > 1e-12:
        out.append(_x("root parts", pid, 0, at, end, {"action": label}))
    return out


def trace_events(est: Estimate, sm) -> list[dict]:
    out = []
    for r in range(est.layout.pp):
        out.append({"name": "process_name", "ph": "M", "pid": r,
                    "args": {"name": f"pipeline rank {r}"}})
        for tid, name in enumerate(STREAMS):
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid,
                        "args": {"name": name}})
    blocks = _block_timelines(sm)
    finish = [0.0] * est.layout.pp
    for e in est.replay.events:
        act = e.action
        if act.kind not in COMPUTE:  # sends, receives and 2BW's UPDATE take no time here
            continue
        label = f"{act.kind} mb{act.mb} s{act.stage}" + (f".{act.slice}" if act.slice else "")
        out.append({**_x(label, e.rank, 0, e.start, e.end,
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
            out += [_x(o.name, r, STREAMS.index("dp"), s, e, {}) for o, s, e in
                    zip(ops, t.start, t.end) if o.stream == "dp" and e > s]
            shown = max(t.makespan - done, 0.0)
        else:
            shown = 0.0
        if tail > shown:
            out.append(_x("gradient sync", r, STREAMS.index("dp"), finish[r] + shown,
                          finish[r] + tail, {}))
        opt = sm.optimizer_s(r)
        out.append(_x("optimizer", r, 0, finish[r] + tail, finish[r] + tail + opt, {}))
    return out


def _x(name: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6, "args": args}


def write_trace(est: Estimate, path: str | Path) -> None:
    """Write the trace of `est` (simulated with keep_events=True)."""
    Path(path).write_text(json.dumps({"traceEvents": trace_events(est, est.step_model),
                                      "displayTimeUnit": "ms"}) + "\n")
