"""The planner's prediction of the run's step, for the report: `fivefold simulate` on the
config and parallel plan the run's checkpoint recorded, with the events of its Chrome trace
(fivefold.planner.trace) as the timeline to draw against the measured step time.

The hardware profile is `--profile` when given, else the run's `cluster.gpu`, else the one
matching this machine's device (what the trainer's MFU used when the report is made where the
run trained); the page names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import ConfigError
from fivefold.hardware import HardwareProfile, load_profile
from fivefold.planner.simulate import Estimate, simulate
from fivefold.planner.spec import spec_config
from fivefold.planner.trace import trace_events
from fivefold.report.run_data import RunData


@dataclass
class Prediction:
    estimate: Estimate
    profile: HardwareProfile
    events: list[dict]  # complete ("X") trace events: name, pid (pipeline rank), tid, ts, dur


def predict(run: RunData, profile: str | None = None) -> Prediction | str:
    """The simulated step of `run`, or a sentence saying why there is none; a `profile` that
    does not load is the user's error (ConfigError naming --profile)."""
    try:
        chosen = load_profile(profile) if profile else None
    except ConfigError as err:
        raise ConfigError("--profile", str(err).split(": ", 1)[1]) from None
    if run.config is None or run.plan is None:
        return "no predicted timeline: the run has no finished checkpoint holding its config"
    from fivefold.parallel.plan import ParallelPlan

    spec = _without_none(run.config)
    spec["model"].pop("preset", None)  # every model key is written out; no preset to overlay
    try:
        plan = ParallelPlan.from_dict(run.plan)  # ValueError: a plan of another version
        spec.setdefault("cluster", {})["gpus"] = plan.dp * plan.tp * plan.pp * plan.cp
        prof = chosen or _profile(run.config)
        if prof is None:
            return ("no predicted timeline: no hardware profile matches this machine; pass "
                    "--profile NAME (e.g. H100-SXM, cpu, or a `fivefold calibrate` file)")
        cfg = spec_config(spec)
        est = simulate(cfg, prof, plan=plan, keep_events=True)
    except (ConfigError, ValueError) as err:
        return f"no predicted timeline: the planner cannot simulate this run's config ({err})"
    # the page's two lanes per rank: the actions and the optimizer, and every stream's
    # collectives as one comm lane (the block ops inside an action are the trace's detail)
    events = [dict(e, tid=min(e["tid"], 1)) for e in trace_events(est, est.step_model)
              if e["ph"] == "X" and (e["tid"] or e.get("cat") == "action"
                                     or e["name"] == "optimizer")]
    return Prediction(est, prof, events)


def _profile(config: dict) -> HardwareProfile | None:
    """The run's cluster.gpu, else the profile of this machine's device (None: unknown)."""
    name = config.get("cluster", {}).get("gpu")
    if name is not None:
        return load_profile(name)
    from fivefold.train.dist import detect_profile, pick_device

    try:
        device = pick_device(config.get("train", {}).get("device", "auto"), 0)
    except RuntimeError:  # a GPU run reported on a machine without one
        return None
    return detect_profile(device)


def _without_none(table: dict) -> dict:
    """The config table without unset (None) keys, which a spec leaves out."""
    return {k: _without_none(v) if isinstance(v, dict) else v
            for k, v in table.items() if v is not None}


def profile_line(prof: HardwareProfile) -> str:
    """The profile as the page names it: name, source and fp32/bf16 peaks."""
    peaks = ", ".join(f"{k} {v:g}" for k, v in sorted(prof.peak_tflops.items()))
    return f"{prof.name} ({prof.source}; peak TFLOP/s {peaks})"

