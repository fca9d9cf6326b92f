"""The updater of a plan: `build_updater` picks the one update rule `ParallelPlan.update`
names (fivefold.train.updaters) and builds it for this rank."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import TrainConfig
from fivefold.expert_grid import STAGE_AXES

from fivefold.parallel.mesh import ExpertAxes, Mesh
from fivefold.parallel.plan import ParallelPlan
from fivefold.train.memory_report import MemoryProbe
from fivefold.train.updaters.base import Updater
from fivefold.train.updaters.engine import EngineUpdater
from fivefold.train.updaters.galore import GaLoreUpdater
from fivefold.train.updaters.plain import LomoUpdater, PlainUpdater, StageUpdater


def norm_axes(plan: ParallelPlan, mesh: Mesh, expert_axes: ExpertAxes | None) -> list:
    """The axes the gradient norm's squares are summed over (ParallelPlan.grad_norm_axes);
    on the experts' grid (`expert_axes`, fivefold.expert_grid) every rank of the stage and
    pp, each element counted on one of them (fivefold.parallel.expert.grid_counted_masks)."""
    if expert_axes:
        return [mesh.joint_axis(*STAGE_AXES), mesh.axis("pp")]
    return [mesh.joint_axis(*names) for names in plan.grad_norm_axes]


def build_updater(model: nn.Module, plan: ParallelPlan, mesh: Mesh, train: TrainConfig,
                  device: torch.device, compute: str, rank: int, memory: MemoryProbe,
                  expert_axes: ExpertAxes | None = None) -> Updater:
    """The updater of `plan.update` for this rank's (parallelized) `model`; `expert_axes`:
    the experts' grid of an MoE model that has one (the trainer's)."""
    fp16 = plan.precision == "fp16"
    dp_axis = mesh.joint_axis("dp_replicate", "dp_shard")
    if plan.update == "engine":
        return EngineUpdater(model, plan, mesh, train, device, compute, rank,
                             norm_axes(plan, mesh, expert_axes), expert_axes)
    if plan.update == "lomo":
        return LomoUpdater(model, train, dp_axis, plan.zero_stage >= 1, fp16)
    if plan.update == "galore-dp":
        return GaLoreUpdater(model, train, plan.zero_stage, dp_axis, mesh.ledger,
                             norm_axes(plan, mesh, expert_axes), fp16)
    if plan.update == "pipedream-2bw":
        return StageUpdater(model, train, device, [], fp16, memory)
    return PlainUpdater(model, train, device, norm_axes(plan, mesh, expert_axes), fp16, memory)
