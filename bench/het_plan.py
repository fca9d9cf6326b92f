"""The planner's side of bench/heterogeneous.py: the bench's ranks described as cluster
groups, each with a CPU profile calibrated for its situation, and the planner's shares and
predicted steps for them (fivefold.planner.hetero_simulate).

Groups and how each profile is calibrated (`fivefold calibrate`'s code, one intra-op thread
per rank, as the bench's ranks run):
- pinned: group `fast` is rank 0 alone on core 0, calibrated by one process pinned to core 0
  (`--ranks 1`); group `slow` is ranks 1 and 2 sharing core 1, calibrated by two processes
  pinned together to core 1 (`--ranks 2`), so its rates are each rank's share of that core
  and its link is gloo's between two ranks on one core. The calibrating processes inherit
  the affinity of this process, which is restored afterwards.
- `--emulate K`: both groups come from one calibration of two unpinned processes measuring
  at once (`--ranks 2`: the throttled ranks sleep (K - 1)/K of their time, so the three
  ranks keep 1 + 2/K cores busy, two at K = 2, and each runs on a core of its own while it
  runs; a three-process calibration would give each rank the 2/3 of a core it holds while
  all three compute, which the throttled run never does); `slow` takes that profile with
  every compute rate divided by K (GEMM and attention peaks, memory bandwidth) and every
  per-operation time multiplied by K (kernel overhead, attention's per-score and per-row
  costs, exp of -inf), because the throttle sleeps (K - 1) times the measured compute of
  each forward and backward. The optimizer and collectives are not throttled and are not
  scaled. K is the bench's argument, not a fit.
On a CPU `calibrate` multiplies the probes' rates by the share of its core each measuring
process held (fivefold.planner.calibrate_fit), so the two ranks on core 1 are priced at the
half core each sustains in training, and every group at what the machine's other jobs leave
it. Nothing here is fitted to the bench's timings: the planner sees only the profiles.

The spec handed to the planner is the bench's run: the `tiny` preset, fp32, a global batch
of 12, micro-batches of 1 sequence (so the planner may give any replica any count, and the
runtime runs exactly the micro-batches the plan times), data parallelism over the 3 ranks,
the default ZeRO stage and optimizer. The uniform plan is that spec with
`parallel.dp_batch_shares = [4, 4, 4]`; the heterogeneous plan is the planner's split by
each group's simulated speed (`hetero_simulate._shares`, fivefold.planner.hetero
.batch_shares), written as `parallel.dp_batch_shares` in sequences per replica.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

GROUP_CORES = {"fast": {0}, "slow": {1}}  # pinned: the cores each group's ranks share
GROUP_RANKS = {"fast": 1, "slow": 2}


def scaled_profile(prof, k: float):
    """`prof` computing `k` times slower, the --emulate throttle (module docstring)."""
    from fivefold.planner.calibrate_fit import slowed_profile

    return dataclasses.replace(
        slowed_profile(prof, k, f"compute rates divided by {k:g} (the bench's --emulate "
                                "throttle)"), name=f"{prof.name} / {k:g}")


def _write(prof, path: Path) -> str:
    path.write_text(json.dumps(dataclasses.asdict(prof), indent=1) + "\n")
    return str(path)


def calibrate_groups(emulate: float, out_dir: str | None = None) -> list[dict]:
    """[{name, gpus, profile (file), how}] for the fast and the slow group (module
    docstring); the profile files are written under `out_dir` (a fresh temporary folder
    when None)."""
    from fivefold.planner.calibrate import calibrate

    out = Path(out_dir or tempfile.mkdtemp(prefix="hetbench-"))
    out.mkdir(parents=True, exist_ok=True)
    if emulate:
        base = calibrate(out / "ranks2.json", "cpu", ranks=2, threads=1)
        return [{"name": "fast", "gpus": 1, "profile": _write(base, out / "fast.json"),
                 "how": "calibrate --ranks 2 --threads 1, unpinned (a core per rank)"},
                {"name": "slow", "gpus": 2,
                 "profile": _write(scaled_profile(base, emulate), out / "slow.json"),
                 "how": f"the same profile, compute rates / {emulate:g} (the throttle)"}]
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        raise SystemExit("pinned groups need 2 cores and sched_setaffinity; use --emulate K")
    before = os.sched_getaffinity(0)
    groups = []
    try:
        for name, cores in GROUP_CORES.items():
            os.sched_setaffinity(0, cores)
            path = out / f"{name}.json"
            calibrate(path, "cpu", ranks=GROUP_RANKS[name], threads=1)
            groups.append({"name": name, "gpus": GROUP_RANKS[name], "profile": str(path),
                           "how": f"calibrate --ranks {GROUP_RANKS[name]} --threads 1, "
                                  f"pinned to cores {sorted(cores)}"})
    finally:
        os.sched_setaffinity(0, before)
    return groups


def spec_config(groups: list[dict], shares: list[int] | None, global_batch: int,
                preset: str):
    """The bench's run as a spec on `groups` (module docstring), validated."""
    from fivefold.config import load_config
    from fivefold.validate import validate_cluster, validate_model, validate_train

    lines = ["[model]", f'preset = "{preset}"', "[parallel]",
             f"global_batch = {global_batch}", 'precision = "fp32"', "micro_batch = 1"]
    if shares:
        lines.append(f"dp_batch_shares = {list(shares)}")
    for g in groups:
        lines += ["[[cluster.groups]]", f"gpu = {json.dumps(g['profile'])}",
                  f"gpus = {g['gpus']}"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write("\n".join(lines) + "\n")
    try:
        cfg = load_config(fh.name)
    finally:
        os.unlink(fh.name)
    for check in (validate_cluster, validate_model, validate_train):
        check(cfg)
    return cfg


def planned(groups: list[dict], global_batch: int, preset: str, world: int) -> dict:
    """{plan name: {rows (sequences per rank), predicted_step_s, kind, groups' steps}} for
    the uniform plan and the planner's heterogeneous plan of the same ranks."""
    from fivefold.planner.cluster import cluster_groups
    from fivefold.planner.hetero_simulate import simulate_groups

    out = {}
    for name, shares in (("uniform", [global_batch // world] * world), ("planned", None)):
        cfg = spec_config(groups, shares, global_batch, preset)
        placed = simulate_groups(cfg, cluster_groups(cfg))
        table = placed.estimate.parallel
        rows = list(table.get("dp_batch_shares") or [global_batch // world] * world)
        out[name] = {"rows": rows, "kind": placed.kind,
                     "predicted_step_s": placed.estimate.step_time_s,
                     "groups": placed.detail}
    return out
