"""Mixture-of-experts throughput: expert parallelism ep 1/2/4 on CPU ranks, and the dropless
experts' grouped matrix multiply against the loop over experts.

Expert parallelism: `--nproc` gloo ranks (default 4) train the same MoE (2 blocks, width 128,
8 experts of width 256, top-2, sequences of 128 tokens, a global batch of 16, fp32, the
built-in corpus) with `parallel.ep` = 1, 2 and 4 folded onto the data ranks, so every layout
runs the same ranks, batch and math. After `--warmup` untimed steps, `--steps` timed steps;
a step's time is the slowest rank's. Reported: median tokens/s, and the all-to-all share of
the step: the wall time inside the MoE layers' all-to-alls (dispatch, combine, their
backwards and the count exchange; each call is timed by wrapping
fivefold.comm.collectives.all_to_all in this process) over the step time, on the slowest
rank. On a shared 2-core machine the ranks time-slice the cores, so the numbers measure the
software's overheads, not a cluster's.

Grouped against loop: forward and backward of the experts' SwiGLU
(fivefold.models.expert_matmul) on 4096 token-assignments sorted over 8 experts with uneven
counts (one expert empty), width 256 -> 512, one thread, median of `--repeats`: "grouped"
(torch._grouped_mm), "padded" (one torch.bmm over groups padded to the largest) and "loop".

    python bench/moe.py                 # both parts
    python bench/moe.py --quick         # 2 timed steps, 3 repeats
    python bench/moe.py --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import harness
from fivefold.comm import collectives as C
from fivefold.config import load_config
from fivefold.models import expert_matmul
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

MODEL = ["model.layers=2", "model.hidden=128", "model.heads=4", "model.kv_heads=4",
         "model.ffn_hidden=256", "model.vocab=2048", "model.seq_len=128",
         "model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=256",
         "parallel.global_batch=16", "train.tensorboard=false", "train.sample_tokens=0"]


def timed_ep_run(rt, ep: int, steps: int, warmup: int) -> dict:
    """This rank's per-step times and all-to-all seconds for `ep`."""
    spent = [0.0]
    inner = C.all_to_all

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    C.all_to_all = timed  # the dispatcher calls it through the module
    cfg = load_config(None, MODEL + [f"parallel.ep={ep}"])
    trainer = Trainer(cfg, rt, tempfile.mkdtemp(prefix="moe-bench-"))
    for s in range(warmup):
        trainer.train_step(s)
    times, a2a = [], []
    for s in range(warmup, warmup + steps):
        spent[0] = 0.0
        times.append(trainer.train_step(s).step_time_s)
        a2a.append(spent[0])
    return {"times": times, "a2a": a2a, "tokens": trainer.global_tokens}


def ep_table(nproc: int, steps: int, warmup: int) -> list[dict]:
    rows = []
    for ep in (1, 2, 4):
        if ep > nproc:
            continue
        ranks = run_on_ranks(timed_ep_run, nproc, ep, steps, warmup, timeout_s=1800)
        step_s = [max(r["times"][i] for r in ranks) for i in range(steps)]
        share = [max(r["a2a"][i] for r in ranks) / step_s[i] for i in range(steps)]
        rows.append({"ep": ep, "ranks": nproc,
                     "tokens_per_s": ranks[0]["tokens"] / statistics.median(step_s),
                     "all_to_all_share": statistics.median(share)})
        print(f"ep {ep} on {nproc} ranks: {rows[-1]['tokens_per_s']:8.0f} tokens/s, "
              f"all-to-all {rows[-1]['all_to_all_share']:.1%} of the step", flush=True)
    return rows


def matmul_table(repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    counts = [900, 700, 0, 650, 600, 500, 400, 346]  # 4096 rows, expert 2 empty
    x = torch.randn(sum(counts), 256, generator=gen, requires_grad=True)
    ws = [torch.randn(8, 512, 256, generator=gen, requires_grad=True) * 0.02,
          torch.randn(8, 512, 256, generator=gen, requires_grad=True) * 0.02,
          torch.randn(8, 256, 512, generator=gen, requires_grad=True) * 0.02]
    ws = [w.detach().requires_grad_() for w in ws]
    rows = []
    for how in ("grouped", "padded", "loop"):
        def once():
            if how == "padded":
                grouped_runs = expert_matmul.grouped_mm_runs
                expert_matmul.grouped_mm_runs = lambda *a: False  # force the fallback
                try:
                    y = expert_matmul.expert_swiglu(x, counts, *ws, how="grouped")
                finally:
                    expert_matmul.grouped_mm_runs = grouped_runs
            else:
                y = expert_matmul.expert_swiglu(x, counts, *ws, how=how)
            y.square().sum().backward()
        rows.append({"matmul": how, "median_ms": 1000 * harness.median_seconds(once, repeats)})
        print(f"{how:8s} forward+backward {rows[-1]['median_ms']:7.1f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 3
    result = {"machine": harness.machine_info(), "ep": ep_table(args.nproc, args.steps,
                                                                args.warmup),
              "expert_matmul": matmul_table(args.repeats)}
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
