"""The updater of a plan: `build_updater` picks the one update rule `ParallelPlan.update`
names (fivefold.train.updaters) and builds it for this rank."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import TrainConfig
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.plan import ParallelPlan
from fivefold.train.memory_report import MemoryProbe
from fivefold.train.updaters.base import Updater
from fivefold.train.updaters.engine import EngineUpdater
from fivefold.train.updaters.galore import GaLoreUpdater
from fivefold.train.updaters.plain import LomoUpdater, PlainUpdater, StageUpdater


def norm_axes(plan: ParallelPlan, mesh: Mesh) -> list:
    """The axes the gradient norm's squares are summed over (ParallelPlan.grad_norm_axes),
    and at ZeRO stage 0 under ep the ep axis (each ep rank holds other experts)."""
    axes = [mesh.joint_axis(*names) for names in plan.grad_norm_axes]
    if plan.ep > 1 and plan.zero_stage == 0:
        axes.append(mesh.expert_axes(plan.ep)[0])
    return axes


def build_updater(model: nn.Module, plan: ParallelPlan, mesh: Mesh, train: TrainConfig,
                  device: torch.device, compute: str, rank: int, memory: MemoryProbe
                  ) -> Updater:
    """The updater of `plan.update` for this rank's (parallelized) `model`."""
    fp16 = plan.precision == "fp16"
    dp_axis = mesh.joint_axis("dp_replicate", "dp_shard")
    if plan.update == "engine":
        return EngineUpdater(model, plan, mesh, train, device, compute, rank,
                             norm_axes(plan, mesh))
    if plan.update == "lomo":
        return LomoUpdater(model, train, dp_axis, plan.zero_stage >= 1)
    if plan.update == "galore-dp":
        return GaLoreUpdater(model, train, plan.zero_stage, dp_axis, mesh.ledger,
                             norm_axes(plan, mesh), fp16)
    if plan.update == "pipedream-2bw":
        return StageUpdater(model, train, device, [], fp16, memory)
    return PlainUpdater(model, train, device, norm_axes(plan, mesh), fp16, memory)
