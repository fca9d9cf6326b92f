"""What fp8 does to convergence, measured on the CPU with fp8 emulation (docs/fp8.md).

Every run is fivefold's Trainer, one process, fp32 master weights and AdamW, the built-in
corpus; only the precision of the blocks' linear GEMMs changes:

  fp32             the reference
  bf16-emulated    each GEMM input (x, W, dy) rounded to bf16, GEMMs in fp32 (the same
                   fp8 linear with the unscaled bf16 format: fivefold.parallel.fp8)
  fp8 tensorwise   parallel.precision = "fp8", emulated (the default on CPU)
  fp8 rowwise      the same with parallel.fp8_recipe = "rowwise"
  -input, -weight, -grad_output
                   fp8 tensorwise with that tensor class left in fp32
                   (parallel.fp8_tensors): which class causes the gap
  fp32 seed 1      another seed's fp32 run: the run-to-run scale the gaps compare with

on two setups: "small" (2 blocks of width 64, 64-token sequences, 2048-token vocabulary)
over the default 200-step schedule with every variant, and "default" (the `tiny` preset
that `fivefold train` trains by default: 4 blocks of width 256, 256 tokens, 8192 vocabulary)
over `--default-steps` steps (default 200, the default run) with the first four variants;
the ablation runs on the small setup only, where a run takes seconds.

Run it with one thread per process (OMP_NUM_THREADS=1): on two cores shared with other
work, two OpenMP threads per process spun so much that runs took 50x longer.

    OMP_NUM_THREADS=1 python bench/fp8_study.py --json docs/fp8_study.json \
        --plot docs/img/fp8_study.png
    OMP_NUM_THREADS=1 python bench/fp8_study.py --quick   # smoke test: 10 steps, small only
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from harness import machine_info, write_json

SMALL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
         "model.ffn_hidden=176", "model.vocab=2048", "model.seq_len=64"]
FP8 = ["parallel.precision=fp8"]
VARIANTS = {
    "fp32": [],
    "bf16-emulated": [],  # fp32 config; the linears are rounded to bf16 after the build
    "fp8 tensorwise": FP8,
    "fp8 rowwise": FP8 + ["parallel.fp8_recipe=rowwise"],
    "fp8 -input": FP8 + ['parallel.fp8_tensors=["weight", "grad_output"]'],
    "fp8 -weight": FP8 + ['parallel.fp8_tensors=["input", "grad_output"]'],
    "fp8 -grad_output": FP8 + ['parallel.fp8_tensors=["input", "weight"]'],
    "fp32 seed 1": ["train.seed=1"],
}
MAIN = ("fp32", "bf16-emulated", "fp8 tensorwise", "fp8 rowwise")


def run_variant(name: str, sets: list[str], run_dir: Path) -> dict:
    """Train one variant to the end; its per-step losses, validation losses and time."""
    import torch

    from fivefold.config import load_config
    from fivefold.parallel.fp8.linear import apply_fp8
    from fivefold.parallel.fp8.recipe import Fp8Recipe
    from fivefold.parallel.plan import training_plan
    from fivefold.train.dist import Runtime
    from fivefold.train.trainer import Trainer

    cfg = load_config(None, sets + VARIANTS[name])
    trainer = Trainer(cfg, Runtime(0, 1, 0, torch.device("cpu")), run_dir,
                      plan=training_plan(cfg, 1, "cpu"))
    if name == "bf16-emulated":
        apply_fp8(trainer.model, Fp8Recipe(forward_format="bf16", grad_format="bf16"),
                  trainer.tp_axis)
    start = time.perf_counter()
    summary = trainer.run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in records],
            "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
            "final_val_loss": summary["final_val_loss"],
            "seconds": time.perf_counter() - start}


def study(setup: str, sets: list[str], names: tuple[str, ...]) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fp8-study-") as tmp:
        for name in names:
            runs[name] = run_variant(name, sets, Path(tmp) / name.replace(" ", "_"))
            print(f"{setup:8s} {name:18s} final val_loss {runs[name]['final_val_loss']:.4f} "
                  f"({runs[name]['seconds']:.0f} s)", flush=True)
    ref = runs["fp32"]
    for run in runs.values():
        run["val_gap"] = run["final_val_loss"] - ref["final_val_loss"]
        tail = max(1, len(ref["loss"]) // 10)  # the last tenth of the steps
        run["train_gap_tail"] = (sum(run["loss"][-tail:]) - sum(ref["loss"][-tail:])) / tail
    return {"overrides": sets, "runs": runs}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(result["setups"])
    fig, axes = plt.subplots(2, len(setups), figsize=(6.5 * len(setups), 7.5), squeeze=False)
    for col, setup in enumerate(setups):
        runs = result["setups"][setup]["runs"]
        ref = runs["fp32"]["loss"]
        for name, run in runs.items():
            steps = range(1, len(run["loss"]) + 1)
            axes[0][col].plot(steps, run["loss"], label=name, lw=1)
            if name == "fp32 seed 1":  # another trajectory: its gap is in the table
                continue
            window = 10
            diff = [a - b for a, b in zip(run["loss"], ref)]
            smooth = [sum(diff[max(0, i - window + 1):i + 1]) / len(diff[max(0, i - window + 1):
                                                                          i + 1])
                      for i in range(len(diff))]
            axes[1][col].plot(steps, smooth, label=name, lw=1)
        axes[0][col].set_title(f"{setup}: training loss")
        axes[1][col].set_title(f"{setup}: loss minus fp32 (10-step mean)")
        axes[1][col].axhline(0.0, color="black", lw=0.5)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--default-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="10 steps, small setup only")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    common = ["train.device=cpu", "train.tensorboard=false", "train.sample_tokens=0",
              "train.checkpoint_every=1000", "train.log_every=1000"]
    small = common + SMALL
    if args.quick:
        small += ["train.steps=10", "train.warmup_steps=2", "train.eval_every=5"]
    setups = {"small": study("small", small, tuple(VARIANTS))}
    write_json(args.json, {"machine": machine_info(), "setups": setups})  # kept if cut short
    if not args.quick:
        steps = args.default_steps
        setups["default"] = study("default", common + [
            f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
            f"train.eval_every={max(1, steps // 2)}"], MAIN)
    result = {"machine": machine_info(), "setups": setups}
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    for setup, data in setups.items():
        for name, run in data["runs"].items():
            print(f"{setup:8s} {name:18s} val gap {run['val_gap']:+.4f}  train gap (last "
                  f"tenth) {run['train_gap_tail']:+.4f}")


if __name__ == "__main__":
    main()
