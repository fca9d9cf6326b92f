"""The report's figures: matplotlib (Agg) rendered to inline SVG, text kept as SVG text so the
page needs no font files and nothing from the network.

Each curve carries an SVG id (`gid`) and its own colour from `COLORS`, so a test can find its
points in the page's markup and its pixels in a screenshot.
"""

from __future__ import annotations

import io
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COLORS = {"train-loss": "#1f77b4", "val-loss": "#d62728", "tokens-per-s": "#2ca02c",
          "measured": "#9467bd", "predicted": "#ff7f0e", "forward": "#bcbd22",
          "backward": "#17a589", "optimizer": "#7f7f7f", "comm": "#e377c2", "bytes": "#17becf", "wire-bytes": "#8c564b"}
MiB = 2 ** 20


def _svg(fig) -> str:
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline markup


def _axes(title: str, xlabel: str, ylabel: str, height: float = 3.2):
    fig, ax = plt.subplots(figsize=(8.4, height))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=xlabel in ("step", "mesh axis")))
    return fig, ax


def loss_plot(records: list[dict], initial_val: float | None) -> str:
    fig, ax = _axes("Training and validation loss", "step", "loss")
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], color=COLORS["train-loss"], lw=1.5,
            marker="o" if len(steps) < 30 else None, ms=3, label="train loss", gid="train-loss")
    val = [(0, initial_val)] if initial_val is not None else []
    val += [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), color=COLORS["val-loss"], lw=1.5, marker="s", ms=4,
                label="validation loss", gid="val-loss")
    ax.legend()
    return _svg(fig)


def throughput_plot(records: list[dict]) -> str:
    fig, ax = _axes("Throughput", "step", "tokens/s")
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["tokens_per_s"] for r in records], color=COLORS["tokens-per-s"], lw=1.5,
            marker="o" if len(steps) < 30 else None, ms=3, gid="tokens-per-s")
    ax.set_ylim(bottom=0)
    return _svg(fig)


def memory_plot(rows: list[tuple[str, int | None, int | None]]) -> str:
    """(label, measured bytes, predicted bytes; None: not known) per memory row, as paired
    bars (an unknown one drawn as 0)."""
    fig, ax = _axes("Memory on rank 0: measured and predicted", "", "MiB",
                    height=0.5 * len(rows) + 1.4)
    ax.grid(alpha=0.3, axis="x")
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [(m or 0) / MiB for _, m, _ in rows], height=0.4,
            color=COLORS["measured"], label="measured", gid="memory-measured")
    ax.barh([y + 0.2 for y in ys], [(p or 0) / MiB for _, _, p in rows], height=0.4,
            color=COLORS["predicted"], label="predicted (planner)", gid="memory-predicted")
    ax.set_yticks(list(ys), [label for label, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_ylabel("")
    ax.legend()
    return _svg(fig)


def ledger_plot(per_axis: dict[str, tuple[int, int]], step: int) -> str:
    """Bytes and wire bytes per mesh axis (summed over operations) of one step."""
    axes = sorted(per_axis)
    fig, ax = _axes(f"Communication ledger: bytes per mesh axis, step {step}", "mesh axis",
                    "MiB per step on this rank")
    xs = range(len(axes))
    ax.bar([x - 0.2 for x in xs], [per_axis[a][0] / MiB for a in axes], width=0.4,
           color=COLORS["bytes"], label="buffer bytes", gid="ledger-bytes")
    ax.bar([x + 0.2 for x in xs], [per_axis[a][1] / MiB for a in axes], width=0.4,
           color=COLORS["wire-bytes"], label="wire bytes (ring)", gid="ledger-wire")
    ax.set_xticks(list(xs), axes)
    ax.set_xlim(-1, len(axes))
    ax.legend()
    return _svg(fig)


def timeline_plot(events: list[dict], pp: int, measured_s: list[float]) -> str:
    """The predicted step's compute and communication lanes per pipeline rank (the trace of
    fivefold.planner.trace), with the measured step time (median over the logged steps) as a
    vertical line."""
    fig, ax = _axes("Predicted step timeline against the measured step time", "seconds",
                    "", height=0.9 * pp + 1.6)
    span = max((e["ts"] + e["dur"]) / 1e6 for e in events)
    for e in events:
        lane, kind = 2 * e["pid"] + e["tid"], _kind(e)
        start, width = e["ts"] / 1e6, e["dur"] / 1e6
        ax.broken_barh([(start, width)], (lane - 0.4, 0.8), facecolor=COLORS[kind],
                       edgecolor="white", lw=0.5, gid=f"timeline-{e['name'].replace(' ', '-')}")
        if width > 0.07 * span and kind != "comm":  # room for "F mb0 s1" as "F0.1"
            ax.text(start + width / 2, lane, _short(e["name"]), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(2 * pp), [f"rank {r} {kind}" for r in range(pp)
                                  for kind in ("compute", "comm")])
    ax.invert_yaxis()
    ax.axvline(span, color=COLORS["predicted"], ls="--", lw=1.5,
               label=f"predicted step {span:.4g} s")
    if measured_s:
        median = statistics.median(measured_s)
        ax.axvline(median, color=COLORS["measured"], lw=2, gid="measured-step",
                   label=f"measured step (median) {median:.4g} s")
    ax.set_xlim(left=0)
    kinds = [Patch(color=COLORS[k], label=k) for k in ("forward", "backward", "optimizer",
                                                       "comm")]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + kinds, loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    return _svg(fig)


def _kind(event: dict) -> str:
    """The lane colour of a trace event: its thread's comm, else the action's kind."""
    if event["tid"]:
        return "comm"
    if event["name"] == "optimizer":
        return "optimizer"
    return "forward" if event["name"].startswith("F ") else "backward"  # B, I, W


def _short(name: str) -> str:
    """"F mb3 s1" as "F3.1" (action, micro-batch, stage); other names as they are."""
    parts = name.split()
    if len(parts) == 3 and parts[1].startswith("mb") and parts[2].startswith("s"):
        return f"{parts[0]}{parts[1][2:]}.{parts[2][1:]}"
    return name
