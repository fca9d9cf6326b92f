"""Training throughput and peak memory: fivefold's Trainer next to a plain PyTorch loop.

Both sides train the same fixed small setup: the `tiny` preset, fp32 on the CPU, one process,
a global batch of 8 sequences x 256 tokens, on the built-in corpus (`prepare_data`; the
tokenized corpus is cached after the first run, about 10 s the first time).

* fivefold: `fivefold.train.trainer.Trainer.train_step(step)` in a loop (its sampler, optimizer,
  learning-rate schedule, loss scaling and clipping; no checkpoints, no evaluation, no metrics).
* plain: a hand-written loop that uses none of fivefold's trainer, sampler, optimizer or config
  loading: `torch.optim.AdamW` with the same hyper-parameters (same decay / no-decay split,
  same warm-up + cosine learning rate), `F.cross_entropy`, `clip_grad_norm_`, batches of the
  same shape cut at plain numpy random offsets from the same token array. Its model is the
  same architecture built as `fivefold.models.llama.Transformer`, which is a plain
  `nn.Module` (built from a `ModelConfig` holding the preset's numbers). Both sides therefore
  run identical forward/backward math and the comparison isolates the training-loop
  overhead, not the model implementation.

Each side runs in its own worker process (this script re-invoked with `--side`), so the peak
resident set size (VmHWM, harness.rss_mib) is per side; it includes the interpreter, torch,
the model, optimizer state, activations and the touched pages of the memory-mapped token
array. The parent drives both workers one at a time: warm-up steps (not timed), then
`--rounds` rounds of `--steps / --rounds` timed steps each, interleaved A B A B ..., so
machine noise hits both sides alike. Reported: median tokens/s over the rounds per side,
the ratio fivefold / plain (the JSON also holds every round and the best round of each
side), and peak RSS per side with its ratio.

    python bench/train_vs_plain.py                 # 30 timed steps per side, 5 rounds of 6
    python bench/train_vs_plain.py --quick         # smoke test: 4 steps, 1 round
    python bench/train_vs_plain.py --json out.json # also write the results as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from harness import (TrainerSide, add_timing_args, machine_info, plain_adamw, plain_lr,
                     random_batch, rss_mib, split_rounds, write_json)

SIDES = ("fivefold", "plain")
GLOBAL_BATCH = 8
SEQ_LEN = 256
PRESET = "tiny"


def bench_config():
    """The fixed fivefold config (imported lazily: the plain worker never calls this)."""
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    cfg = load_config(None, [f'model.preset="{PRESET}"', f"model.seq_len={SEQ_LEN}",
                             f"parallel.global_batch={GLOBAL_BATCH}", 'parallel.precision="fp32"',
                             'train.device="cpu"', "train.compile=false"])
    validate_for_training(cfg, 1)
    return cfg


# ------------------------------------------------------------------ the two sides

class FivefoldSide(TrainerSide):
    def __init__(self, spec: dict):
        super().__init__(bench_config(), spec["total_steps"])


class PlainSide:
    def __init__(self, spec: dict):
        import numpy as np
        import torch

        from fivefold.config import ModelConfig  # only to build the model definition
        from fivefold.models.llama import Transformer

        self.torch = torch
        self.F = torch.nn.functional
        self.hp = spec["train"]
        self.batch, self.seq_len = spec["global_batch"], spec["model"]["seq_len"]
        self.total_steps = spec["total_steps"]
        self.tokens = np.load(spec["train_tokens"], mmap_mode="r")
        self.rng = np.random.default_rng(1234)
        torch.manual_seed(0)
        self.model = Transformer(ModelConfig(**spec["model"]))
        with torch.no_grad():  # GPT-2 style normal(0, 0.02), as fivefold initializes
            for param in self.model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.02)
        self.opt = plain_adamw(list(self.model.parameters()), self.hp)
        self.step = 0

    def run(self, n: int) -> float:
        torch, F = self.torch, self.F
        loss = math.nan
        for _ in range(n):
            self.model.train()
            for group in self.opt.param_groups:
                group["lr"] = plain_lr(self.hp, self.step, self.total_steps)
            x, y = random_batch(self.tokens, self.rng, self.batch, self.seq_len)
            # one expression, so the (B, T, V) logits are not kept alive into the next step
            out = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            out.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp["grad_clip"])
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss = out.item()
            self.step += 1
        return loss


def worker(side: str) -> None:
    """Line protocol on stdin/stdout: a spec, then {"steps": n} commands, then {"quit": 1}."""
    proto = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print stays off the protocol channel

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    spec = json.loads(sys.stdin.readline())
    runner = (FivefoldSide if side == "fivefold" else PlainSide)(spec)
    import torch
    reply({"ready": True, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if "quit" in cmd:
            break
        start = time.perf_counter()
        loss = runner.run(cmd["steps"])
        reply({"seconds": time.perf_counter() - start, "loss": loss,
               "peak_rss_mib": rss_mib()})
    reply({"peak_rss_mib": rss_mib()})


class Worker:
    def __init__(self, side: str, spec: dict):
        self.side = side
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--side", side],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask(spec)
        self.threads = self.last["threads"]

    def ask(self, obj: dict) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} worker exited (code {self.proc.wait()}); "
                               "see its error above")
        self.last = json.loads(line)
        return self.last

    def close(self) -> float:
        peak = self.ask({"quit": 1})["peak_rss_mib"]
        self.proc.stdin.close()
        self.proc.wait()
        return peak


# ------------------------------------------------------------------ the driver

def run_bench(steps: int, rounds: int, warmup: int) -> dict:
    import dataclasses

    from fivefold.train.data import prepare_data

    cfg = bench_config()
    data = prepare_data(cfg, log=lambda text: print(text, file=sys.stderr))  # build the cache once
    per_round = split_rounds(steps, rounds)
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "moe"}
    spec = {"model": model, "global_batch": GLOBAL_BATCH, "total_steps": warmup + steps,
            "train": dataclasses.asdict(cfg.train), "train_tokens": str(data.train.filename)}
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    workers = {}
    try:
        for side in SIDES:
            print(f"starting {side} worker; {warmup} warm-up step(s) ...", file=sys.stderr)
            workers[side] = Worker(side, spec)
            if warmup:
                workers[side].ask({"steps": warmup})
        rates = {side: [] for side in SIDES}
        losses = {}
        for r, n in enumerate(per_round):
            for side in SIDES:
                out = workers[side].ask({"steps": n})
                rates[side].append(n * tokens_per_step / out["seconds"])
                losses[side] = out["loss"]
                print(f"round {r + 1}/{rounds} {side:>8}: {n} steps, "
                      f"{rates[side][-1]:,.0f} tokens/s, loss {out['loss']:.3f}", file=sys.stderr)
        peaks = {side: workers[side].close() for side in SIDES}
    finally:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    result = {"config": {"preset": PRESET, "precision": "fp32", "device": "cpu", "processes": 1,
                         "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
                         "tokens_per_step": tokens_per_step, "timed_steps": steps,
                         "rounds": rounds, "steps_per_round": per_round, "warmup_steps": warmup},
              "machine": machine_info(torch_threads=workers["fivefold"].threads)}
    for side in SIDES:
        result[side] = {"tokens_per_s": statistics.median(rates[side]),
                        "tokens_per_s_best": max(rates[side]),
                        "tokens_per_s_rounds": rates[side], "peak_rss_mib": peaks[side],
                        "last_loss": losses[side], "torch_threads": workers[side].threads}
    f, p = result["fivefold"], result["plain"]
    result["ratio"] = {"tokens_per_s": f["tokens_per_s"] / p["tokens_per_s"],
                       "tokens_per_s_best": f["tokens_per_s_best"] / p["tokens_per_s_best"],
                       "peak_rss": f["peak_rss_mib"] / p["peak_rss_mib"]}
    return result


def print_table(res: dict) -> None:
    f, p, ratio, c = res["fivefold"], res["plain"], res["ratio"], res["config"]
    m = res["machine"]
    print(f"{c['preset']} preset, {c['precision']} on {c['device']}, batch {c['global_batch']} x "
          f"{c['seq_len']} tokens, {c['timed_steps']} timed steps per side in {c['rounds']} "
          f"round(s) (+{c['warmup_steps']} warm-up); {m['cpu_count']} CPUs, torch {m['torch']}")
    print(f"{'':<22}{'fivefold':>12}{'plain':>12}{'ratio':>10}")
    print(f"{'tokens/s (median)':<22}{f['tokens_per_s']:>12,.0f}{p['tokens_per_s']:>12,.0f}"
          f"{ratio['tokens_per_s']:>10.3f}")
    print(f"{'peak RSS (MiB)':<22}{f['peak_rss_mib']:>12,.0f}{p['peak_rss_mib']:>12,.0f}"
          f"{ratio['peak_rss']:>10.3f}")
    rounds = lambda side: ", ".join(f"{x:,.0f}" for x in res[side]["tokens_per_s_rounds"])
    print(f"rounds tokens/s: fivefold [{rounds('fivefold')}]; plain [{rounds('plain')}]")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap, steps=30, rounds=5, warmup=3)
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 steps, 1 round, 1 warm-up")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: worker mode
    args = ap.parse_args(argv)
    if args.side:
        return worker(args.side)
    if args.quick:
        args.steps, args.rounds, args.warmup = 4, 1, 1
    res = run_bench(args.steps, args.rounds, args.warmup)
    print_table(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
