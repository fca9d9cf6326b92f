"""Pictures of a pipeline schedule: a timeline PNG and a Chrome/Perfetto trace.

Both take a list of `replay.Event` (rank, action, start, end): either the executor's recorded
timestamps of a real run (`PipelineEngine(record_timeline=True).timeline`, gathered from the
ranks) or `replay.replay(schedule)`, the simulator's replay of the very same action lists
with modelled costs. The PNG draws one row per rank with a box per compute action (forward
blue, backward red; zero-bubble input-gradient orange and weight-gradient green; interleaved
chunks lighter for later chunks), labelled with the micro-batch; the trace puts each rank on
its own thread, so chrome://tracing or ui.perfetto.dev shows the same picture with the
send/receive waits as instant events. `bubble_fraction` (replay) measures the idle share.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.parallel.pipeline.replay import Event
from fivefold.parallel.pipeline.schedules import B, COMPUTE, F, I, UPDATE, W

COLORS = {F: (0.27, 0.51, 0.71), B: (0.80, 0.30, 0.30), I: (0.93, 0.55, 0.20),
          W: (0.35, 0.65, 0.35), UPDATE: (0.45, 0.45, 0.45)}


def _shade(color: tuple[float, float, float], chunk: int) -> tuple[float, float, float]:
    """Later model chunks are drawn lighter."""
    mix = min(0.45 * chunk, 0.8)
    return tuple(c + (1.0 - c) * mix for c in color)


def plot_timeline(events: list[Event], path: str | Path, title: str, pp: int,
                  time_unit: str = "") -> None:
    """Write a PNG of the events: rank 0 on top, time to the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(ranks) + 1.3), dpi=110)
    for e in events:
        if e.action.kind not in COMPUTE and e.action.kind != UPDATE:
            continue
        chunk = e.action.stage // pp
        ax.broken_barh([(e.start - t0, max(e.end - e.start, (t1 - t0) * 1e-3))],
                       (e.rank - 0.4, 0.8), facecolors=_shade(COLORS[e.action.kind], chunk),
                       edgecolors="white", linewidth=0.6)
        width = (e.end - e.start) / (t1 - t0)
        if width > 0.012:
            label = str(e.action.mb) + (f".{e.action.slice}" if e.action.slice else "")
            ax.text(e.start - t0 + (e.end - e.start) / 2, e.rank, label, ha="center",
                    va="center", fontsize=7 if width > 0.02 else 5, color="white")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel(f"time{f' ({time_unit})' if time_unit else ''}")
    ax.set_title(title, fontsize=10, loc="left")
    kinds = [k for k in (F, B, I, W, UPDATE) if any(e.action.kind == k for e in events)]
    names = {F: "forward", B: "backward", I: "backward (input)", W: "backward (weights)",
             UPDATE: "optimizer update"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    ax.legend(handles, [names[k] for k in kinds], loc="lower right", bbox_to_anchor=(1, 1),
              ncol=len(kinds), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def chrome_trace(events: list[Event], path: str | Path, seconds_per_unit: float = 1e-3) -> None:
    """Write a Chrome/Perfetto trace JSON: one thread per rank; `seconds_per_unit` converts
    the events' time unit to seconds (1 for recorded timestamps)."""
    t0 = min(e.start for e in events)
    us = 1e6 * seconds_per_unit
    trace = []
    for e in events:
        a = e.action
        args = {"stage": a.stage, "micro_batch": a.mb, "slice": a.slice}
        if a.kind in COMPUTE or a.kind == UPDATE:
            trace.append({"name": f"{a.kind}{a.mb}" + (f".{a.slice}" if a.slice else ""),
                          "cat": a.kind, "ph": "X", "ts": (e.start - t0) * us,
                          "dur": (e.end - e.start) * us, "pid": 0, "tid": e.rank, "args": args})
        else:
            trace.append({"name": a.kind, "cat": "p2p", "ph": "i", "s": "t",
                          "ts": (e.start - t0) * us, "pid": 0, "tid": e.rank, "args": args})
    for r in sorted({e.rank for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                      "args": {"name": f"rank {r}"}})
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
