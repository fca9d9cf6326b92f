"""From a validated config to this rank's pipeline pieces: its stage and its schedules.

`build_pipeline_stage(cfg, pp_rank, device)` cuts the blocks into `pp * vpp` virtual stages
(`parallel.stage_layers`, or balanced by cost: fivefold.parallel.pipeline.partition) and
builds rank `pp_rank`'s chunks. `pipeline_schedules(cfg, micro_batches)` gives the training
and evaluation action lists of `parallel.schedule` (TeraPipe cuts sequences into
`parallel.token_slices` slices, default pp). PipeDream-2BW's lists span the whole run and are
built by its engine (fivefold.parallel.pipeline.pipedream_2bw).
"""

from __future__ import annotations

import torch

from fivefold.config import Config
from fivefold.parallel.pipeline.partition import (stage_ids_of_rank, stage_layer_ranges,
                                                  token_slices)
from fivefold.parallel.pipeline.schedules import Schedule, build_schedule
from fivefold.parallel.pipeline.stage import PipelineStage, build_stage


def layer_ranges(cfg: Config) -> list[range]:
    p = cfg.parallel
    return stage_layer_ranges(cfg.model, p.pp * p.vpp, p.stage_layers)


def build_pipeline_stage(cfg: Config, pp_rank: int, device: torch.device) -> PipelineStage:
    p = cfg.parallel
    return build_stage(cfg.model, cfg.train.seed, stage_ids_of_rank(p.pp, p.vpp, pp_rank),
                       layer_ranges(cfg), device)


def pipeline_schedules(cfg: Config, micro_batches: int) -> tuple[Schedule, Schedule]:
    """(training, evaluation) action lists of a synchronous `parallel.schedule`."""
    p, tied = cfg.parallel, cfg.model.tied_embeddings
    args = (p.schedule, p.pp, micro_batches, p.vpp, token_slices(cfg), tied)
    return build_schedule(*args), build_schedule(*args, forward_only=True)
