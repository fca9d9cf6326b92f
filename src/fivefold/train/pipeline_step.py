"""The Trainer's pipeline-parallel path (parallel.pp > 1): this rank's stage and its step.

`build_stage(cfg, plan, pp_axis, device, init_from)` builds pp rank r's stage
(fivefold.parallel.pipeline.build: its blocks keep their plain names, so deterministic
initialization gives it exactly its slice of the single-process model) and loads pretrained
weights by name; `parallelize` (fivefold.parallel.parallelize) then splits it over tp.

`PipelineStep.forward_backward` runs the forwards and backwards of one optimizer step of a
synchronous schedule (GPipe, 1F1B, interleaved, ZB-H1, TeraPipe) as the single-process
trainer's micro-batch loop does, only spread over the stages: the executor
(`PipelineEngine.train_step`) runs the rank's action list with the data-parallel engine as
its gradient synchronization and scales each micro-batch's summed cross-entropy by
1 / (tokens of the global batch), times fp16's loss scale (fivefold.train.loss_scale). The
update that follows is the trainer's one synchronous update (the engine's updater:
clipping over the plan's axes, then the engine's step). The step's summed
cross-entropy comes back the same on every pp rank. With `parallel.dp_batch_shares` each
replica's schedule has its own micro-batch count (fivefold.batch_shares.replica_plan). PipeDream-2BW
(fivefold.parallel.pipeline.pipedream_2bw) updates each stage itself, right after the
stage's last backward of the step, with its own optimizer, data-parallel all-reduce and
per-stage clipping; it reports no global gradient norm (NaN) and its loss reaches the first
and last pp ranks only (the first logs it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fivefold.batch_shares import replica_plan
from fivefold.comm.collectives import Axis
from fivefold.config import Config
from fivefold.models.llama import build_model
from fivefold.parallel.pipeline.build import build_pipeline_stage
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.pipedream_2bw import PipeDream2BWEngine
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.plan import ParallelPlan
from fivefold.train.data import BatchSampler
from fivefold.train.model_source import load_weights_into
from fivefold.train.updaters.base import Updater


def build_stage(cfg: Config, plan: ParallelPlan, pp_axis: Axis, device: torch.device,
                init_from: Path | str | None = None) -> PipelineStage:
    """This pp rank's stage, with pretrained weights taken by name from the whole model's
    (before `parallelize` splits it over tp)."""
    stage = build_pipeline_stage(cfg, plan, pp_axis.rank, device)
    if init_from is not None:
        plain = build_model(cfg.model, cfg.train.seed)
        load_weights_into(plain, cfg.model, init_from)
        stage.load_plain_state(plain.state_dict())
    return stage


class PipelineStep:
    """One optimizer step (and validation) of a pipeline-parallel rank."""

    def __init__(self, cfg: Config, plan: ParallelPlan, stage: PipelineStage,
                 axes: dict[str, Axis], updater: Updater, sampler: BatchSampler,
                 global_tokens: int, max_norm: float, autocast):
        self.sampler = sampler
        self.pp_axis = axes["pp"]
        self.loss_scale = 1.0 / global_tokens
        self.asynchronous = plan.asynchronous
        plan = replica_plan(plan, axes["dp"].rank)  # dp_batch_shares: this replica's count
        if plan.asynchronous:  # the stage's optimizer steps inside the schedule
            self.pipe = PipeDream2BWEngine(stage, self.pp_axis, plan.micro_batches,
                                           cfg.train.steps, updater.optimizer,
                                           sampler.rank_batch, self.loss_scale, max_norm,
                                           axes["dp"], autocast,
                                           predict=plan.weight_prediction)
            updater.versions = self.pipe  # its checkpoints hold the older weight version
        else:  # the data-parallel engine is the executor's gradient sync
            train, evaluation = plan.pipeline_schedules(cfg.model.tied_embeddings)
            self.pipe = PipelineEngine(stage, train, self.pp_axis, evaluation,
                                       grad_sync=updater.engine, autocast=autocast)

    def passes(self, step: int, lr: float, loss_factor: float = 1.0) -> torch.Tensor:
        """The passes of `step`: a synchronous schedule's (`forward_backward`, each loss
        also multiplied by `loss_factor`, fp16's loss scale) or PipeDream-2BW's, which
        update the stage too (`asynchronous_step`)."""
        if self.asynchronous:
            return self.asynchronous_step(step, lr)
        return self.forward_backward(step, loss_factor)

    def forward_backward(self, step: int, loss_factor: float = 1.0) -> torch.Tensor:
        """A synchronous schedule's passes of `step`: the summed token cross-entropy of this
        dp rank's share, with the gradients reduced by the engine and not yet applied."""
        inputs, targets = self.sampler.rank_batch(step)
        scale = self.loss_scale if loss_factor == 1.0 else self.loss_scale * loss_factor
        return self.pipe.train_step(inputs, targets, scale)

    def asynchronous_step(self, step: int, lr: float) -> torch.Tensor:
        """PipeDream-2BW's step, each stage updated by itself: the summed cross-entropy."""
        return self.pipe.train_step(step, lr)

    def eval_sum(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of a validation batch (forwards only)."""
        return self.pipe.eval_step(inputs_BT, targets_BT)
