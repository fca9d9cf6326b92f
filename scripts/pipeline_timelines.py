"""Draw every pipeline schedule and table its bubble: the pictures and numbers of docs/pipeline.md.

    PYTHONPATH=src python scripts/pipeline_timelines.py            # writes docs/img, docs/traces
    PYTHONPATH=src python scripts/pipeline_timelines.py --only zbv # one schedule's files

For each schedule: the simulator's replay of its action lists with unit costs (T_F = 1,
T_B = 2) on 4 stages and 8 micro-batches (docs/img/pipeline_<name>_sim.png and a trace), and a
real run on CPU gloo ranks (pp 2, 4 micro-batches; 4 ranks would share this machine's 2 cores)
recorded by the executor (docs/img/pipeline_<name>_cpu.png and a trace). It prints the bubble
table: theory, the replay with unit costs, the replay with the costs the run measured (the
median time of each compute action per stage: what the planner predicts from a profile), and
the measured idle share of the real run (the median over the steps after one warm-up step).
Synthetic tokens: only time is measured. The V schedules (ZB-V, DualPipe-V) have no closed
form (their theory column is nan); `--only zbv dualpipev` redraws just them.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.optim import build_optimizer
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline.build import build_pipeline_stage
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.pipedream_2bw import PipeDream2BWEngine
from fivefold.parallel.pipeline.replay import Event, bubble_fraction, replay
from fivefold.parallel.pipeline.schedule_theory import theory_bubble
from fivefold.parallel.pipeline.schedules import (COMPUTE, UPDATE, build_schedule,
                                                  pipedream_2bw_schedule)
from fivefold.parallel.pipeline.timeline import chrome_trace, plot_timeline
from fivefold.parallel.plan import plan_from_config
from fivefold.testing import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.layers=8", "model.hidden=256", "model.heads=8", "model.kv_heads=4",
         "model.ffn_hidden=704", "model.vocab=2048", "model.seq_len=128",
         "model.tied_embeddings=true"]
# (file name, schedule, vpp, token slices, title)
SCHEDULES = [("gpipe", "gpipe", 1, 1, "GPipe"), ("1f1b", "1f1b", 1, 1, "1F1B"),
             ("interleaved", "interleaved", 2, 1, "interleaved 1F1B, vpp 2"),
             ("zb", "zb", 1, 1, "ZB-H1"), ("terapipe", "terapipe", 1, 2, "TeraPipe, 2 slices"),
             ("2bw", "pipedream-2bw", 1, 1, "PipeDream-2BW, 3 steps"),
             ("zbv", "zbv", 2, 1, "ZB-V"), ("dualpipev", "dualpipev", 2, 1, "DualPipe-V")]
STEPS_2BW = 3
COMPUTE_OR_UPDATE = COMPUTE + (UPDATE,)


def measure(rt, name, schedule, vpp, slices, micro_batches, steps):
    """Timelines of `steps` steps of one schedule on these ranks (synthetic tokens)."""
    torch.manual_seed(0)
    sets = MODEL + [f"parallel.pp={rt.world_size}", f"parallel.schedule={schedule}",
                    f"parallel.vpp={vpp}", "parallel.global_batch=8",
                    f"parallel.micro_batch={8 // micro_batches}"]
    if schedule == "terapipe":
        sets.append(f"parallel.token_slices={slices}")
    cfg = load_config(None, sets)
    mesh = Mesh({"pp": rt.world_size, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1},
                "cpu", Ledger())
    axis = mesh.axis("pp")
    plan = plan_from_config(cfg, rt.world_size)
    stage = build_pipeline_stage(cfg, plan, axis.rank, rt.device)
    tokens = torch.randint(0, cfg.model.vocab, (8, cfg.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    optimizer = build_optimizer(stage, cfg.train, rt.device)
    if schedule == "pipedream-2bw":
        engine = PipeDream2BWEngine(stage, axis, micro_batches, steps, optimizer,
                                    lambda step: batch, 1e-4, record_timeline=True)
        for step in range(steps):
            engine.train_step(step, 1e-4)
        return [engine.timeline]
    train, _ = plan.pipeline_schedules(cfg.model.tied_embeddings)
    engine = PipelineEngine(stage, train, axis, record_timeline=True)
    out = []
    for _ in range(steps):
        engine.train_step(*batch, 1e-4)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(engine.timeline)
    return out


def measured_cost(events: list[Event]):
    """Cost model from a recorded run: the median duration of each (kind, stage, slice)."""
    spans: dict[tuple, list[float]] = {}
    for e in events:
        a = e.action
        spans.setdefault((a.kind, a.stage, a.slice), []).append(e.end - e.start)
    medians = {k: statistics.median(v) for k, v in spans.items()}
    return lambda a: medians[(a.kind, a.stage, a.slice)] if a.kind in COMPUTE_OR_UPDATE else 0.0


def simulated(schedule: str, pp: int, micro_batches: int, vpp: int, slices: int):
    if schedule == "pipedream-2bw":
        return pipedream_2bw_schedule(pp, micro_batches, STEPS_2BW, tied_embeddings=True)
    return build_schedule(schedule, pp, micro_batches, vpp, slices, tied_embeddings=True)


def theory(schedule: str, pp: int, micro_batches: int, vpp: int, slices: int) -> float:
    if schedule == "pipedream-2bw":  # one warm-up and one drain for the whole run
        return theory_bubble("1f1b", pp, micro_batches * STEPS_2BW)
    if schedule in ("zbv", "dualpipev"):  # a list scheduler's order: no closed form
        return float("nan")
    return theory_bubble(schedule, pp, micro_batches, vpp, slices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="ranks of the measured runs")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per schedule")
    parser.add_argument("--only", nargs="+", help="these schedules' file names (default all)")
    args = parser.parse_args()
    img, traces = ROOT / "docs" / "img", ROOT / "docs" / "traces"
    img.mkdir(parents=True, exist_ok=True)
    traces.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, schedule, vpp, slices, title in SCHEDULES:
        if args.only and name not in args.only:
            continue
        sim = simulated(schedule, 4, 8, vpp, slices)
        events = replay(sim)
        plot_timeline(events, img / f"pipeline_{name}_sim.png",
                      f"{title}: replay of the action lists, p = 4, m = 8, unit costs", 4,
                      "T_F")
        chrome_trace(events, traces / f"pipeline_{name}_sim.json")
        p, m = args.pp, args.micro_batches
        steps = STEPS_2BW if schedule == "pipedream-2bw" else args.steps
        runs = run_on_ranks(measure, p, name, schedule, vpp, slices, m, steps, timeout_s=900)
        per_step = [sum((rank[i] for rank in runs), []) for i in range(len(runs[0]))]
        measured = [bubble_fraction(e) for e in per_step[1:] or per_step]
        shown = per_step[-1]
        plot_timeline(shown, img / f"pipeline_{name}_cpu.png",
                      f"{title}: recorded on {p} CPU ranks, m = {m}", p, "s")
        chrome_trace(shown, traces / f"pipeline_{name}_cpu.json", seconds_per_unit=1.0)
        run_schedule = simulated(schedule, p, m, vpp, slices)
        costs = measured_cost([e for step in per_step[1:] or per_step for e in step])
        rows.append((title, theory(schedule, 4, 8, vpp, slices), bubble_fraction(events),
                     theory(schedule, p, m, vpp, slices), bubble_fraction(replay(run_schedule)),
                     bubble_fraction(replay(run_schedule, costs)), statistics.median(measured)))
    print("| schedule | theory p4 m8 | replay p4 m8 | theory "
          f"p{args.pp} m{args.micro_batches} | replay | replay, measured costs | "
          "measured (CPU) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for title, *values in rows:
        print(f"| {title} | " + " | ".join(f"{v:.3f}" for v in values) + " |")


if __name__ == "__main__":
    main()
