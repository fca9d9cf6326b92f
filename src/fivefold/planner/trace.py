"""A Chrome / Perfetto trace of one simulated step (`fivefold simulate --trace FILE`).

One process lane per pipeline rank (the ranks of one data-parallel replica; the others run
the same timeline), two threads each: "compute" holds every replayed compute action (F, B;
zero-bubble's I, W) per micro-batch and virtual stage, from the runtime's action lists, and
then the optimizer; "comm" holds, at the end of each action, the communication on its
critical path (tensor-, context-, expert-parallel and ZeRO-3 collectives, drawn where the
action waited for them) and, after the last backward, the exposed data-parallel gradient
synchronisation. Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.parallel.pipeline.schedules import COMPUTE, F, W
from fivefold.planner.estimate import Estimate


def trace_events(est: Estimate, sm) -> list[dict]:
    times = [sm.stage_times(g) for g in range(len(sm.stage_layers))]
    n = sm.lay.slices
    out = []
    for r in range(est.layout.pp):
        out.append({"name": "process_name", "ph": "M", "pid": r,
                    "args": {"name": f"pipeline rank {r}"}})
        for tid, name in ((0, "compute"), (1, "comm")):
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid,
                        "args": {"name": name}})
    finish = [0.0] * est.layout.pp
    for e in est.replay.events:
        act = e.action
        if act.kind not in COMPUTE:  # sends, receives and 2BW's UPDATE take no time here
            continue
        label = f"{act.kind} mb{act.mb} s{act.stage}" + (f".{act.slice}" if act.slice else "")
        out.append(_x(label, e.rank, 0, e.start, e.end,
                      {"stage_layers": sm.stage_layers[act.stage]}))
        f_comm, b_comm = times[act.stage][3] / n, times[act.stage][4] / n
        comm = f_comm if act.kind == F else 0.0 if act.kind == W else b_comm
        if comm > 0:
            out.append(_x(f"comm {label}", e.rank, 1, e.end - comm, e.end, {}))
        finish[e.rank] = max(finish[e.rank], e.end)
    for r in range(est.layout.pp):
        tail = est.dp_tail_s[r] if est.dp_tail_s else 0.0
        if tail > 0:
            out.append(_x("gradient sync", r, 1, finish[r], finish[r] + tail, {}))
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
