"""Plain text of `fivefold plan --objective ...` and of plan on a cluster of device groups:
one row per placement (kind, devices, step, tokens/s, MFU, cost, goodput, layout), the
cluster's groups with where their profiles come from, the best placement's parts per group,
its checkpoint interval with the figures it came from, and the keys that train it."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.planner.objective import Scored, cluster_lines
from fivefold.planner.report import SEARCHED, layout_line, stack_line

GiB = 2**30
LABEL = {"time": "step time", "cost": "USD per million productive tokens",
         "goodput": "productive tokens per second (tokens/s x goodput)"}


def objective_text(items: list[Scored], cfg: Config, groups: list, objective: str,
                   scored: int | None, seconds: float, top: int) -> str:
    """`scored`: placements the search scored (None for simulate's one layout)."""
    lines = [stack_line(cfg), *cluster_lines(groups), f"objective: {LABEL[objective]}",
             f"{'#':>2} {'kind':9} {'devices':>7} {'step s':>8} {'tok/s':>11} {'MFU':>6} "
             f"{'$/Mtok':>7} {'goodput':>7}  layout"]
    for i, s in enumerate(items[:top], 1):
        e = s.estimate
        cost = f"{s.usd_per_million_productive:7.3f}" if s.usd_per_million_tokens is not None \
            else f"{'-':>7}"
        good = f"{100 * s.goodput.fraction:6.2f}%" if s.goodput else f"{'-':>7}"
        lines.append(f"{i:2d} {s.kind:9} {sum(g.gpus for g in s.groups):7d} "
                     f"{e.step_time_s:8.4g} {e.tokens_per_s:11,.0f} {100 * e.mfu:5.1f}% "
                     f"{cost} {good}  {layout_line(e.parallel)}")
    if scored is not None:
        lines.append(f"\nscored {scored} placements in {seconds:.1f} s")
    if not items:
        lines.append("no placement fits: add devices, shorten the sequence or lower the batch")
        return "\n".join(lines)
    best = items[0]
    lines.append(f"best: {best.kind} on {', '.join(g.label for g in best.groups)}")
    for d in best.detail:
        parts = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in d.items() if k != "group")
        lines.append(f"  {d['group']}: {parts}")
    mem = best.estimate.memory_per_gpu_bytes
    lines.append(f"  most loaded device: {mem['total'] / GiB:.1f} GiB")
    if best.goodput:
        g = best.goodput
        lines.append(f"goodput {100 * g.fraction:.2f}%: job MTBF {g.job_mtbf_h:.2f} h, "
                     f"checkpoint {g.checkpoint_bytes / 1e12:.3g} TB saved in {g.save_s:.3g} s, "
                     f"restart {g.restart_s:.0f} s (load {g.load_s:.3g} s); checkpoint every "
                     f"{g.checkpoint_minutes:.1f} min (Daly 2006's optimum)")
    lines.append("\ntrain it with:\n  " + " ".join(run_sets(best)))
    return "\n".join(lines)


def run_sets(s: Scored) -> list[str]:
    """The `--set` arguments that write the placement's layout, batch shares and checkpoint
    interval into the spec."""
    p, out = s.estimate.parallel, []
    for key in SEARCHED:
        value = p.get(key)
        if value is None or key == "stage_layers" and p["pp"] * p["vpp"] == 1:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value).replace(" ", "")
        out.append(f"--set parallel.{key}={text}")
    if "dp_batch_shares" in p:
        out.append(f"--set parallel.dp_batch_shares={str(p['dp_batch_shares']).replace(' ', '')}")
    if s.goodput:
        out.append(f"--set train.checkpoint_minutes={s.goodput.checkpoint_minutes:.2f}")
    return out
