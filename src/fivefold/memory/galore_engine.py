"""The data-parallel engine with GaLore as its optimizer (fivefold.memory.galore_units).

`engine_class(train)` is what the trainer builds for `ParallelPlan.update == "engine"`:
`GaLoreEngine` under `train.optimizer = "galore"` (tensor or pipeline parallelism, ZeRO-3:
the layouts fivefold.memory.galore_dp does not run), else the plain DataParallelEngine.
The engine keeps units, gradient sync, masters, clipping's view and publishing; GaLoreEngine
only replaces the optimizer, its byte count and its checkpoint tensors. A resume under
another layout is refused for GaLore by fivefold.train.checkpoint.check_layout.
"""

from __future__ import annotations

import torch

from fivefold.config import TrainConfig
from fivefold.memory.galore_units import GaLoreUnits
from fivefold.parallel.data_parallel import DataParallelEngine


class GaLoreEngine(DataParallelEngine):
    """DataParallelEngine whose optimizer is GaLoreUnits (same constructor)."""

    def __init__(self, model, stage, mesh, train: TrainConfig, *args, **kwargs):
        super().__init__(model, stage, mesh, train, *args, **kwargs)
        self.optimizer = GaLoreUnits(self, train, mesh.axis("tp"))
        self.record_model_state()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """This rank's masters and GaLore's and AdamW's states, loaded in place."""
        tag = f"shard{self.shard_axis.rank}of{self.shard_axis.size}"
        out = {f"master.{unit.name}.{tag}": master.data
               for unit, master in zip(self.units, self.masters)}
        return {**out, **self.optimizer.checkpoint_state(tag)}


def engine_class(train: TrainConfig) -> type[DataParallelEngine]:
    """The engine that owns a run's update under `train.optimizer` (module docstring)."""
    return GaLoreEngine if train.optimizer == "galore" else DataParallelEngine
