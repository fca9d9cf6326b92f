"""Predict one training step of a layout (`fivefold simulate`): memory per device and step
time with its breakdown.

`simulate` builds the layout's `LayoutStep` (fivefold.planner.step, which says how the step
is assembled) and returns its `Estimate`. The parts, each replaceable:

- fivefold.planner.events: the discrete-event scheduler over a rank's streams (compute, one
  per communication axis, host, disk) with dependencies and compute/collective contention
  (`overlap_eff`): the one overlap model.
- fivefold.planner.block_ops, block_cost: each block's forward and backward as ops on those
  streams (tensor, context, expert and ZeRO-3/ZeRO-2 collectives), priced by
  fivefold.planner.compute and fivefold.planner.comm, scheduled once per distinct shape.
- fivefold.planner.stage_cost: stages, their times, the pipeline's action lists replayed.
- fivefold.planner.rank_cost: the data-parallel tail (the gradient buckets scheduled beside
  the replayed last backward) and the optimizer.
- fivefold.planner.step: memory per rank and the step's assembly.
"""

from __future__ import annotations

import dataclasses

from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.hardware import HardwareProfile, load_profile
from fivefold.models.description import is_moe_layer
from fivefold.parallel.plan import ParallelPlan, plan_from_config
from fivefold.planner.compute import Shard, block_times, head_times
from fivefold.planner.estimate import Estimate
from fivefold.planner.fitted import FITTED, Fitted
from fivefold.planner.spec import check_model_fits_layout, cluster_gpus
from fivefold.planner.step import LayoutStep


def default_precision(prof: HardwareProfile) -> str:
    """bf16 where the device has bf16 units at least as fast as fp32, else fp32 (CPUs)."""
    peaks = prof.peak_tflops
    return "bf16" if peaks.get("bf16", 0.0) >= peaks["fp32"] else "fp32"


def profile_of(cfg: Config) -> HardwareProfile:
    if cfg.cluster.gpu is None:
        raise ConfigError("cluster.gpu", "plan and simulate need a hardware profile; set "
                                         "cluster.gpu to one of V100-32GB, A100-40GB, "
                                         "A100-80GB, H100-SXM, H800, H200, B200, GB200, cpu "
                                         "or a file written by `fivefold calibrate`")
    return load_profile(cfg.cluster.gpu)


def shared_machine(prof: HardwareProfile, ranks: int) -> HardwareProfile:
    """A CPU profile's rates when more ranks than it was measured for share the machine:
    `cores` ranks run at the measured rate; beyond that they split the cores evenly."""
    if not prof.cores or ranks <= prof.cores:
        return prof
    share = prof.cores / ranks
    return dataclasses.replace(prof, peak_tflops={k: v * share for k, v in
                                                  prof.peak_tflops.items()},
                               hbm_GBps=prof.hbm_GBps * share)


def simulate(cfg: Config, prof: HardwareProfile | None = None,
             plan: ParallelPlan | None = None, keep_events: bool = False,
             fit: Fitted = FITTED) -> Estimate:
    """The predicted step of `cfg` (or of `plan` on cfg's model and cluster); `fit`: the
    fitted constants (fivefold.planner.fitted; the validation's fits pass their own)."""
    prof = shared_machine(prof or profile_of(cfg), cfg.cluster.gpus or 1)
    plan = plan or plan_from_config(cfg, cluster_gpus(cfg), default_precision(prof))
    check_model_fits_layout(cfg.model, plan)
    return LayoutStep(cfg, prof, plan, fit=fit).estimate(keep_events)


def model_flops_per_token(model: ModelConfig, prof: HardwareProfile) -> float:
    """Model FLOPs per trained token by the convention of docs/planner.md."""
    one = Shard(1, model.seq_len, 1, 1, False, 1, "bf16", "none")
    total = sum(block_times(model, one, prof, is_moe_layer(model, i)).model_flops
                for i in range(model.layers))
    return (total + head_times(model, one, prof).model_flops) / model.seq_len
