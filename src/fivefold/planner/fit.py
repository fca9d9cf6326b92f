"""Fit one hardware profile's efficiencies to the published runs of that profile.

    python -m fivefold.planner.fit H100-SXM [RUNS.json] [--fields gemm_eff,attn_eff,...]

Minimises the mean |log(predicted / published)| step time over the runs whose
cluster.gpu is the profile, by varying the named `Efficiency` fields within physical bounds
(`BOUNDS`), and prints the fitted values and the per-run errors: a tool to study one profile. What
predictions use are the profile's microbenchmark-level terms (fivefold.hardware) and the
few constants shared by every GPU profile that `fivefold plan validate --cross` fits and
cross-validates (fivefold.planner.fitted, fivefold.planner.validation).
Needs scipy (a fivefold dependency); the planner itself does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from fivefold.hardware import PROFILES, HardwareProfile
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import spec_config
from fivefold.planner.validation import read_runs

BOUNDS = {  # physically sensible ranges of each efficiency (datasheet peaks are not reached:
    # large bf16 GEMMs reach 0.7-0.85 of peak at full power, fused attention 0.3-0.75)
    "gemm_eff": (0.55, 0.92), "gemm_fp8_eff": (0.45, 0.9), "gemm_mem_eff": (0.5, 1.0),
    "attn_eff": (0.25, 0.85), "attn_score_s": (0.0, 6e-11), "attn_row_s": (0.0, 3e-9),
    "mem_eff": (0.4, 0.95), "eltwise_passes": (1.0, 8.0), "kernel_overhead_s": (1e-6, 6e-5),
    "comm_intra_eff": (0.6, 0.9), "comm_inter_eff": (0.6, 0.9),
    "latency_intra_s": (1e-6, 3e-5), "latency_inter_s": (2e-6, 1e-4),
    "overlap_eff": (0.7, 1.0), "nic_aggregation": (0.0, 1.0),
}


def loss(prof: HardwareProfile, configs: list, published: list[float]) -> float:
    errs = [abs(math.log(simulate(cfg, prof).step_time_s / pub))
            for cfg, pub in zip(configs, published)]
    return sum(errs) / len(errs)


def fit(name: str, runs: list[dict], fields: list[str]) -> tuple[HardwareProfile, float]:
    from scipy.optimize import minimize

    base = PROFILES[name]
    chosen = [r for r in runs if r["spec"].get("cluster", {}).get("gpu") == name]
    configs = [spec_config(r["spec"]) for r in chosen]
    published = [float(r["published"]["step_time_s"]) for r in chosen]

    def profile(x) -> HardwareProfile:
        values = {}
        for f, u in zip(fields, x):
            lo, hi = BOUNDS[f]
            values[f] = lo + (hi - lo) / (1 + math.exp(-u))  # bounded by a logistic map
        return dataclasses.replace(base, eff=dataclasses.replace(base.eff, **values))

    def start(f: str) -> float:
        lo, hi = BOUNDS[f]
        t = min(max((getattr(base.eff, f) - lo) / (hi - lo), 1e-3), 1 - 1e-3)
        return math.log(t / (1 - t))

    result = minimize(lambda x: loss(profile(x), configs, published),
                      [start(f) for f in fields], method="Powell",
                      options={"maxfev": 400, "xtol": 1e-3, "ftol": 1e-5})
    return profile(result.x), result.fun


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", choices=list(PROFILES))
    parser.add_argument("runs", nargs="?")
    parser.add_argument("--fields", default="gemm_eff,attn_eff,attn_score_s,eltwise_passes,"
                                            "overlap_eff,comm_inter_eff")
    args = parser.parse_args(argv)
    fields = args.fields.split(",")
    prof, value = fit(args.profile, read_runs(args.runs), fields)
    print(f"mean |log error| {value:.4f}")
    for f in fields:
        print(f"{f} = {getattr(prof.eff, f):.4g}")


if __name__ == "__main__":
    main()
