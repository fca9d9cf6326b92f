"""Activation recomputation: what `full` and `selective` save and cost, next to the plain run.

The three sides are fivefold's Trainer on the same fixed setup (the `tiny` preset, fp32 on the
CPU, one process, 8 sequences x 256 tokens per step, the built-in corpus), with
`parallel.recompute = "none"`, `"full"` and `"selective"` (fivefold.memory.recompute).
Reported:

* saved activations: the bytes autograd keeps for backward after one forward of the step's
  batch, per block and for the root (fivefold.memory.activation_count), with the planner's
  prediction (fivefold.planner.activations) next to them;
* time: median seconds per step over `--rounds` interleaved rounds (A B C A B C ..., so
  machine noise hits all alike) and the ratios full / none and selective / none, with the simulator's predicted ratio on
  the CPU profile (fivefold.planner.simulate).

    python bench/recompute.py               # 20 timed steps per side, 5 rounds of 4
    python bench/recompute.py --quick       # smoke test: 2 steps, 1 round
    python bench/recompute.py --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import TrainerSide, add_timing_args, machine_info, split_rounds, write_json

MODES = ("none", "full", "selective")


def bench_config(mode: str):
    from fivefold.config import load_config
    from fivefold.validate import validate_for_training

    cfg = load_config(None, ['model.preset="tiny"', "model.seq_len=256",
                             "parallel.global_batch=8", 'parallel.precision="fp32"',
                             'train.device="cpu"', "train.compile=false",
                             f'parallel.recompute="{mode}"'])
    validate_for_training(cfg, 1)
    return cfg


def saved_bytes(side: TrainerSide) -> dict[str, int]:
    """Bytes kept for backward by one forward of step 0's batch: per block, and the root."""
    import torch.nn.functional as F

    from fivefold.memory.activation_count import SavedActivations

    model = side.trainer.model
    inputs, targets = side.trainer.train_sampler.rank_batch(0)
    labels = {f"layers.{i}": block for i, block in enumerate(model.layers)}
    with SavedActivations(model, labels) as acts:
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    return dict(acts.bytes_by_label)


def predicted(cfg) -> dict:
    """The planner's saved bytes per block and step time on the CPU profile."""
    import copy

    from fivefold.planner.activations import block_saved_bytes
    from fivefold.planner.simulate import simulate

    m, p = cfg.model, cfg.parallel
    spec = copy.deepcopy(cfg)
    spec.cluster.gpu, spec.cluster.gpus = "cpu", 1
    return {"block_bytes": block_saved_bytes(m, p.global_batch * m.seq_len, 4,
                                             recompute=p.recompute),
            "step_s": simulate(spec).step_time_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(ap, steps=20, rounds=5, warmup=2)
    ap.add_argument("--quick", action="store_true", help="2 timed steps, 1 round, no warm-up")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.warmup = 2, 1, 0
    rounds = split_rounds(args.steps, args.rounds)
    total = args.warmup + args.steps
    cfgs = {mode: bench_config(mode) for mode in MODES}
    sides = {mode: TrainerSide(cfgs[mode], total) for mode in MODES}
    result = {"machine": machine_info(), "config": {"timed_steps": args.steps,
                                                    "rounds": args.rounds}}
    for mode in MODES:
        result[mode] = {"saved_bytes": saved_bytes(sides[mode]),
                        "predicted": predicted(cfgs[mode]), "round_s_per_step": []}
        sides[mode].run(args.warmup)
    for n in rounds:
        for mode in MODES:
            start = time.perf_counter()
            sides[mode].run(n)
            result[mode]["round_s_per_step"].append((time.perf_counter() - start) / n)
    for mode in MODES:
        result[mode]["s_per_step"] = statistics.median(result[mode]["round_s_per_step"])
        blocks = [v for k, v in result[mode]["saved_bytes"].items() if k != "root"]
        print(f"recompute={mode:9s}  saved per block {blocks[0] / 2**20:7.2f} MiB (planner "
              f"{result[mode]['predicted']['block_bytes'] / 2**20:7.2f}), root "
              f"{result[mode]['saved_bytes']['root'] / 2**20:6.2f} MiB; "
              f"{result[mode]['s_per_step']:.3f} s/step")
    none = result["none"]
    result["ratio"] = {}
    for mode in MODES[1:]:
        ratio = result["ratio"][mode] = {
            "s_per_step": result[mode]["s_per_step"] / none["s_per_step"],
            "predicted_step_s": result[mode]["predicted"]["step_s"] / none["predicted"]["step_s"]}
        print(f"{mode} / none: step time {ratio['s_per_step']:.2f}x measured, "
              f"{ratio['predicted_step_s']:.2f}x predicted (CPU profile)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
