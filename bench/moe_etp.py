"""Tensor parallelism on an MoE model: experts replicated over tp against expert tensor
parallelism (`parallel.etp`), side by side in one run, on CPU ranks.

Two gloo ranks train the same MoE (2 blocks, width 128, 8 experts of width 512, top-2,
sequences of 128 tokens, a global batch of 8 in micro-batches of 4, fp32, the built-in
corpus) with tp 2, under two runtimes:

  replicated  the runtime as it was before the experts' grid (fivefold.expert_grid): every
              MoE layer whole on every tp rank, each rank computing every token's experts.
              It runs from a copy of that source tree, given as `--replicated-src` (its
              `src` folder; e.g. `git archive <commit> | tar -x -C DIR`).
  etp 2       this tree: each expert's MLP split over the 2 tp ranks (etp 2), each rank
              routing half the tokens.
  etp 1       this tree: tp folded into the experts' data parallelism (whole experts, each
              rank routing half the tokens).

Each layout runs in its own processes (a fresh interpreter per layout, with the runtime's
source first on its path), `--warmup` untimed steps then `--steps` timed ones; a step's time
is the slower rank's. Reported per layout: median tokens/s; per rank the model-state bytes
the runtime records in its ledger (parameters, gradients, AdamW moments) and the process's
peak resident set (VmHWM, which includes the interpreter and torch). On a shared 2-core
machine the ranks time-slice the cores: this measures per-rank work and memory, not a
cluster's speed.

    python bench/moe_etp.py --replicated-src /tmp/main-src/src [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
MODEL = ["model.layers=2", "model.hidden=128", "model.heads=4", "model.kv_heads=4",
         "model.ffn_hidden=256", "model.vocab=2048", "model.seq_len=128",
         "model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=512",
         "parallel.global_batch=8", "parallel.micro_batch=4", "train.tensorboard=false",
         "train.sample_tokens=0", "parallel.tp=2"]


def rank_run(rt, sets: list[str], steps: int, warmup: int) -> dict:
    """This rank's step times, ledger model-state bytes and peak resident set."""
    from fivefold.config import load_config
    from fivefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, MODEL + sets), rt, tempfile.mkdtemp(prefix="etp-"))
    for s in range(warmup):
        trainer.train_step(s)
    times = [trainer.train_step(s).step_time_s for s in range(warmup, warmup + steps)]
    return {"times": times, "tokens": trainer.global_tokens,
            "model_state_bytes": trainer.ledger.model_state_bytes["total"],
            "peak_rss_mib": harness.rss_mib("VmHWM")}


def worker(sets: list[str], steps: int, warmup: int) -> None:
    """One layout on 2 ranks, in this interpreter's fivefold; prints its JSON row."""
    from fivefold.testing import run_on_ranks

    ranks = run_on_ranks(rank_run, 2, sets, steps, warmup, timeout_s=1800)
    step_s = [max(r["times"][i] for r in ranks) for i in range(steps)]
    print(json.dumps({"tokens_per_s": ranks[0]["tokens"] / statistics.median(step_s),
                      "model_state_mib": [r["model_state_bytes"] / 2**20 for r in ranks],
                      "peak_rss_mib": [r["peak_rss_mib"] for r in ranks]}))


def layout(src: Path, sets: list[str], steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}
    out = subprocess.run([sys.executable, str(HERE / "moe_etp.py"), "--worker",
                          json.dumps(sets), "--steps", str(steps), "--warmup", str(warmup)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicated-src", required=False)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--worker")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.steps, args.warmup)
        return
    if not args.replicated_src:
        ap.error("--replicated-src is required (the replicated runtime's src folder)")
    this = HERE.parent / "src"
    rows = []
    for label, src, sets in (("tp 2, experts replicated", Path(args.replicated_src), []),
                             ("tp 2, etp 2", this, ["parallel.etp=2"]),
                             ("tp 2, etp 1 (tp folded into expert data)", this, [])):
        rows.append({"layout": label, **layout(src, sets, args.steps, args.warmup)})
        r = rows[-1]
        print(f"{label:42s} {r['tokens_per_s']:8.0f} tokens/s  model state "
              f"{'/'.join(f'{m:.1f}' for m in r['model_state_mib'])} MiB  peak RSS "
              f"{'/'.join(f'{m:.0f}' for m in r['peak_rss_mib'])} MiB", flush=True)
    harness.write_json(args.json, {"machine": harness.machine_info(), "layouts": rows})


if __name__ == "__main__":
    main()
