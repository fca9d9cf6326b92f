"""Heterogeneous data parallelism on CPU ranks of unequal speed: the planner's heterogeneous
plan against the uniform plan of the same ranks, side by side in one run, each plan's
predicted step next to its measured one.

Three gloo ranks are pinned with `os.sched_setaffinity`: rank 0 alone on core 0, ranks 1 and
2 together on core 1, so rank 0 computes about twice as fast as each of the others (on a
machine with fewer than 2 cores the ranks are left unpinned and the run says so). Each rank
runs one intra-op thread. `--emulate K` instead leaves the ranks unpinned and makes ranks 1
and 2 K times slower by a sleep before each forward of (K - 1) times their measured compute
time per sequence (a throttle that emulates a slower device and, unlike pinning, survives a
loaded machine, whose scheduler moves other jobs off the doubly used core). Model: the
`tiny` preset, fp32, a global batch of 12 sequences of 256 tokens in micro-batches of 1,
AdamW with fivefold's defaults, on the built-in corpus.

1. Profiles and plan (bench/het_plan.py). The ranks are two cluster groups, `fast` (rank 0)
   and `slow` (ranks 1 and 2), each with a CPU profile from `fivefold calibrate`'s code
   calibrated for its situation (pinned: on its own cores with its own number of ranks;
   emulated: one 3-rank calibration, the slow group's rates divided by K). The planner's
   heterogeneous simulate (fivefold.planner.hetero_simulate) gives the heterogeneous plan's
   `parallel.dp_batch_shares` and its predicted step, and the predicted step of the uniform
   plan (4 + 4 + 4 sequences). Nothing is fitted to this run's timings.
2. Speed. All ranks at once time `--calibration` forward and backward passes of 4 sequences
   on the plain model (with --emulate this also sets the throttle); reported only, the
   shares come from the planner.
3. Timing. Two Trainers live on the same ranks: `uniform` and `planned`. After `--warmup`
   untimed steps each, `--rounds` rounds of timed steps alternate between them (the order
   swapped each round), each timed stretch between barriers, so the machine's noise hits
   both alike. Reported: median seconds per step and tokens/s over the rounds per plan
   (and the best round), each round's seconds, the predicted step and its error, the load
   average, and the ratio of the medians.

The shared development machine has 2 cores and other jobs run on it, so absolute figures
move from run to run; the ratio between plans measured in the same rounds is the result.

    python bench/heterogeneous.py            # 6 rounds of 1 timed step per plan
    python bench/heterogeneous.py --quick    # smoke test: 1 round of 1 step
    python bench/heterogeneous.py --emulate 2   # ranks 1 and 2 throttled to half speed
    python bench/heterogeneous.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import TrainerSide, add_timing_args, machine_info, split_rounds, write_json
from het_plan import calibrate_groups, planned

WORLD = 3
GLOBAL_BATCH = 12
PRESET = "tiny"
CORES = {0: {0}, 1: {1}, 2: {1}}  # rank -> the cores it may run on
EMULATED_SLOW = (1, 2)  # --emulate K: the ranks made K times slower


def pin(rank: int) -> list[int] | None:
    """Pin this rank by CORES; its cores, or None where the machine lacks them."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return None
    os.sched_setaffinity(0, CORES[rank])
    return sorted(os.sched_getaffinity(0))


def bench_config(shares: list[int] | None):
    """The run (module docstring); `shares`: parallel.dp_batch_shares, None for uniform."""
    from fivefold.config import load_config

    sets = [f"model.preset={PRESET}", f"parallel.global_batch={GLOBAL_BATCH}",
            "parallel.micro_batch=1",
            "parallel.precision=fp32", "train.tensorboard=false", "train.sample_tokens=0"]
    if shares:
        sets.append(f"parallel.dp_batch_shares={shares}")
    return load_config(None, sets)


def throttle(model, seconds_per_row: float) -> None:
    """`--emulate`: before each forward, sleep `seconds_per_row` per sequence of the batch,
    so the rank computes as a device (1 + seconds_per_row x its speed) times slower would."""
    model.register_forward_pre_hook(lambda _, inputs: time.sleep(seconds_per_row
                                                                 * inputs[0].shape[0]))


def measure_speed(passes: int, slowdown: float) -> tuple[float, float]:
    """(sequences per second of this rank, the throttle's seconds per sequence): forward and
    backward of a uniform plan's rows, `passes` times after an untimed warm-up pass and a
    pass that sets the throttle of `slowdown` (1: none) from its time."""
    import torch

    from fivefold.models.llama import build_model

    cfg = bench_config(None)
    model = build_model(cfg.model, cfg.train.seed)
    rows = GLOBAL_BATCH // WORLD
    x = torch.randint(0, cfg.model.vocab, (rows, cfg.model.seq_len))

    def once():
        start = time.perf_counter()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        return time.perf_counter() - start

    once()
    per_row = (slowdown - 1) * once() / rows
    if per_row:
        throttle(model, per_row)
    start = time.perf_counter()
    for _ in range(passes):
        once()
    return rows * passes / (time.perf_counter() - start), per_row


