"""The `fivefold report` subcommand: write the run report of a run directory.

    fivefold report RUN_DIR [--out FILE] [--profile NAME]

Command-line glue beside cli.py, like plan_commands.py; the page is fivefold.report's.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    rep = sub.add_parser("report", help="write a self-contained HTML page about a run "
                                        "(curves, memory, ledger, predicted timeline, config)")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a `fivefold train` run")
    rep.add_argument("--out", metavar="FILE", help="page to write (default RUN_DIR/report.html)")
    rep.add_argument("--profile", metavar="NAME",
                     help="hardware profile of the predicted timeline (default: the run's "
                          "cluster.gpu, else this machine's device)")


def run(args: argparse.Namespace) -> int:
    from fivefold.report.page import render
    from fivefold.report.run_data import read_run

    data = read_run(args.run_dir)
    out = Path(args.out) if args.out else data.run_dir / "report.html"
    out.write_text(render(data, args.profile))
    print(f"wrote {out}" + "".join(f"\n  missing: {m}" for m in data.missing))
    return 0
