"""Muon on CPU ranks under ZeRO-1 against Muon under DDP: tokens/s and peak memory per rank.

Both sides train fivefold's Trainer on the same fixed setup as bench/data_parallel.py (the
`tiny` preset, fp32 on the CPU, a global batch of 8 sequences x 256 tokens, no gradient
accumulation, the built-in corpus, gradient clipping at 1.0), with `train.optimizer =
"muon"` (Muon, Jordan et al. 2024: momentum orthogonalized by Newton-Schulz on every block
matrix, AdamW on the rest), on `--nproc` gloo ranks (default 4):

* ddp     `parallel.zero_stage = 0`: every rank keeps the whole momentum and orthogonalizes
          every matrix (fivefold.optim);
* zero-1  `parallel.zero_stage = 1`: the optimizer states sharded, each matrix gathered whole
          to the rank that owns it, orthogonalized there and its update scattered back, the
          owners spread so that Newton-Schulz divides over the ranks
          (fivefold.parallel.muon_sharded).

Speed: one start of `--nproc` ranks builds both sides' trainers in each rank process, runs
untimed warm-up steps of each, then `--rounds` rounds of timed steps, side after side (the
order rotated each round) so machine noise hits both alike; a timed run starts and ends on a
barrier and its time is the slowest rank's. Reported: the median tokens/s over the rounds.

Memory: a start of its own per side (a process's peak resident set, `VmHWM`, is its whole
life's, so a rank that trained both sides could not tell them apart): each rank's peak after
`--memory-steps` steps, its peak after imports and process-group set-up (the growth is the
difference), and the ledger's model-state bytes (parameters, gradients, optimizer states)
of the rank. Reported per side: the largest rank's peak and growth; ratios are zero-1 / ddp.

    python bench/muon.py                   # 24 timed steps per side, 4 rounds of 6
    python bench/muon.py --quick           # smoke test: 2 steps, 1 round, 1 warm-up
    python bench/muon.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import (SPEED_MEMORY_HEADER, TrainerSide, add_timing_args, machine_info,
                     memory_summary, rotated, rss_mib, speed_memory_cells, speed_memory_ratios,
                     split_rounds, write_json)

SIDES = {"ddp": 0, "zero-1": 1}  # side: ZeRO stage
REFERENCE = "ddp"
GLOBAL_BATCH = 8
SEQ_LEN = 256
PRESET = "tiny"


def bench_config(zero_stage: int, world: int):
    """The fixed config of a side (imported lazily, in each rank process)."""
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    cfg = load_config(None, [f'model.preset="{PRESET}"', f"model.seq_len={SEQ_LEN}",
                             f"parallel.global_batch={GLOBAL_BATCH}", 'parallel.precision="fp32"',
                             f"parallel.zero_stage={zero_stage}", 'train.optimizer="muon"',
                             'train.device="cpu"', "train.compile=false",
                             "train.tensorboard=false", "train.sample_tokens=0"])
    validate_for_training(cfg, world)
    return cfg


def _rates_on_ranks(rt, per_round: list[int], warmup: int, threads: int) -> dict:
    """Both sides in this rank: warm-up, then the rotated timed rounds; seconds per run."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    total = warmup + sum(per_round)
    sides = {name: TrainerSide(bench_config(stage, rt.world_size), total, rt.rank,
                               rt.world_size) for name, stage in SIDES.items()}
    for side in sides.values():
        side.run(warmup)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    losses = {}
    for r, n in enumerate(per_round):
        for name in rotated(list(sides), r):
            dist.barrier()
            start = time.perf_counter()
            losses[name] = sides[name].run(n)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": seconds, "losses": losses}


def _peak_on_ranks(rt, zero_stage: int, steps: int, threads: int) -> dict:
    """One side alone in this rank: peak RSS before and after `steps` steps, model states."""
    import torch

    import fivefold.train.trainer  # noqa: F401  (the libraries, before the baseline)

    torch.set_num_threads(threads)
    base = rss_mib("VmHWM")  # not VmRSS: idle file pages may be reclaimed
    side = TrainerSide(bench_config(zero_stage, rt.world_size), steps, rt.rank, rt.world_size)
    side.run(steps)
    return {"base_rss_mib": base, "peak_rss_mib": rss_mib("VmHWM"),
            "model_state_bytes": dict(side.trainer.ledger.model_state_bytes)}