def rank_main(_, args: dict) -> dict:
    """One rank: pin (or throttle), measure its speed, then time both plans (their rows
    from the planner, in `args`) round by round."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    cores = None if args["emulate"] else pin(rank)
    dist.barrier()
    slowdown = args["emulate"] if args["emulate"] and rank in EMULATED_SLOW else 1.0
    measured, per_row = measure_speed(args["calibration"], slowdown)
    speed = torch.tensor([measured], dtype=torch.float64)
    speeds = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(speeds, speed)
    speeds = [float(s) for s in speeds]
    total = args["warmup"] + args["steps"]
    sides = {name: TrainerSide(bench_config(rows if name != "uniform" else None),
                               total, rank, WORLD) for name, rows in args["rows"].items()}
    for side in sides.values():
        if per_row:
            throttle(side.trainer.model, per_row)
        side.run(args["warmup"])
    seconds = {name: [] for name in sides}
    for k, n in enumerate(split_rounds(args["steps"], args["rounds"])):
        for name in (list(sides) if k % 2 == 0 else list(sides)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            sides[name].run(n)
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / n)
    return {"cores": cores, "speed_seq_per_s": speeds[rank], "seconds_per_step": seconds}


def report(results: list[dict], args: dict, plan: dict, groups: list[dict]) -> dict:
    first = results[0]
    speeds = [r["speed_seq_per_s"] for r in results]
    tokens = GLOBAL_BATCH * bench_config(None).model.seq_len
    plans = {}
    for name, p in plan.items():
        rounds = first["seconds_per_step"][name]
        step_s = statistics.median(rounds)
        plans[name] = {"rows": p["rows"], "predicted_step_s": p["predicted_step_s"],
                       "predicted_error": p["predicted_step_s"] / step_s - 1,
                       "planner_groups": p["groups"], "step_s": step_s,
                       "tokens_per_s": tokens / step_s, "best_tokens_per_s": tokens / min(rounds),
                       "rounds_s": rounds}
    u, m = plans["uniform"], plans["planned"]
    run_args = {k: v for k, v in args.items() if k != "rows"}
    return {"machine": machine_info(pinned={r: res["cores"] for r, res in enumerate(results)}),
            "config": {"preset": PRESET, "global_batch": GLOBAL_BATCH, "world": WORLD,
                       "micro_batch": 1, **run_args},
            "groups": groups, "speed_seq_per_s": speeds, "plans": plans,
            "ratio": {"tokens_per_s": m["tokens_per_s"] / u["tokens_per_s"],
                      "predicted": u["predicted_step_s"] / m["predicted_step_s"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap, steps=6, rounds=6, warmup=1, what="plan")
    ap.add_argument("--calibration", type=int, default=3,
                    help="timed forward+backward passes per rank for its speed (default 3)")
    ap.add_argument("--emulate", type=float, default=0.0, metavar="K",
                    help="instead of pinning, make ranks 1 and 2 K times slower by sleeping "
                         "before each forward (K - 1 times their measured compute time)")
    ap.add_argument("--profiles", metavar="DIR",
                    help="write the groups' calibrated profiles here (default: a temp folder)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up, 1 round of 1 step")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rounds, a.warmup, a.calibration = 1, 1, 1, 1
    args = {"steps": a.steps, "rounds": a.rounds, "warmup": a.warmup,
            "calibration": a.calibration, "emulate": a.emulate}
    from fivefold.local_ranks import run_local
    from fivefold.train.data import prepare_data

    prepare_data(bench_config(None), log=lambda text: print(text, file=sys.stderr))
    load_at_start = os.getloadavg()
    groups = calibrate_groups(a.emulate, a.profiles)
    plan = planned(groups, GLOBAL_BATCH, PRESET, WORLD)
    args["rows"] = {name: p["rows"] for name, p in plan.items()}
    res = report(run_local(rank_main, WORLD, args, timeout_s=3600), args, plan, groups)
    res["machine"]["load_average_at_start"] = load_at_start
    pinned = res["machine"]["pinned"]
    print(f"ranks pinned to cores {pinned}" if pinned[0] else
          f"ranks not pinned; ranks 1 and 2 emulated {a.emulate}x slower" if a.emulate else
          "ranks not pinned (< 2 cores)")
    print(f"load average (1, 5, 15 min) at start {load_at_start}, at the end "
          f"{res['machine']['load_average']}")
    for g in res["groups"]:
        print(f"group {g['name']} ({g['gpus']} rank(s)): {g['how']} -> {g['profile']}")
    print("speed (sequences/s, fwd+bwd, reported only): "
          + ", ".join(f"{s:.2f}" for s in res["speed_seq_per_s"]))
    for name, p in res["plans"].items():
        print(f"{name:8s} rows {p['rows']}: {p['tokens_per_s']:6.0f} tokens/s (best round "
              f"{p['best_tokens_per_s']:.0f}), step {p['step_s']:.2f} s, planner predicted "
              f"{p['predicted_step_s']:.2f} s ({p['predicted_error']:+.0%}); rounds "
              + " ".join(f"{t:.2f}" for t in p["rounds_s"]))
    print(f"planned / uniform tokens/s: {res['ratio']['tokens_per_s']:.2f} "
          f"(predicted by the planner: {res['ratio']['predicted']:.2f})")
    write_json(a.json, res)


if __name__ == "__main__":
    main()
