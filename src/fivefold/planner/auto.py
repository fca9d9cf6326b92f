"""`parallel.auto`: the planner chooses the layout that `fivefold train` runs.

`fivefold train` with `parallel.auto = true` (or `parallel = "auto"`, or `fivefold plan SPEC
--train`) calls `resolve_auto` once, in the launching process, before any rank starts: it
searches the layouts of the launched world (fivefold.planner.search) on this device's
hardware profile and returns the winning `ParallelPlan` with the config that spells it out
(`layout_config`). The launcher hands the plan itself to the ranks (RUN_DIR/plan.json), so
the run trains the very plan that was scored, and is exactly the run of a config that
spelled the layout out (the `--set` overrides printed for the user); the ranks never
search.

The space is that of `fivefold plan`, restricted to what the runtime executes: every
candidate is turned into a config and kept only if `fivefold.validate.validate_for_training`
accepts it on this world, so the restriction follows the runtime as it grows (pipeline,
context or expert degrees become candidates the day validation admits them). Keys of the
search (`SEARCHED`) that the config sets to a non-default value are held fixed; the others
(global batch, precision, reduce dtype, ZeRO++ switches, the model, the optimizer) are always
the config's own. Offload is the search's (fivefold.planner.search: a tier only for layouts
that do not fit without one), unless the config sets parallel.offload, which then holds for
every layout; nvme needs the config's parallel.offload_path, without which validation
refuses it.

Profile: the device's (`local_profile`): on a GPU `cluster.gpu` when set, else the detected
GPU's; on the CPU a calibrated CPU profile file named by `cluster.gpu`, else the built-in
`cpu` profile, whose rates the ranks share as `simulate` shares them.
"""

from __future__ import annotations

import math
from collections import Counter

import dataclasses
from dataclasses import dataclass

from fivefold.config import Config, ConfigError, ParallelConfig
from fivefold.hardware import PROFILES, HardwareProfile, load_profile
from fivefold.parallel.plan import ParallelPlan, device_precision
from fivefold.planner.report import layout_line
from fivefold.planner.search import SearchResult, search
from fivefold.planner.simulate import Estimate, shared_machine
from fivefold.validate import (validate_cluster, validate_data, validate_for_training,
                               validate_model, validate_train)

GiB = 2**30
SEARCHED = ("dp", "tp", "pp", "cp", "ep", "vpp", "schedule", "stage_layers", "zero_stage",
            "zero_group", "micro_batch", "recompute", "sequence_parallel")
DEFAULTS = ParallelConfig()


@dataclass
class AutoPlan:
    """The resolved run: the plan that was scored, the config that spells it out (and its
    `--set` overrides), and its prediction."""

    plan: ParallelPlan
    cfg: Config
    overrides: list[str]
    estimate: Estimate
    result: SearchResult
    profile: HardwareProfile
    world_size: int

    def summary(self) -> str:
        est, mem = self.estimate, self.estimate.memory_per_gpu_bytes
        return (f"parallel.auto: {layout_line(est.parallel)} on {self.world_size} rank(s) "
                f"({self.profile.name}); predicted step {est.step_time_s:.4g} s, "
                f"{est.tokens_per_s:,.0f} tokens/s, {mem['total'] / GiB:.3f} GiB per rank "
                f"(best of {self.result.scored} runnable layouts)\n"
                f"parallel.auto: the same as {' '.join(self.overrides)}")


def fixed_keys(p: ParallelConfig) -> dict:
    """Searched keys the config sets to a non-default value: the search holds them fixed."""
    return {k: getattr(p, k) for k in SEARCHED if getattr(p, k) != getattr(DEFAULTS, k)}


def layout_config(cfg: Config, lay: ParallelPlan) -> Config:
    """`cfg` with `lay`'s degrees and switches written in, as a user would write them (dp
    and a whole-dp zero_group left to be derived); its training plan is `lay` again."""
    stages = lay.pp * lay.vpp
    p = dataclasses.replace(
        cfg.parallel, auto=False, dp=None, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep,
        etp=lay.etp,
        vpp=lay.vpp, schedule=lay.schedule,
        stage_layers=list(lay.stage_layers) if stages > 1 and lay.stage_layers else None,
        zero_stage=lay.zero_stage,
        zero_group=None if lay.zero_group == lay.dp else lay.zero_group,
        micro_batch=lay.micro_batch, recompute=lay.recompute,
        sequence_parallel=lay.sequence_parallel, offload=lay.offload,
        offload_fraction=lay.offload_fraction)
    return dataclasses.replace(cfg, parallel=p)