def run_bench(nproc: int, steps: int, rounds: int, warmup: int, memory_steps: int,
              threads: int) -> dict:
    from fivefold.testing import run_on_ranks
    from fivefold.train.data import prepare_data

    if GLOBAL_BATCH % nproc:
        raise SystemExit(f"--nproc ({nproc}) must divide the global batch of {GLOBAL_BATCH}")
    load_before = os.getloadavg()
    prepare_data(bench_config(0, nproc), log=lambda text: print(text, file=sys.stderr))
    per_round = split_rounds(steps, rounds)
    print(f"speed: both sides on {nproc} ranks, {rounds} round(s)", file=sys.stderr)
    timed = run_on_ranks(_rates_on_ranks, nproc, per_round, warmup, threads, timeout_s=3600)
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    sides = {}
    for name in SIDES:
        slowest = [max(rank["seconds"][name][r] for rank in timed) for r in range(rounds)]
        rates = [n * tokens_per_step / s for n, s in zip(per_round, slowest)]
        sides[name] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
                       "last_loss": timed[0]["losses"][name]}
    for name, stage in SIDES.items():
        print(f"memory: {name} alone on {nproc} ranks, {memory_steps} step(s)", file=sys.stderr)
        ranks = run_on_ranks(_peak_on_ranks, nproc, stage, memory_steps, threads,
                             timeout_s=3600)
        peaks = [r["peak_rss_mib"] for r in ranks]
        bases = [r["base_rss_mib"] for r in ranks]
        sides[name].update(memory_summary(peaks, bases),
                           model_state_bytes_per_rank=[r["model_state_bytes"] for r in ranks])
    ref = sides[REFERENCE]
    ratios = {name: {"reference": REFERENCE, **speed_memory_ratios(s, ref),
                     "optimizer_bytes": (s["model_state_bytes_per_rank"][0]["optimizer"]
                                         / ref["model_state_bytes_per_rank"][0]["optimizer"])}
              for name, s in sides.items() if name != REFERENCE}
    return {"config": {"preset": PRESET, "precision": "fp32", "device": "cpu",
                       "backend": "gloo", "optimizer": "muon", "nproc": nproc,
                       "threads_per_rank": threads, "global_batch": GLOBAL_BATCH,
                       "seq_len": SEQ_LEN, "tokens_per_step": tokens_per_step,
                       "timed_steps": steps, "rounds": rounds, "steps_per_round": per_round,
                       "warmup_steps": warmup, "memory_steps": memory_steps},
            "machine": dict(machine_info(), load_average_before=load_before),
            "sides": sides, "ratios": ratios}


def print_table(res: dict) -> None:
    c, m = res["config"], res["machine"]
    print(f"Muon, {c['preset']} preset, {c['precision']} on {c['device']} ({c['backend']}), "
          f"{c['nproc']} ranks x {c['threads_per_rank']} thread(s), batch {c['global_batch']} x "
          f"{c['seq_len']} tokens, {c['timed_steps']} timed steps per side in {c['rounds']} "
          f"round(s) (+{c['warmup_steps']} warm-up); {m['cpu_count']} CPUs, load "
          f"{m['load_average_before'][0]:.2f} before / {m['load_average'][0]:.2f} after, "
          f"torch {m['torch']}")
    print(f"{'side':<8}{SPEED_MEMORY_HEADER}{'optimizer/rank':>16}{'ratio':>8}")
    for name, s in res["sides"].items():
        r = res["ratios"].get(name)
        opt = s["model_state_bytes_per_rank"][0]["optimizer"]
        opt_ratio = f"{r['optimizer_bytes']:>8.3f}" if r else f"{'':>8}"
        print(f"{name:<8}{speed_memory_cells(s, r)}{opt / 2**20:>12,.2f} MiB{opt_ratio}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="ranks per side (default 4)")
    add_timing_args(ap, steps=24, rounds=4, warmup=2)
    ap.add_argument("--memory-steps", type=int, default=3,
                    help="steps of each side's memory run (default 3)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: CPUs / nproc, at least 1)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 2 steps, 1 round, 1 warm-up, 1 memory step")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup, args.memory_steps = 2, 1, 1, 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    res = run_bench(args.nproc, args.steps, args.rounds, args.warmup, args.memory_steps,
                    threads)
    print_table(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
