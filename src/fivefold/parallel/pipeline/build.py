"""From a config and its plan to this rank's pipeline stage.

`build_pipeline_stage(cfg, plan, pp_rank, device)` cuts the blocks into `pp * vpp` virtual
stages (`plan.stage_layers`, or balanced by cost: fivefold.parallel.pipeline.partition) and
builds rank `pp_rank`'s chunks (`plan.stage_ids_of_rank`). The action lists the stage runs
come from the same plan (`ParallelPlan.pipeline_schedules`; PipeDream-2BW's span the whole
run and are built by its engine, fivefold.parallel.pipeline.pipedream_2bw).
"""

from __future__ import annotations

import torch

from fivefold.config import Config, ModelConfig
from fivefold.parallel.pipeline.partition import stage_layer_ranges
from fivefold.parallel.pipeline.stage import PipelineStage, build_stage
from fivefold.parallel.plan import ParallelPlan


def layer_ranges(model: ModelConfig, plan: ParallelPlan) -> list[range]:
    """The blocks of each of the plan's `pp * vpp` virtual stages."""
    return stage_layer_ranges(model, plan.pp * plan.vpp, plan.stage_layers)


def build_pipeline_stage(cfg: Config, plan: ParallelPlan, pp_rank: int,
                         device: torch.device) -> PipelineStage:
    return build_stage(cfg.model, cfg.train.seed, plan.stage_ids_of_rank(pp_rank),
                       layer_ranges(cfg.model, plan), device, borrow_head=plan.v_shape)