def layout_overrides(cfg: Config) -> list[str]:
    """The `--set` arguments that turn an auto config into `cfg`'s layout."""
    out = ["parallel.auto=false"]
    for key in (*SEARCHED, "offload", "offload_fraction"):
        value = getattr(cfg.parallel, key)
        if value == getattr(DEFAULTS, key):
            continue
        text = str(value).lower() if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else str(value).replace(" ", ""))
        out.append(f"parallel.{key}={text}")
    return out


def local_profile(cfg: Config, device_type: str,
                  detected: HardwareProfile | None) -> HardwareProfile:
    """The profile of the device the ranks will run on: on a GPU cluster.gpu or else the
    detected GPU's; on the CPU cluster.gpu only when it is a CPU profile (a `fivefold
    calibrate` file), else the built-in `cpu` one (a spec's GPU names another machine).
    `detected` is what the runtime found for a GPU (fivefold.train.dist.detect_profile; None
    when unknown): asking the device is not the planner's, which runs without torch."""
    if cfg.cluster.gpu is not None:
        named = load_profile(cfg.cluster.gpu)
        if device_type != "cpu" or named.cores:
            return named
    prof = PROFILES["cpu"] if device_type == "cpu" else detected
    if prof is None:
        raise ConfigError("cluster.gpu", "parallel.auto needs this device's hardware profile "
                                         "and does not know this GPU; set cluster.gpu to a "
                                         "profile name or run `fivefold calibrate --device "
                                         "cuda` and pass its file")
    return prof


def resolve_auto(cfg: Config, world_size: int, device_type: str,
                 detected: HardwareProfile | None = None) -> AutoPlan:
    """The fastest layout of `cfg` on `world_size` ranks of `device_type` that the runtime
    executes and that fits; ConfigError naming the keys when there is none. `detected`: the
    GPU's profile as the runtime found it (`local_profile`)."""
    p = cfg.parallel
    if p.stage_layers is not None:
        raise ConfigError("parallel.stage_layers", "parallel.auto cuts the blocks into stages "
                                                   "itself; drop stage_layers or set the "
                                                   "whole layout without auto")
    for check in (validate_model, validate_cluster, validate_train, validate_data):
        check(cfg)  # what no layout can fix is reported as itself
    fixed = fixed_keys(p)
    prof = shared_machine(local_profile(cfg, device_type, detected), world_size)
    precision = p.precision or device_precision(device_type)
    searched_defaults = {k: getattr(DEFAULTS, k) for k in SEARCHED}  # the search sets them
    plan_cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(p, precision=precision, **searched_defaults),
        cluster=dataclasses.replace(cfg.cluster, gpus=world_size))
    verdicts: dict[tuple, bool] = {}
    rejections: list[ConfigError] = []  # why candidates keeping the fixed keys cannot run

    def runnable(lay: ParallelPlan) -> bool:
        run_cfg = layout_config(cfg, lay)
        key = tuple(getattr(run_cfg.parallel, k) if k != "stage_layers" else
                    tuple(run_cfg.parallel.stage_layers or ())
                    for k in (*SEARCHED, "offload", "offload_fraction"))
        if key not in verdicts:
            verdicts[key] = _matches(run_cfg.parallel, lay, fixed) and _trainable(
                run_cfg, world_size, rejections)
        return verdicts[key]

    result = search(plan_cfg, prof, top_k=1, accept=runnable)
    if not result.best:
        raise ConfigError("parallel.auto", _no_layout_message(world_size, prof, fixed, result,
                                                              rejections))
    best = result.best[0]
    run_cfg = layout_config(cfg, best.layout)
    return AutoPlan(best.layout, run_cfg, layout_overrides(run_cfg), best, result, prof,
                    world_size)


