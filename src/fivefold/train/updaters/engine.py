"""The data-parallel engine's update rule (`plan.update == "engine"`): DDP, ZeRO-1/2/3,
hierarchical sharding, ZeRO++, expert units and offload, all in
fivefold.parallel.data_parallel.DataParallelEngine, which this wraps: it owns the flat
parameter units, their gradient sync, fp32 masters and optimizer, and its collectives sum,
so the trainer scales each loss by the global batch's tokens only."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.config import TrainConfig
from fivefold.memory.galore_engine import engine_class
from fivefold.memory.offload import Offload
from fivefold.parallel.data_parallel import ZeroPP
from fivefold.parallel.expert import grid_counted_masks
from fivefold.parallel.mesh import ExpertAxes
from fivefold.parallel.mesh import ExpertAxes, Mesh
from fivefold.parallel.plan import ParallelPlan
from fivefold.parallel.tensor import counted_masks
from fivefold.train.moe_stats import moe_layers
from fivefold.train.nonfinite import first_nonfinite, flat_unit_grads
from fivefold.train.updaters.base import ClippedUpdater

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def plan_offload(plan: ParallelPlan, rank: int) -> Offload | None:
    """The engine's offload tier (fivefold.memory.offload), or None."""
    return (None if plan.offload == "none" else
            Offload(plan.offload, plan.offload_path, plan.offload_fraction, rank,
                    plan.offload_kernel))


class EngineUpdater(ClippedUpdater):
    """DataParallelEngine on `model` as `plan` lays it out over `mesh`; `compute` is the
    dtype of the compute copies (fivefold.parallel.plan.compute_precision)."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, mesh: Mesh, train: TrainConfig,
                 device: torch.device, compute: str, rank: int, norm_axes: list[Axis],
                 expert_axes: ExpertAxes | None):
        super().__init__(norm_axes, plan.precision == "fp16")
        self.mesh, self.expert_axes = mesh, expert_axes  # the experts' grid, if any
        self.tp_rank = mesh.axis("tp").rank
        zero_pp = ZeroPP(plan.qwz, plan.hpz, plan.qgz, plan.ranks_per_node,
                         plan.expert_ranks_per_node)
        self.engine = engine_class(train)(model, plan.zero_stage, mesh, train, device,
                                           DTYPES[compute], DTYPES[plan.reduce_dtype], zero_pp,
                                           plan.shard_axes, self.expert_axes,
                                           plan_offload(plan, rank))

    def prepare_backward(self, last: bool) -> None:
        self.engine.prepare_backward(last)

    def after_backward(self, last: bool) -> None:
        self.engine.after_backward()

    def grads_for_norm(self):
        """Each parameter's part of this rank's master gradients (and of the counted masks),
        in the model's parameter order, as the plain updater hands them. torch's fp32 CPU
        norm sums each tensor's squares in a few vector lanes, so a norm of whole flat units
        is another rounding than the plain run's norm of per-parameter norms (1.4e-6 against
        3e-7 off the fp64 value, measured on the test model), and once the norm passes
        grad_clip the clipping coefficient differs in its last bit. With the parts, one
        rank's engine norms exactly the plain updater's tensors (every ZeRO stage, offload
        too) and gets its norm bit for bit."""
        engine = self.engine
        counted = (grid_counted_masks(engine, self.mesh)
                   if self.expert_axes else counted_masks(engine.units, self.tp_rank))
        order = {id(q): k for k, q in enumerate(engine.model.parameters())}
        parts = []
        for unit, master, mask in zip(engine.units, engine.masters, counted):
            masks = [None] * len(unit.params) if mask is None else unit.shard_parts(mask)
            for (param, grad), part_mask in zip(unit.shard_parts(master.grad), masks):
                parts.append((order.get(id(param), len(order)), grad,
                              None if part_mask is None else part_mask[1]))
        parts.sort(key=lambda part: part[0])  # stable: unordered parts keep the unit order
        grads = [grad for _, grad, _ in parts]
        masks = [mask for _, _, mask in parts]
        return grads, (None if all(m is None for m in masks) else masks)

    def step(self, lr: float) -> None:
        self.engine.step(lr)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def first_nonfinite(self) -> str | None:
        return first_nonfinite(flat_unit_grads(self.engine.units,
                                               [m.grad for m in self.engine.masters]))

    def checkpoint_state(self, tag: str) -> dict:
        """The engine's shards, keyed with the pp and tp ranks (`tag`), and the MoE
        balancing biases (the same on every rank of a stage)."""
        biases = {f"expert_bias.{name}": moe.expert_bias
                  for name, moe in moe_layers(self.engine.model) if moe.balance_bias}
        return {**{key + tag: value for key, value in self.engine.checkpoint_state().items()},
                **biases}

    def after_load(self, state: dict, tag: str, step: int) -> None:
        self.engine.after_checkpoint_load()
