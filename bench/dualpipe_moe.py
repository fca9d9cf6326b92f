"""DualPipe-V against 1F1B (and ZB-V) on an MoE model: step time and exposed all-to-all time.

Measured: 4 gloo ranks, pp 2 x dp 2 with ep 2 (each stage's experts split over its two data
ranks), the same MoE model (4 blocks, width 128, 8 experts of width 256, top-2, sequences of
128 tokens, a global batch of 16 in micro-batches of 1, so 8 per pipeline, fp32, the built-in
corpus) under parallel.schedule = "1f1b", "zbv" and "dualpipev", one process start for all
three. After `--warmup` untimed steps, `--steps` timed steps; a step's time is the slowest
rank's. The exposed all-to-all time is read from the step's timelines: every MoE all-to-all
call (dispatch, combine, their backwards, the count exchange) is timed on each rank by
wrapping fivefold.comm.collectives.all_to_all, and the executor records its compute actions
(PipelineEngine.record_timeline); the all-to-all seconds inside the rank's compute actions are
exposed, since this executor runs a rank's actions one at a time and gloo's all-to-all blocks:
on CPU, DualPipe-V's F&B pairs are an order, not an overlap. Reported per layout: the median
step time, and the median over steps of the slowest rank's exposed all-to-all seconds.

Simulated: the planner's replay of the same three action lists for the same model and layout
on 4 H100-SXM GPUs (fivefold.planner.simulate), with DualPipe-V's pairs hiding each half's
communication behind the other half's compute (fivefold.planner.schedules.action_durations),
and the DualPipe-V step replayed again with no pair hiding anything: the difference is the
communication the pairs hide per step.

    python bench/dualpipe_moe.py                 # 6 timed steps after 2 warm-up
    python bench/dualpipe_moe.py --quick         # 2 timed steps after 1
    python bench/dualpipe_moe.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import harness
from fivefold.comm import collectives as C
from fivefold.config import load_config
from fivefold.planner.schedules import (action_durations, overlapped_pairs, replay_step,
                                        runtime_schedule)
from fivefold.planner.simulate import simulate
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

MODEL = ["model.layers=4", "model.hidden=128", "model.heads=4", "model.kv_heads=4",
         "model.ffn_hidden=256", "model.vocab=2048", "model.seq_len=128",
         "model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=256",
         "parallel.global_batch=16", "parallel.micro_batch=1", "parallel.pp=2",
         "parallel.ep=2", "parallel.zero_stage=1", "train.tensorboard=false",
         "train.sample_tokens=0"]
LAYOUTS = {"1f1b": ["parallel.schedule=1f1b"],
           "zbv": ["parallel.schedule=zbv", "parallel.vpp=2"],
           "dualpipev": ["parallel.schedule=dualpipev", "parallel.vpp=2"]}


def _inside(spans: list[tuple[float, float]], events) -> float:
    """Seconds of `spans` that fall inside the timeline's compute actions."""
    computing = [(e.start, e.end) for e in events if e.action.kind in ("F", "B", "I", "W")]
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in computing)


def timed_runs(rt, steps: int, warmup: int) -> dict:
    """Per layout, this rank's step times and exposed all-to-all seconds."""
    spans: list[tuple[float, float]] = []
    inner = C.all_to_all

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        spans.append((start, time.perf_counter()))
        return out

    C.all_to_all = timed  # the dispatcher calls it through the module
    out = {}
    for name, sets in LAYOUTS.items():
        trainer = Trainer(load_config(None, MODEL + sets), rt,
                          tempfile.mkdtemp(prefix="dualpipe-bench-"))
        trainer.pipeline.pipe.record_timeline = True
        times, exposed = [], []
        for step in range(warmup + steps):
            spans.clear()
            start = time.perf_counter()
            trainer.train_step(step)
            if step >= warmup:
                times.append(time.perf_counter() - start)
                exposed.append(_inside(spans, trainer.pipeline.pipe.timeline))
        out[name] = {"times": times, "exposed_a2a": exposed, "tokens": trainer.global_tokens}
    C.all_to_all = inner
    return out


def measured_table(steps: int, warmup: int) -> list[dict]:
    ranks = run_on_ranks(timed_runs, 4, steps, warmup, timeout_s=3600)
    rows = []
    for name in LAYOUTS:
        per = [r[name] for r in ranks]
        step_s = [max(r["times"][i] for r in per) for i in range(steps)]
        a2a = [max(r["exposed_a2a"][i] for r in per) for i in range(steps)]
        rows.append({"schedule": name, "step_s": statistics.median(step_s),
                     "tokens_per_s": per[0]["tokens"] / statistics.median(step_s),
                     "exposed_all_to_all_s": statistics.median(a2a)})
        print(f"measured {name}: step {rows[-1]['step_s']:.3f} s, exposed all-to-all "
              f"{rows[-1]['exposed_all_to_all_s']:.3f} s", flush=True)
    return rows


def simulated_table() -> list[dict]:
    rows = []
    for name, sets in LAYOUTS.items():
        cfg = load_config(None, MODEL + sets + ["cluster.gpu=H100-SXM", "cluster.gpus=4",
                                                "cluster.gpus_per_node=4"])
        est = simulate(cfg)
        row = {"schedule": name, "step_s": est.step_time_s}
        if name == "dualpipev":
            sm, lay = est.step_model, est.layout
            stage_times = [sm.stage_times(g) for g in range(lay.pp * lay.vpp)]
            sched = runtime_schedule(name, lay.pp, lay.vpp, lay.micro_batches)
            pairs = overlapped_pairs(name, lay.pp, lay.vpp, lay.micro_batches)
            spans = [max(replay_step(sched, action_durations(
                stage_times, 1, lay.micro_batches, None, p, sm.prof.eff.overlap_eff),
                sm.p2p_s).finish_s) for p in (pairs, {})]
            row["pipeline_s"], row["pipeline_s_no_pairs"] = spans
            row["hidden_by_pairs_s"] = spans[1] - spans[0]
        rows.append(row)
        print(f"simulated {name}: {row}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    result = {"machine": harness.machine_info(), "simulated_h100": simulated_table(),
              "measured_cpu": measured_table(steps, warmup)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
