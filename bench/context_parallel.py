"""Context parallelism on CPU ranks: how long a sequence fits under a memory cap, and speed.

Two measurements of fivefold's Trainer on one fixed small model (2 blocks, hidden 128, 8 heads
with 2 key/value heads, fp32, the built-in corpus, one sequence per step):

* memory: for cp = 1, 2 and 4 (ring attention) and sequence lengths doubling from 1,024, the
  bytes each rank's blocks and root save for backward over one step (saved-tensor hooks,
  fivefold.memory.activation_count; the largest rank) with the planner's prediction of the
  same bytes next to it, each rank's peak resident memory, and the longest length whose saved
  bytes stay under `--cap-mib` and that trains at all (a rank the kernel kills for memory
  ends the column: the block attention's math path holds a block's scores while it runs);
* speed: at `--length` tokens on 4 ranks, the median tokens/s of cp 4 in each mode (ring,
  Ulysses, the 2 x 2 hybrid) over `--rounds` rounds, and the ratio to the same global batch
  trained data-parallel (dp 4, cp 1) in the same run.

    python bench/context_parallel.py                 # the table in docs/context_parallel.md
    python bench/context_parallel.py --quick         # smoke test: short lengths, 1 round
    python bench/context_parallel.py --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import machine_info, rss_mib, write_json

MODEL = ["model.layers=2", "model.hidden=128", "model.heads=8", "model.kv_heads=2",
         "model.ffn_hidden=256", "model.vocab=8192", 'parallel.precision="fp32"',
         'train.device="cpu"', "train.tensorboard=false", "train.sample_tokens=0",
         "train.warmup_steps=0", "train.steps=100"]


def overrides(seq_len: int, cp: int, mode: str, global_batch: int) -> list[str]:
    return MODEL + [f"model.seq_len={seq_len}", f"parallel.global_batch={global_batch}",
                    f"parallel.cp={cp}", f'parallel.cp_mode="{mode}"',
                    *(["parallel.cp_ulysses=2"] if mode == "hybrid" else [])]


def _saved_bytes_on_ranks(rt, sets, run_dir):
    """Bytes this rank saves for backward over step 0 (blocks and root), and its peak RSS."""
    from fivefold.config import load_config
    from fivefold.memory.activation_count import SavedActivations
    from fivefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, sets), rt, run_dir)
    inputs, targets = trainer.train_sampler.rank_batch(0)
    labels = {f"layers.{i}": block for i, block in enumerate(trainer.model.layers)}
    with SavedActivations(trainer.model, labels) as acts:
        trainer.micro_batch_loss(inputs, targets).backward()
    return acts.total_bytes, rss_mib()


def _tokens_per_s_on_ranks(rt, sets, run_dir, steps):
    from fivefold.config import load_config
    from fivefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, sets), rt, run_dir)
    trainer.train_step(0)  # warm-up
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.train_step(step)
    return trainer.global_tokens * steps / (time.perf_counter() - start)


def predicted_saved_bytes(sets: list[str], world: int) -> float:
    """The planner's count of the same bytes (fivefold.planner.activations)."""
    from fivefold.config import load_config
    from fivefold.parallel.plan import training_plan
    from fivefold.planner import activations as A

    cfg = load_config(None, sets)
    plan, m = training_plan(cfg, world, "cpu"), cfg.model
    tokens = plan.micro_batch * m.seq_len // plan.cp
    kv = A.ring_kv_heads(m, plan)
    return (sum(A.block_saved_bytes(m, tokens, 4, layer=i, kv_heads=kv) for i in range(m.layers))
            + A.root_saved_bytes(m, tokens, 4))


def memory_table(lengths: list[int], cap: float, run_dir: str) -> list[dict]:
    from fivefold.testing import RankFailure, run_on_ranks

    rows = []
    for cp in (1, 2, 4):
        longest = None
        for seq_len in lengths:
            sets = overrides(seq_len, cp, "ring", 1)
            try:
                ranks = run_on_ranks(_saved_bytes_on_ranks, cp, sets, f"{run_dir}/m{cp}",
                                     timeout_s=1800)
            except RankFailure as err:  # killed for memory: this length does not train
                rows.append({"cp": cp, "seq_len": seq_len, "trained": False,
                             "error": str(err).splitlines()[0]})
                print(f"cp {cp}  seq_len {seq_len:6d}  did not train: {err}", flush=True)
                break
            saved, peak = max(r[0] for r in ranks), max(r[1] for r in ranks)
            fits = saved <= cap
            rows.append({"cp": cp, "seq_len": seq_len, "trained": True,
                         "saved_mib": saved / 2**20,
                         "predicted_mib": predicted_saved_bytes(sets, cp) / 2**20,
                         "peak_rss_mib": peak, "fits": fits})
            print(f"cp {cp}  seq_len {seq_len:6d}  saved {saved / 2**20:8.1f} MiB per rank, "
                  f"peak RSS {peak:7.0f} MiB{'' if fits else '  (over the cap)'}", flush=True)
            if not fits:
                break
            longest = seq_len
        rows.append({"cp": cp, "longest_under_cap": longest})
    return rows


def speed_table(length: int, rounds: int, steps: int, run_dir: str) -> list[dict]:
    from fivefold.testing import run_on_ranks

    sides = {"dp 4": overrides(length, 1, "ring", 4), "cp 4 ring": overrides(length, 4, "ring", 4),
             "cp 4 ulysses": overrides(length, 4, "ulysses", 4),
             "cp 4 hybrid 2x2": overrides(length, 4, "hybrid", 4)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):  # interleaved, so machine noise hits every side alike
        for name, sets in sides.items():
            rate = run_on_ranks(_tokens_per_s_on_ranks, 4, sets, f"{run_dir}/s{r}", steps,
                                timeout_s=1800)[0]
            rates[name].append(rate)
            print(f"round {r}  {name:16s} {rate:9.0f} tokens/s", flush=True)
    base = statistics.median(rates["dp 4"])
    return [{"side": name, "tokens_per_s": statistics.median(v),
             "ratio_to_dp4": statistics.median(v) / base} for name, v in rates.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mib", type=float, default=256.0,
                    help="saved-activation bytes allowed per rank (default 256 MiB)")
    ap.add_argument("--length", type=int, default=4096, help="sequence length of the speed table")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round")
    ap.add_argument("--quick", action="store_true", help="smoke test: short lengths, one round")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--run-dir", default="/tmp/fivefold-bench-cp")
    args = ap.parse_args()
    lengths = [256, 512] if args.quick else [1024 * 2**k for k in range(6)]
    cap = (1 if args.quick else args.cap_mib) * 2**20
    memory = memory_table(lengths, cap, args.run_dir)
    speed = speed_table(256 if args.quick else args.length, 1 if args.quick else args.rounds,
                        1 if args.quick else args.steps, args.run_dir)
    for row in speed:
        print(f"{row['side']:16s} {row['tokens_per_s']:9.0f} tokens/s  "
              f"{row['ratio_to_dp4']:.2f}x dp 4", flush=True)
    if args.json:
        write_json(args.json, {"machine": machine_info(), "cap_mib": cap / 2**20,
                               "memory": memory, "speed": speed})


if __name__ == "__main__":
    main()
