"""The run report: one self-contained HTML page (inline SVG figures, inline CSS, no scripts,
no fonts or anything else fetched at view time) with the run's loss and validation curves,
throughput, memory measured against the planner's prediction, the communication ledger's
bytes per mesh axis, the predicted step timeline against the measured step time, and the
config. Each section that lacks its input says what is missing instead.
"""

from __future__ import annotations

import html
import json
import statistics
from collections import defaultdict
from datetime import datetime, timezone

from fivefold.report import plots
from fivefold.report.predicted import Prediction, predict, profile_line
from fivefold.report.run_data import RunData

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0;
       background: #fff; color: #222; }
main { width: 900px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 24px; margin: 8px 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.note { color: #8a5a00; background: #fff7e0; padding: 6px 10px; border-radius: 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 10px; font-size: 12px; overflow-x: auto; }
figure { margin: 8px 0; } figure svg { max-width: 100%; height: auto; }
"""
MiB = 2 ** 20
MEMORY_ROWS = (("params", "parameters"), ("grads", "gradients"),
               ("optimizer", "optimizer states + master copies"),
               ("host", "optimizer states, host"), ("disk", "optimizer states, disk"),
               ("activations_per_micro_batch", "activations, one micro-batch"),
               ("activations_host", "activations, host, one micro-batch"))


def render(run: RunData, profile: str | None = None) -> str:
    """The whole page for `run`; `profile`: the hardware profile the prediction uses."""
    prediction = predict(run, profile)
    sections = [_overview(run), _curves(run), _memory(run), _ledger(run),
                _timeline(run, prediction), _config(run)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>fivefold run report: {_e(str(run.run_dir))}</title>"
            f"<style>{CSS}</style></head><body><main>\n" + "\n".join(sections)
            + "\n</main></body></html>\n")


def _e(text: str) -> str:
    return html.escape(text)


def _note(text: str) -> str:
    return f"<p class=\"note\">{_e(text)}</p>"


def _table(header: list[str] | None, rows: list[list[str]]) -> str:
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _overview(run: RunData) -> str:
    total = run.config["train"]["steps"] if run.config else None
    rows = [["run directory", str(run.run_dir)],
            ["steps logged", f"{len(run.records)}" + (f" of {total}" if total else "")]]
    if run.records:
        rows.append(["last training loss", f"{run.records[-1]['loss']:.4f}"])
        rows.append(["median tokens/s", f"{statistics.median(_tokens_per_s(run)):,.0f}"])
    vals = [r["val_loss"] for r in run.records if r.get("val_loss") is not None]
    if vals:
        rows.append(["last validation loss", f"{vals[-1]:.4f}"])
    if run.plan:
        p = run.plan
        rows.append(["layout", f"dp {p['dp']}, tp {p['tp']}, pp {p['pp']}, cp {p['cp']}, "
                               f"ep {p['ep']}, ZeRO stage {p['zero_stage']}, "
                               f"micro-batch {p['micro_batch']}, {p['precision']}"])
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notes = "".join(_note(m) for m in run.missing)
    return (f"<h1>fivefold run report</h1><p>Generated {stamp}.</p>{notes}"
            + _table(None, rows))


def _tokens_per_s(run: RunData) -> list[float]:
    return [r["tokens_per_s"] for r in run.records if r.get("tokens_per_s")]


def _curves(run: RunData) -> str:
    out = ["<h2>Loss and validation loss</h2>"]
    if not run.records:
        return out[0] + _note("no steps logged yet") + "<h2>Throughput</h2>" + _note(
            "no steps logged yet")
    initial = run.summary.get("initial_val_loss") if run.summary else None
    if initial is None and not any(r.get("val_loss") is not None for r in run.records):
        out.append(_note("no validation loss yet (it is measured every train.eval_every "
                         "steps and at the end)"))
    out.append(f"<figure>{plots.loss_plot(run.records, initial)}</figure>")
    out.append("<h2>Throughput</h2>")
    if _tokens_per_s(run):
        out.append(f"<figure>{plots.throughput_plot(run.records)}</figure>")
    return "".join(out)


def _memory(run: RunData) -> str:
    head = "<h2>Memory: measured against predicted</h2>"
    memory = (run.summary or {}).get("memory")
    if not memory:
        return head + _note("no memory report: summary.json is written when the run ends")
    measured, predicted = memory["measured"], memory.get("predicted") or {}
    rows = [(label, measured[key], predicted.get(key)) for key, label in MEMORY_ROWS
            if measured.get(key) or predicted.get(key)]
    table = [[label, _mib(m), _mib(p)] for label, m, p in rows]
    table.append(["process peak (a bound on CPU: the resident set)",
                  f"{measured['process_peak'] / MiB:.2f}", "-"])
    text = "" if predicted else _note("the run recorded no planner prediction")
    if predicted.get("micro_batches_in_flight", 1) > 1:
        text += (f"<p>The pipeline holds up to {predicted['micro_batches_in_flight']} "
                 "micro-batches' activations at its peak; activations are not measured "
                 "with pp &gt; 1 (the forwards run inside the schedule).</p>")
    return (head + f"<p>Rank {memory['rank']}, MiB.</p>{text}"
            + f"<figure>{plots.memory_plot(rows)}</figure>"
            + _table(["", "measured MiB", "predicted MiB"], table))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def _ledger(run: RunData) -> str:
    head = "<h2>Communication ledger: bytes per mesh axis</h2>"
    last = next((r for r in reversed(run.records) if r.get("ledger", {}).get("comm")), None)
    if last is None:
        why = "no steps logged yet" if not run.records else (
            "no collectives recorded: a run on one rank communicates nothing")
        return head + _note(why)
    comm = last["ledger"]["comm"]
    per_axis: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    rows = []
    for key, entry in sorted(comm.items()):
        op, axis = key.split("@", 1)
        per_axis[axis][0] += entry["bytes"]
        per_axis[axis][1] += entry["wire_bytes"]
        rows.append([op, axis, str(entry["calls"]), f"{entry['bytes'] / MiB:.3f}",
                     f"{entry['wire_bytes'] / MiB:.3f}"])
    svg = plots.ledger_plot({a: tuple(v) for a, v in per_axis.items()}, last["step"])
    return (head + f"<p>Rank 0, step {last['step']}: every collective the step issued "
                   "(fivefold.comm.ledger).</p>"
            + f"<figure>{svg}</figure>"
            + _table(["operation", "mesh axis", "calls", "MiB", "wire MiB"], rows))


def _timeline(run: RunData, prediction: Prediction | str) -> str:
    head = "<h2>Predicted step timeline against the measured step time</h2>"
    if isinstance(prediction, str):
        return head + _note(prediction)
    est, measured = prediction.estimate, [s for _, s in run.step_times_s()]
    bd = ", ".join(f"{k} {v:.4g} s" for k, v in est.breakdown_s.items())
    lines = [f"Profile: {profile_line(prediction.profile)}.",
             f"Predicted step {est.step_time_s:.4g} s ({bd})."]
    if measured:
        median = statistics.median(measured)
        lines.append(f"Measured step (median of {len(measured)}) {median:.4g} s: "
                     f"{median / est.step_time_s:.2f} x the prediction.")
    svg = plots.timeline_plot(prediction.events, est.layout.pp, measured)
    return head + "".join(f"<p>{_e(t)}</p>" for t in lines) + f"<figure>{svg}</figure>"


def _config(run: RunData) -> str:
    head = "<h2>Config</h2>"
    if run.config is None:
        return head + _note("no config: it is stored with each checkpoint")
    lines = [f"# from {run.checkpoint}"]
    for section, table in run.config.items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {json.dumps(value)}" if value is not None else f"# {key}: unset"
                  for key, value in table.items()]
    return head + f"<pre>{_e(chr(10).join(lines))}</pre>"