def plan_spec(cfg: Config) -> tuple[Config, dict]:
    """`fivefold plan`'s spec, checked, and the layout keys it holds fixed (`fixed_keys`, the
    block split aside: the search cuts the blocks itself). The spec is checked as
    `fivefold.planner.spec.prepare` checks it, but on the smallest layout that keeps the
    fixed keys (the others at their defaults, dp the least the fixed keys need), so the
    batch is checked per candidate by the search, not against a layout the spec never
    asked for; a layout key the cluster cannot take is refused naming it."""
    from fivefold.planner.spec import cluster_gpus, prepare

    p = cfg.parallel
    fixed = {k: v for k, v in fixed_keys(p).items() if k != "stage_layers"}
    held = dataclasses.replace(p, **{**{k: getattr(DEFAULTS, k) for k in SEARCHED}, **fixed})
    dp = held.dp or math.lcm(held.zero_group or 1, held.ep // math.gcd(held.ep, held.cp))
    model_ranks = held.tp * held.pp * held.cp
    gpus = cluster_gpus(cfg)
    if gpus % (model_ranks * (held.dp or 1)):
        key = next(k for k in ("dp", "tp", "pp", "cp") if k in fixed)
        raise ConfigError(f"parallel.{key}", f"tp*pp*cp{'*dp' * bool(held.dp)} = "
                                             f"{model_ranks * (held.dp or 1)} does not divide "
                                             f"cluster.gpus = {gpus}; plan holds the layout "
                                             "keys the spec sets: change or drop it")
    prepare(dataclasses.replace(cfg, parallel=dataclasses.replace(held, dp=None),
                                cluster=dataclasses.replace(cfg.cluster,
                                                            gpus=model_ranks * dp)))
    return dataclasses.replace(cfg, parallel=dataclasses.replace(
        p, **{k: getattr(DEFAULTS, k) for k in SEARCHED})), fixed


def plan_search(cfg: Config, prof: HardwareProfile, top_k: int) -> SearchResult:
    """`fivefold plan`: the search of `cfg`'s layouts that keep the keys its spec sets
    (`plan_spec`); ConfigError naming them when no layout of the cluster keeps them."""
    cfg, fixed = plan_spec(cfg)
    result = search(cfg, prof, top_k, accept=lambda lay: _held(lay, fixed))
    if fixed and not result.scored:
        held = ", ".join(f"parallel.{k} = {v!r}" for k, v in fixed.items())
        raise ConfigError(f"parallel.{next(iter(fixed))}",
                          f"no layout of {cfg.cluster.gpus} devices keeps {held} and splits "
                          f"global_batch = {cfg.parallel.global_batch} and this model; plan "
                          "holds the layout keys the spec sets: drop some to widen the search")
    return result


def _held(lay: ParallelPlan, fixed: dict) -> bool:
    return all(getattr(lay, k) == v for k, v in fixed.items())


def _matches(p: ParallelConfig, lay: ParallelPlan, fixed: dict) -> bool:
    """The candidate keeps every fixed key (dp and zero_group compared as resolved)."""
    resolved = {"dp": lay.dp, "zero_group": lay.zero_group}
    return all(resolved.get(k, getattr(p, k)) == v for k, v in fixed.items())


def _trainable(cfg: Config, world_size: int, rejections: list[ConfigError]) -> bool:
    try:
        validate_for_training(cfg, world_size)
    except ConfigError as err:
        rejections.append(err)
        return False
    return True


def _no_layout_message(world_size: int, prof: HardwareProfile, fixed: dict,
                       result: SearchResult, rejections: list[ConfigError]) -> str:
    held = ", ".join(f"parallel.{k} = {v!r}" for k, v in fixed.items())
    if result.scored:
        why = (f"{result.scored} runnable layouts were scored and none fits in "
               f"{prof.memory_bytes / GiB:.0f} GiB per device")
    elif rejections:
        # a key outside the searched layout (the user's own, e.g. train.optimizer) first,
        # then the reason most candidates hit
        counts = Counter(str(err) for err in rejections)
        keys = {str(err): err.key for err in rejections}
        reason = min(counts, key=lambda r: (keys[r].startswith("parallel."), -counts[r]))
        why = f"no layout of the search space can run here (e.g. {reason})"
    elif held:
        why = "no layout of the search space keeps the keys held fixed"
    else:
        why = "no layout of the search space splits this model and batch over them"
    return (f"found no layout for {world_size} rank(s): {why}"
            + (f"; held fixed: {held} (drop them to widen the search)" if held else "")
            + "; change the ranks (--nproc), model.* or parallel.global_batch, or write the "
              "layout out without auto")
