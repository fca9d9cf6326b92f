"""The `fivefold` command line: train, eval, generate, report, convert, simulate, plan, calibrate.

    fivefold train [CONFIG.toml] [--set key=value]... [--nproc N] [--steps N] [--run-dir DIR]
                   [--init-from MODEL_FOLDER]      (`--set parallel=auto`: the planner's layout)
                   [--max-restarts N]              (restart from the last checkpoint if a rank dies)
    fivefold convert SRC DST [--to hf|fivefold]     (Hugging Face <-> fivefold weights)
    fivefold eval RUN_DIR [--data PATH] [--json]    (loss and perplexity of a checkpoint)
    fivefold generate SRC --prompt TEXT             (greedy or sampled text from a model)
    fivefold simulate SPEC [--json] [--trace FILE]  (predicted memory and step time)
                      [--op-trace FILE]            (and the op trace scheduled, beside it)
    fivefold plan SPEC [--top K] [--json]           (search layouts; `plan validate`)
    fivefold calibrate [--out FILE]                 (measure this machine: a profile)
    fivefold report RUN_DIR [--out FILE]            (an HTML page about a run)

A configuration error exits with status 2 and a one-paragraph message on stderr naming the key
and the fix, before any rank starts; no Python traceback is shown for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from fivefold import eval_command, generate_command, plan_commands, report_command
from fivefold.config import Config, ConfigError, load_config
from fivefold.parallel.plan import ParallelPlan, training_plan

DEFAULT_RUN_DIR = "runs/default"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: tiny preset, built-in corpus)")
    train.add_argument("config", nargs="?", help="TOML or JSON config file (optional)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override one key, e.g. --set train.lr=1e-3")
    train.add_argument("--nproc", type=int, default=1, help="local ranks to launch (default 1)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="when a rank dies, restart every rank from the latest complete "
                            "checkpoint, up to N times (PyTorch's elastic agent; default 0)")
    train.add_argument("--steps", type=int, help="total optimizer steps (sets train.steps)")
    train.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                       help=f"metrics and checkpoints; rerun to resume (default {DEFAULT_RUN_DIR})")
    train.add_argument("--init-from", metavar="FOLDER",
                       help="start from these weights: a Hugging Face model folder, a fivefold "
                            "weights folder or a training checkpoint; the model shape is theirs")
    train.add_argument("--plan", help=argparse.SUPPRESS)  # parallel=auto: the launcher's plan
    convert = sub.add_parser("convert", help="convert weights: Hugging Face folder <-> fivefold "
                                             "weights folder (or a training checkpoint -> HF)")
    convert.add_argument("src", help="Hugging Face folder, fivefold weights folder, or a run "
                                     "directory / checkpoint step folder")
    convert.add_argument("dst", help="new folder to write")
    convert.add_argument("--to", choices=("hf", "fivefold"),
                         help="output format (default: fivefold for a Hugging Face source, "
                              "else hf)")
    convert.add_argument("--shard-mib", type=int, default=5120,
                         help="largest Hugging Face safetensors shard in MiB (default 5120)")
    plan_commands.add_parsers(sub)
    eval_command.add_parser(sub)
    generate_command.add_parser(sub)
    report_command.add_parser(sub)
    return parser


def train_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.init_from:
        from fivefold.config import apply_override, read_file
        from fivefold.train.model_source import check_init_tokenizer, init_from_overrides

        raw = read_file(args.config) if args.config else {}
        for assignment in overrides:
            apply_override(raw, assignment)
        overrides += init_from_overrides(args.init_from, raw)
        return check_init_tokenizer(load_config(args.config, overrides), args.init_from)
    return load_config(args.config, overrides)


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from fivefold.train.launch import launch_local, launched_by_torchrun

    if args.nproc < 1:
        raise ConfigError("--nproc", f"must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be 0 or more, got {args.max_restarts}")
    under_launcher = launched_by_torchrun()
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else args.nproc
    launching = (world_size > 1 or args.max_restarts > 0) and not under_launcher
    cfg = train_config(args)
    device = _device(cfg)
    if cfg.parallel.auto:
        cfg, plan = _auto_plan(cfg, world_size, device, args.plan)
        if launching:  # the ranks get the plan, not a search
            argv = [*argv, "--plan", str(_write_plan(plan, args.run_dir))]
    else:
        plan = training_plan(cfg, world_size, device.type, _fp8_units(device))
    if cfg.train.preflight:  # before the tokenizer, the data and the ranks
        _preflight(cfg, plan, world_size, args.nproc, device, under_launcher)
    if launching:
        from fivefold.train.checkpoint import check_resume
        from fivefold.train.data import prepare_data

        check_resume(Path(args.run_dir), cfg, plan)  # a refused resume stops before ranks
        prepare_data(cfg)  # once, here, so that the ranks find it cached
        return launch_local(args.nproc, _launcher_only_removed(argv), args.max_restarts)
    return _train_this_rank(cfg, plan, args.run_dir, args.init_from)


def _preflight(cfg: Config, plan: ParallelPlan, world_size: int, nproc: int, device,
               under_launcher: bool) -> None:
    """fivefold.preflight's check: in the launching process for all its local ranks; under
    a launcher (torchrun) each rank checks its own GPU only, since its siblings already
    hold host memory."""
    from fivefold import preflight

    machine = preflight.this_machine(device)
    if not under_launcher:
        preflight.check(cfg, plan, world_size, nproc, machine, _fp8_units(device))
    elif device.type == "cuda":
        preflight.check(cfg, plan, world_size, 1, dataclasses.replace(machine, host_bytes=None),
                        _fp8_units(device), int(os.environ.get("RANK", "0")))


def _fp8_units(device) -> bool:
    """Whether `device` runs fp8 GEMMs (asked of torch, here, not by the torch-free plan)."""
    from fivefold.parallel.fp8.linear import has_fp8_units

    return has_fp8_units(device.type)


def _device(cfg: Config):
    """The device `train.device` picks on this machine (a torch.device)."""
    from fivefold.train.dist import pick_device

    try:
        return pick_device(cfg.train.device, 0)
    except RuntimeError as err:
        raise ConfigError("train.device", str(err)) from None


def _auto_plan(cfg: Config, world_size: int, device, plan_file: str | None
               ) -> tuple[Config, ParallelPlan]:
    """`parallel = "auto"`: the plan the launcher chose (`--plan`, on a launched rank) or the
    planner's choice on this device's profile (detected here, not in the planner: the
    runtime knows its device), announced once; with the config that spells it out, whose
    own training plan must be that plan (what is trained is what was scored)."""
    from fivefold.planner.auto import layout_config, resolve_auto
    from fivefold.train.dist import detect_profile

    if plan_file is not None:
        plan = ParallelPlan.from_dict(json.loads(Path(plan_file).read_text()))
        cfg = layout_config(cfg, plan)
    else:
        auto = resolve_auto(cfg, world_size, device.type,
                            detect_profile(device, cfg.cluster.gpu))
        if os.environ.get("RANK", "0") == "0":
            print(auto.summary(), flush=True)
        cfg, plan = auto.cfg, auto.plan
    trained = training_plan(cfg, world_size, device.type, _fp8_units(device))
    if trained != plan:
        raise RuntimeError(f"parallel.auto: the scored plan {plan} is not the plan of its "
                           f"spelled-out config {trained}; please report this")
    return cfg, plan


def _write_plan(plan: ParallelPlan, run_dir: str) -> Path:
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.to_dict(), indent=1))
    return path


def _train_this_rank(cfg: Config, plan: ParallelPlan, run_dir: str,
                     init_from: str | None = None) -> int:
    from fivefold.train.data import prepare_data
    from fivefold.train.dist import init_runtime, shutdown
    from fivefold.train.interrupt import StopSignals, exit_status
    from fivefold.train.trainer import Trainer

    from fivefold.planner.rank_memory import predicted_rank_memory

    # before the handlers: a Ctrl-C while tokenizing stops at once (ranks find it cached)
    data = prepare_data(cfg, log=print if os.environ.get("RANK", "0") == "0" else
                        (lambda text: None))
    stop = StopSignals()  # SIGINT / SIGTERM: a checkpoint at the next step boundary
    with stop.installed():
        rt = init_runtime(cfg.train.device, cfg.train.timeout_s)
        try:
            summary = Trainer(cfg, rt, run_dir, data, init_from=init_from, plan=plan,
                              predicted_memory=predicted_rank_memory(cfg, plan, rt.rank,
                                                                     rt.device.type),
                              stop=stop).run()
            if summary.get("interrupted"):
                stop.quiet()
        finally:
            shutdown()
    return exit_status(summary["interrupted"]) if summary.get("interrupted") else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from fivefold.train.model_source import convert

    pre, fmt = convert(args.src, args.dst, args.to, args.shard_mib * 2**20)
    m, params = pre.cfg, sum(t.numel() for t in pre.state.values())
    print(f"wrote {args.dst} ({fmt}): {params / 1e6:.2f}M parameters, {m.layers} layers,"
          f" hidden {m.hidden}, vocab {m.vocab}, seq_len {m.seq_len}"
          f"{', MoE' if m.moe else ''}{', q/k/v biases' if m.qkv_bias else ''}")
    return 0


LAUNCHER_FLAGS = ("--nproc", "--max-restarts")  # the launcher's, not the ranks'


def _launcher_only_removed(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in LAUNCHER_FLAGS)):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "convert":
            return cmd_convert(args)
        if args.command == "eval":
            return eval_command.run(args)
        if args.command == "generate":
            return generate_command.run(args)
        if args.command in plan_commands.COMMANDS:
            return plan_commands.run(args, main)
        if args.command == "report":
            return report_command.run(args)
    except ConfigError as err:
        print(f"fivefold: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a run's handlers (fivefold.train.interrupt) are set
        if os.environ.get("RANK", "0") == "0":
            print("fivefold: interrupted", file=sys.stderr)
        return 130
    return 1
