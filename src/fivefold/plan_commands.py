"""The planner's subcommands of `fivefold`: simulate, plan, plan validate, calibrate.

    fivefold simulate SPEC [--set k=v]... [--json] [--trace FILE] [--op-trace FILE]
    fivefold plan SPEC [--set k=v]... [--top K] [--objective time|cost|goodput] [--json]
    fivefold plan SPEC --train [--nproc N] [--steps N] [--run-dir DIR]   (plan, then train)
    fivefold plan validate [RUNS.json] [--json] [--cross]   (also: fivefold validate-plan)
    fivefold calibrate [--out FILE] [--ranks N] [--device cpu|cuda] [--threads N]
                       [--offload-path DIR]

SPEC is a run spec (docs/run_spec.md; TOML or JSON). `--json` prints exactly
the fields run_spec.md lists (one object for simulate, a list best first for plan); the
number of layouts plan scored goes to stderr then. A bad spec, an unknown key, an impossible
layout or a profile file that does not parse raises ConfigError (exit status 2).

This is command-line glue, so it sits beside cli.py rather than in planner/: no planner module
imports the command line, and calibrate (which measures with torch) is reached from here, not
from the torch-free predicting modules. `plan SPEC --train` builds a `fivefold train` argv and
hands it to the `main` that cli.py passes in, so this module does not import cli.py back.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from fivefold.config import ConfigError

COMMANDS = ("simulate", "plan", "validate-plan", "calibrate")


def add_parsers(sub) -> None:
    sim = sub.add_parser("simulate", help="predict memory and step time of one layout")
    sim.add_argument("spec", help="run spec (TOML or JSON, keys of run_spec.md)")
    _common(sim)
    sim.add_argument("--trace", metavar="FILE",
                     help="write a Chrome/Perfetto trace of one simulated step")
    sim.add_argument("--op-trace", metavar="FILE",
                     help="schedule the op trace (each op the fivefold runtime runs, priced), "
                          "write it as a Chrome/Perfetto trace and print its step time beside "
                          "the block model's (fivefold.planner.trace_step)")
    plan = sub.add_parser("plan", help="search the parallel layouts for the fastest that fits "
                                       "(`plan validate` checks the simulator against "
                                       "published runs)")
    plan.add_argument("spec", help="run spec, or `validate` to check against published runs")
    plan.add_argument("runs", nargs="?", help="with `validate`: a runs file (default: the "
                                              "calibration runs shipped with fivefold)")
    _common(plan)
    plan.add_argument("--cross", action="store_true",
                      help="with `validate`: fit the constants of fivefold.planner.fitted to "
                           "the runs and report in-sample and leave-one-source-out errors "
                           "(minutes)")
    plan.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    plan.add_argument("--objective", default="time",
                      help="rank by step time (default), cost (USD per million productive "
                           "tokens) or goodput (productive tokens/s): docs/planner.md")
    plan.add_argument("--train", action="store_true",
                      help="train the best layout the runtime executes on --nproc local ranks "
                           "(= fivefold train SPEC --set parallel=auto)")
    plan.add_argument("--nproc", type=int, default=1, help="with --train: local ranks")
    plan.add_argument("--steps", type=int, help="with --train: total optimizer steps")
    plan.add_argument("--run-dir", default="runs/default", help="with --train: run directory")
    val = sub.add_parser("validate-plan", help="predicted vs published step time, with MAPE")
    val.add_argument("runs", nargs="?", help="runs file (default: the shipped calibration runs)")
    val.add_argument("--json", action="store_true", help="print JSON")
    val.add_argument("--cross", action="store_true",
                     help="fit the constants and report leave-one-source-out errors")
    cal = sub.add_parser("calibrate", help="measure this machine; write a profile file")
    cal.add_argument("--out", default="profile.json", help="profile file to write")
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cal.add_argument("--ranks", type=int, default=2,
                     help="local gloo ranks for the collective measurement (default 2)")
    cal.add_argument("--threads", type=int, help="torch threads per rank while measuring")
    cal.add_argument("--offload-path", help="directory whose drive the disk tier measures "
                                            "(parallel.offload_path; default: the temporary "
                                            "directory)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override one key, e.g. --set cluster.gpus=64")
    p.add_argument("--json", action="store_true", help="print JSON (fields of run_spec.md)")


def run(args: argparse.Namespace, train_main: Callable[[list[str]], int]) -> int:
    """Run the planner command `args` names; `train_main` is cli.main, for `plan --train`."""
    if args.command == "calibrate":
        return cmd_calibrate(args)
    if args.command == "validate-plan" or (args.command == "plan" and args.spec == "validate"):
        return cmd_validate(args.runs, args.json, args.cross)
    if args.command == "plan" and args.runs is not None:
        raise ConfigError("SPEC", f"unexpected argument {args.runs!r}; `fivefold plan SPEC` "
                                  "takes one spec")
    from fivefold.config import load_config

    if args.command == "plan" and args.train:
        if load_config(args.spec, args.overrides).cluster.groups is not None:
            raise ConfigError("--train", "--train plans for the launched ranks, one kind of "
                                         "device; plan the groups without --train and train "
                                         "the printed --set keys on them")
        return cmd_plan_train(args, train_main)
    from fivefold.planner.simulate import profile_of
    from fivefold.planner.spec import prepare

    cfg = load_config(args.spec, args.overrides)
    if args.command == "plan" and cfg.cluster.groups is not None:  # several device groups
        return cmd_plan_groups(cfg, args)
    if args.command == "plan":  # checked per candidate layout (planner.auto.plan_spec)
        return cmd_plan(cfg, profile_of(cfg), args)
    if cfg.cluster.groups is not None:
        return cmd_simulate_groups(cfg, args)
    cfg = prepare(cfg)
    if cfg.parallel.auto:
        raise ConfigError("parallel.auto", "simulate scores the layout the spec writes out; "
                                           "search with `fivefold plan SPEC` or drop auto")
    return cmd_simulate(cfg, profile_of(cfg), args)


def cmd_simulate(cfg, prof, args) -> int:
    from fivefold.planner.report import context_json, estimate_text
    from fivefold.planner.simulate import simulate
    from fivefold.planner.trace import write_trace

    op_level = None
    if args.op_trace:  # refused before any output where the op trace does not reach
        from fivefold.planner.trace import write_op_trace
        from fivefold.planner.trace_step import op_step
        op_level = op_step(cfg, prof)
        write_op_trace(op_level, args.op_trace)
    est = simulate(cfg, prof, keep_events=bool(args.trace))
    if args.trace:
        write_trace(est, args.trace)
    if args.json:  # the band from the cross-validated residuals (fivefold.planner.bands)
        from fivefold.planner.bands import band_fields
        print(json.dumps({**est.to_json(), **context_json(cfg, prof),
                          **band_fields(cfg, est.step_time_s)}, indent=1))
    else:
        print(estimate_text(est, prof, cfg))
    if op_level is not None:  # beside --json's object, on stderr
        print(f"op trace: step {op_level.step_time_s:.4f} s scheduled op by op, block model "
              f"{est.step_time_s:.4f} s (ratio {op_level.step_time_s / est.step_time_s:.3f}); "
              f"{len(op_level.ops)} ops written to {args.op_trace}",
              file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_plan(cfg, prof, args) -> int:
    from fivefold.planner.auto import plan_search
    from fivefold.planner.report import context_json, plan_text

    if args.top < 1:
        raise ConfigError("--top", f"must be at least 1, got {args.top}")
    from fivefold.planner.cluster import cluster_groups
    from fivefold.planner.objective import check_objective, ranked, score, scored_json

    groups = cluster_groups(cfg)
    check_objective(args.objective, groups)
    result = plan_search(cfg, prof, args.top)
    items = ranked([score(cfg, e, "uniform", groups, [{"group": groups[0].label,
                                                        "replicas": e.layout.dp}])
                    for e in result.best], args.objective)
    if args.json:
        print(f"fivefold plan: scored {result.scored} layouts ({result.fitting} fit) in "
              f"{result.seconds:.1f} s", file=sys.stderr)
        from fivefold.planner.bands import band_fields  # the cross-validated band
        context = context_json(cfg, prof)
        print(json.dumps([{**scored_json(s), **context,
                           **band_fields(cfg, s.estimate.step_time_s)} for s in items],
                         indent=1))
    elif args.objective != "time" or any(s.goodput or s.usd_per_million_tokens is not None
                                         for s in items):
        from fivefold.planner.objective_report import objective_text
        print(objective_text(items, cfg, groups, args.objective, result.scored,
                             result.seconds, args.top))
    else:
        print(plan_text(result, cfg, prof, args.spec))
    return 0 if result.best else 1


def cmd_plan_groups(cfg, args) -> int:
    """`plan` on a cluster of several device groups (fivefold.planner.hetero)."""
    from fivefold.planner.cluster import cluster_groups
    from fivefold.planner.hetero import hetero_search
    from fivefold.planner.objective import check_objective, ranked, score, scored_json
    from fivefold.planner.objective_report import objective_text
    from fivefold.validate import validate_cluster, validate_model, validate_train

    if args.top < 1:
        raise ConfigError("--top", f"must be at least 1, got {args.top}")
    for check in (validate_cluster, validate_model, validate_train):
        check(cfg)
    groups = cluster_groups(cfg)
    check_objective(args.objective, groups)
    result = hetero_search(cfg, groups)
    items = ranked([score(cfg, p.estimate, p.kind, p.groups, p.detail) for p in result.best],
                   args.objective)
    if args.json:
        print(f"fivefold plan: scored {result.scored} placements in {result.seconds:.1f} s",
              file=sys.stderr)
        print(json.dumps([scored_json(s) for s in items[:args.top]], indent=1))
    else:
        print(objective_text(items, cfg, groups, args.objective, result.scored,
                             result.seconds, args.top))
    return 0 if items else 1


def cmd_simulate_groups(cfg, args) -> int:
    """`simulate` on a cluster of several device groups (fivefold.planner.hetero_simulate)."""
    from fivefold.planner.cluster import cluster_groups
    from fivefold.planner.hetero_simulate import simulate_groups
    from fivefold.planner.objective import score, scored_json
    from fivefold.planner.objective_report import objective_text
    from fivefold.validate import validate_cluster, validate_model, validate_train

    if args.trace or args.op_trace:
        flag = "--trace" if args.trace else "--op-trace"
        raise ConfigError(flag, f"a trace is written for one group's layout; drop {flag}")
    for check in (validate_cluster, validate_model, validate_train):
        check(cfg)
    groups = cluster_groups(cfg)
    placed = simulate_groups(cfg, groups)
    scored = score(cfg, placed.estimate, placed.kind, placed.groups, placed.detail)
    if args.json:
        print(json.dumps(scored_json(scored), indent=1))
    else:
        print(objective_text([scored], cfg, groups, "time", None, 0.0, 1))
    return 0


def cmd_plan_train(args, train_main: Callable[[list[str]], int]) -> int:
    """`plan SPEC --train`: `fivefold train SPEC --set parallel=auto` on --nproc local ranks
    (fivefold.planner.auto searches the layouts the runtime executes, on this device)."""
    if args.json:
        raise ConfigError("--json", "--train prints the chosen layout and trains; drop --json")
    argv = ["train", args.spec, *(a for o in args.overrides for a in ("--set", o)),
            "--set", "parallel.auto=true", "--nproc", str(args.nproc), "--run-dir", args.run_dir]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    return train_main(argv)


def cmd_validate(runs_path: str | None, as_json: bool, cross: bool = False) -> int:
    from fivefold.planner.validation import (cross_report, cross_validate, mape, read_runs,
                                             report, validate_runs)

    if cross:
        cv = cross_validate(read_runs(runs_path))
        if runs_path is None:  # the packaged rows: store their band table for simulate/plan
            from fivefold.planner.validation import record_bands
            record_bands(cv)
        if not as_json:
            print(cross_report(cv))
            return 0
        print(json.dumps({
            "runs": [{"id": a.id, "source": cv.sources[a.id], "published_s": a.published_s,
                      "in_sample_s": a.predicted_s, "held_out_s": b.predicted_s}
                     for a, b in zip(cv.in_sample, cv.held_out)],
            "mape_in_sample": mape(cv.in_sample), "mape_held_out": mape(cv.held_out),
            "band_coverage": cv.band_coverage,
            "fitted": cv.in_sample_fit.fit.as_dict(),
            "at_bounds": list(cv.in_sample_fit.at_bounds),
            "folds": {k: {"fitted": f.fit.as_dict(), "at_bounds": list(f.at_bounds)}
                      for k, f in cv.fold_fits.items()}}, indent=1))
        return 0
    checks = validate_runs(read_runs(runs_path))
    if as_json:
        print(json.dumps({"runs": [{"id": c.id, "gpu": c.gpu, "predicted_s": c.predicted_s,
                                    "published_s": c.published_s, "error": c.error}
                                   for c in checks], "mape": mape(checks)}, indent=1))
    else:
        print(report(checks))
    return 0


def cmd_calibrate(args) -> int:
    from fivefold.planner.calibrate import calibrate, summary

    if args.ranks < 1:
        raise ConfigError("--ranks", f"must be at least 1, got {args.ranks}")
    prof = calibrate(args.out, args.device, args.ranks, args.threads, args.offload_path)
    print(summary(prof))
    print(f"wrote {args.out}; use it with --set cluster.gpu={args.out}", file=sys.stderr)
    return 0
