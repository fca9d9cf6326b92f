"""What every bench script shares: the machine description, peak memory, timing rounds and
the command-line options for them, and the JSON output.

The scripts run as `python bench/NAME.py`, so this directory is first on `sys.path` and they
import this module as `harness`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path


def machine_info(**extra) -> dict:
    """Where and when a result was measured; `extra` adds script-specific entries."""
    import torch

    return {"processor": platform.processor() or platform.machine(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **extra}


def rss_mib(field: str = "VmHWM") -> float:
    """This process's resident set from /proc (Linux): "VmRSS" now, "VmHWM" its peak.

    Not `ru_maxrss`: Linux carries that across fork + exec, so a rank started by a driver that
    has torch loaded would begin at the driver's RSS. Elsewhere `ru_maxrss` is the fallback.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def median_seconds(fn, repeats: int = 5) -> float:
    """Median wall time of `repeats` calls of `fn`, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def split_rounds(steps: int, rounds: int) -> list[int]:
    """`steps` timed steps cut into `rounds` near-equal rounds (the first ones one longer)."""
    if steps < rounds or rounds < 1:
        raise SystemExit(f"--steps ({steps}) must be at least --rounds ({rounds}) >= 1")
    return [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]


def rotated(names: list[str], r: int) -> list[str]:
    """`names` in round `r`'s order: rotated by r, so that no side always follows another
    and machine noise hits every side alike."""
    k = r % len(names)
    return names[k:] + names[:k]


def memory_summary(peaks: list[float], bases: list[float]) -> dict:
    """A side's peak resident set (MiB) per rank after its steps and after set-up: the
    largest rank's peak and growth, and every rank's."""
    return {"peak_rss_mib": max(peaks), "peak_rss_mib_per_rank": peaks,
            "base_rss_mib_per_rank": bases,
            "rss_growth_mib": max(p - b for p, b in zip(peaks, bases))}


def speed_memory_ratios(side: dict, ref: dict) -> dict:
    """`side`'s tokens/s, peak and growth over the reference side's."""
    return {"tokens_per_s": side["tokens_per_s"] / ref["tokens_per_s"],
            "peak_rss": side["peak_rss_mib"] / ref["peak_rss_mib"],
            "rss_growth": side["rss_growth_mib"] / ref["rss_growth_mib"]}


SPEED_MEMORY_HEADER = (f"{'tokens/s':>10}{'ratio':>8}{'peak RSS/rank':>15}{'ratio':>8}"
                       f"{'growth':>9}{'ratio':>8}")


def speed_memory_cells(side: dict, ratios: dict | None) -> str:
    """A table row's tokens/s, peak and growth, each with its ratio (blank for the
    reference), under SPEED_MEMORY_HEADER."""
    def cell(key: str) -> str:
        return f"{ratios[key]:>8.3f}" if ratios else f"{'':>8}"

    return (f"{side['tokens_per_s']:>10,.0f}{cell('tokens_per_s')}"
            f"{side['peak_rss_mib']:>11,.0f} MiB{cell('peak_rss')}"
            f"{side['rss_growth_mib']:>5,.0f} MiB{cell('rss_growth')}")


def add_timing_args(ap: argparse.ArgumentParser, steps: int, rounds: int, warmup: int,
                    what: str = "side") -> None:
    """--steps, --rounds, --warmup and --json with this script's defaults."""
    ap.add_argument("--steps", type=int, default=steps,
                    help=f"timed steps per {what} (default {steps})")
    ap.add_argument("--rounds", type=int, default=rounds,
                    help=f"interleaved rounds the timed steps are split into (default {rounds})")
    ap.add_argument("--warmup", type=int, default=warmup,
                    help=f"untimed warm-up steps (default {warmup})")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


class TrainerSide:
    """fivefold's side of a comparison: `Trainer.train_step` on rank `rank` of `world` (CPU),
    with the learning-rate schedule as long as the whole run (`total_steps`)."""

    def __init__(self, cfg, total_steps: int, rank: int = 0, world: int = 1):
        import tempfile

        import torch

        from fivefold.train.data import prepare_data
        from fivefold.train.dist import Runtime
        from fivefold.train.trainer import Trainer

        cfg.train.steps = total_steps
        data = prepare_data(cfg, log=lambda text: print(text, file=sys.stderr))
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-fivefold-")  # never written
        self.trainer = Trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")),
                               self._tmp.name, data)
        self.step = 0

    def run(self, n: int) -> float:
        """`n` more optimizer steps; the last one's loss."""
        loss = float("nan")
        for _ in range(n):
            loss = self.trainer.train_step(self.step).loss
            self.step += 1
        return loss


# ------------------------------------------------------------------ the plain PyTorch peers
# Written without fivefold's trainer, sampler or optimizer code, so that a peer shares
# nothing with the side it is measured against but the model and the hyper-parameters.

def plain_adamw(params: list, hp: dict):
    """torch.optim.AdamW with fivefold's split: matrices decay, vectors do not."""
    import torch

    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])


def plain_lr(hp: dict, step: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step; an absent
    `warmup_steps` is the config's documented automatic one, min(20, total_steps // 10)."""
    warmup = hp["warmup_steps"]
    if warmup is None:
        warmup = min(20, total_steps // 10)
    if warmup and step < warmup:
        return hp["lr"] * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    floor = hp["lr"] * hp["min_lr_ratio"]
    return floor + (hp["lr"] - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def random_batch(tokens, rng, rows: int, seq_len: int):
    """(inputs, targets) of `rows` sequences cut at numpy random offsets from `tokens`."""
    import numpy as np
    import torch

    offsets = rng.integers(0, len(tokens) - seq_len - 1, size=rows)
    batch = torch.from_numpy(np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64)
                                       for o in offsets]))
    return batch[:, :-1], batch[:, 1:]
