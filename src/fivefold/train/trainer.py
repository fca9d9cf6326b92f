"""The training loop: one optimizer step at a time, resumable at any checkpoint.

A step draws the global batch of that step (fivefold.train.data), runs this rank's share as
micro-batches with gradient accumulation, clips the global gradient norm, steps the optimizer
and logs. The loss of a micro-batch is its summed token cross-entropy divided by the tokens
of the whole global batch, so the accumulated gradient, and the logged `loss`, are the mean
over every token of the global batch whatever the layout (1 rank, N ranks, any micro-batch).

Who owns gradients, optimizer state and the step is the updater of the plan's update rule
(`plan.update`, fivefold.train.updaters), chosen once: torch's optimizer on one plain rank
(the reference every parallel layout is compared with), the data-parallel engine (DDP,
ZeRO-1/2/3, hierarchical sharding, ZeRO++, expert units, offload; its collectives sum, so
every rank scales its loss by the global token count only), data-parallel GaLore, LOMO, or
PipeDream-2BW's stages. The step is the same loop for all of them: each micro-batch's passes
between the updater's `prepare_backward`, `backward` and `after_backward`, the loss summed
over the token axes, then the updater's `update`, which clips the global norm, asks the
non-finite guard and steps; fp16's dynamic loss scale (fivefold.train.loss_scale) is the
updater's too. The step's collectives and model-state bytes land in the ledger (summarized in
each metrics record) and the flight recorder (fivefold.comm.flight_recorder), which a failed
collective writes to RUN_DIR/flight_recorder.

With `parallel.tp > 1` the model is split over the mesh's innermost "tp" axis
(fivefold.parallel.tensor): the ranks of one tp group draw the same batch (the sampler takes
the data-parallel rank) and the loss is the vocabulary-parallel cross-entropy. With
`parallel.cp > 1` the samplers hand each rank its tokens of every sequence
(`rank_token_positions`, fivefold.parallel.parallelize). With `parallel.pp > 1` the rank holds
one pipeline stage and a step and a validation batch are one run of the schedule's action
lists (fivefold.train.pipeline_step). Checkpoint keys carry the pp and tp ranks; a checkpoint
written under another layout is resharded on resume (fivefold.train.reshard); a resumed
PipeDream-2BW run restarts its schedule at the checkpoint's step and continues exactly as the
uninterrupted run. The closing text sample is skipped with pp > 1.

A step whose loss or gradient norm is not finite is skipped (counted in `skipped_steps`) or
stops the run (`train.on_nonfinite`, train.nonfinite; `_keep_update` decides once per step).

On the experts' grid (ep, etp or tp > 1 with an MoE model; fivefold.expert_grid) each MoE
layer keeps its share of the experts and the engine reduces their units over the
expert-data ranks; the gradient norm sums over every rank of the stage (`grid_counted_masks`).

Checkpoints are saved every `train.checkpoint_every` steps, at the end and, with
`train.checkpoint_minutes`, when rank 0's clock says so (fivefold.train.save_schedule), and
when SIGINT or SIGTERM reached any rank (fivefold.train.interrupt: every rank stops there). A
run whose rank dies restarts from the latest complete one, by hand or under `fivefold train
--max-restarts N` by the elastic agent; the data position is the step, so the restarted run
draws exactly the batches the lost steps drew (a resume with other data keys is refused,
fivefold.train.resume_data).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fivefold.batch_shares import replica_batch
from fivefold.comm import collectives as C
from fivefold.comm.choice import CommAlgorithms
from fivefold.comm.collectives import Axis
from fivefold.comm.ledger import Ledger
from fivefold.config import Config, ConfigError
from fivefold.lr_schedule import lr_at
from fivefold.models.flops import flops_per_token, param_count
from fivefold.models.llama import Transformer, build_model
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.plan import (ParallelPlan, compute_precision, device_precision,
                                    plan_from_config)
from fivefold.parallel.parallelize import parallelize, rank_token_positions
from fivefold.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy
from fivefold.train.checkpoint import layout_record, save_checkpoint, shard_tag, step_dir
from fivefold.train.data import BatchSampler, TokenData, prepare_data, write_run_tokenizer
from fivefold.train.dist import Runtime
from fivefold.train.interrupt import StopSignals, interrupted
from fivefold.train.loss import chunk_tokens, linear_cross_entropy_sum
from fivefold.train.memory_report import MemoryProbe
from fivefold.train.metrics import MetricsLog, peak_memory_bytes
from fivefold.train.mfu import mfu_note, mfu_peak
from fivefold.train.model_source import describe_source, load_weights_into
from fivefold.train.moe_stats import moe_layers, moe_step
from fivefold.train.nonfinite import keep_step
from fivefold.train.pipeline_step import PipelineStep, build_stage
from fivefold.train.resume import resume_run
from fivefold.train.resume_data import DataOrder, data_record
from fivefold.train.run_end import finish_run
from fivefold.train.run_header import balance_note, pipeline_note, start_line
from fivefold.train.save_schedule import SaveSchedule
from fivefold.train.updaters.base import Updater
from fivefold.train.updaters.choose import build_updater
from fivefold.train.updaters.engine import DTYPES


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_time_s: float
    moe: dict | None = None  # per MoE layer: load statistics (fivefold.train.moe_stats)


class Trainer:
    """Trains `cfg` under `plan`: `cfg` supplies the model, data and optimizer, `plan` the
    layout. `fivefold train` passes the plan `training_plan` validated before any rank
    started; without one the plan of `cfg` on the runtime's ranks is taken as it stands (a
    caller building a Trainer directly, as the tests and benchmarks do, owns its config)."""

    def __init__(self, cfg: Config, rt: Runtime, run_dir: Path, data: TokenData | None = None,
                 init_from: Path | str | None = None, plan: ParallelPlan | None = None,
                 predicted_memory: dict | None = None, stop: StopSignals | None = None):
        self.cfg, self.rt, self.run_dir = cfg, rt, Path(run_dir)
        self.stop = stop or StopSignals()  # `fivefold train` installs its handlers
        self.memory, self.predicted_memory = MemoryProbe(), predicted_memory
        self.plan = plan = plan or plan_from_config(cfg, rt.world_size,
                                                    device_precision(rt.device.type))
        if plan.gpus != rt.world_size:
            raise ConfigError("parallel", f"the plan lays out {plan.gpus} ranks but "
                                          f"{rt.world_size} were launched; plan for the "
                                          "launched ranks")
        m = cfg.model
        self.ledger = Ledger()
        self.ledger.recorder.directory = self.run_dir / "flight_recorder"
        self.skipped_steps = 0  # updates dropped by the non-finite guard
        self.schedule_steps = cfg.train.steps  # the lr schedule's length; a resume may keep its own
        self.mesh = Mesh(plan.mesh_shape, rt.device.type, self.ledger).use_algorithms(
            CommAlgorithms.from_config(cfg), cfg.cluster.gpus_per_node)  # comm.algorithm
        self.dp_axis = self.mesh.joint_axis("dp_replicate", "dp_shard")
        self.tp_axis = self.mesh.axis("tp")
        self.pp_axis = self.mesh.axis("pp")
        self.token_axis = self.mesh.joint_axis(*plan.token_axes)  # the loss's sum
        self.routing_axis = (self.mesh.joint_axis(*plan.routing_axes)  # MoE load statistics
                             if m.moe and plan.routing_axes != plan.token_axes
                             else self.token_axis)
        self.expert_axes = (self.mesh.expert_axes(plan.ep, plan.etp)  # fivefold.expert_grid
                            if m.moe and plan.expert_grid else None)
        # every rank, the default group: checkpoint_minutes' broadcast, the stop flags
        self.world_axis = Axis("world", None, rt.world_size, rt.rank, self.ledger)
        self.clock = time.monotonic  # train.checkpoint_minutes' clock (rank 0's decides)
        self.dp = plan.dp  # the ranks of one tp group share a batch
        self.per_rank, self.micro_batch = replica_batch(plan, self.dp_axis.rank)  # its share
        self.global_tokens = plan.global_batch * m.seq_len
        self.precision = plan.precision
        # the dtype of everything outside fp8's linears (all of it without fp8)
        self.compute = compute_precision(plan.precision, rt.device.type)
        self.data = data or prepare_data(cfg, log=self.say)
        torch.manual_seed(cfg.train.seed)
        self.model = parallelize(self._build_model(init_from), plan, self.mesh,
                                 cfg.train.compile)
        self.model_name = m.preset if init_from is None else f"from {describe_source(init_from)}"
        if init_from is not None:  # the weights are in: say from where
            self.say(f"loaded {param_count(m) / 1e6:.2f}M parameters {self.model_name}")
        positions = rank_token_positions(plan, self.mesh, m.seq_len)  # cp: this rank's tokens
        self.train_sampler = DataOrder(BatchSampler(self.data.train, m.seq_len,
                                                    plan.global_batch, cfg.train.seed, 0,
                                                    self.dp_axis.rank, self.dp, positions,
                                                    plan.dp_batch_shares))
        self.val_sampler = BatchSampler(self.data.val, m.seq_len, plan.global_batch,
                                        cfg.train.seed, 1, self.dp_axis.rank, self.dp,
                                        positions, plan.dp_batch_shares)
        # who owns gradients, optimizer state and the step (fivefold.train.updaters)
        self.updater: Updater = build_updater(self.model, plan, self.mesh, cfg.train,
                                              rt.device, self.compute, rt.rank, self.memory,
                                              self.expert_axes)
        self.pipeline = None
        if plan.pp > 1:
            axes = {"pp": self.pp_axis, "tp": self.tp_axis, "dp": self.dp_axis}
            self.pipeline = PipelineStep(cfg, plan, self.model, axes, self.updater,
                                         self.train_sampler, self.global_tokens,
                                         cfg.train.grad_clip or math.inf, self.autocast)
        self.peak = mfu_peak(rt.device, cfg.cluster.gpu, self.precision, rt.world_size)
        self.flops_per_token = flops_per_token(m)
        # one GPU rank: the head and loss a chunk of tokens at a time (fivefold.train.loss)
        self.loss_chunk = (chunk_tokens(m.vocab) if rt.device.type == "cuda"
                           and plan.update != "engine" else 0)

    @property
    def engine(self):
        """The data-parallel engine when the plan's update rule is it, else None."""
        return self.updater.engine

    @property
    def optimizer(self):
        """The torch optimizer of the plain model (one rank, a 2BW stage), else None."""
        return self.updater.optimizer

    def _build_model(self, init_from: Path | str | None) -> Transformer | PipelineStage:
        """The plain model, or this rank's pipeline stage, with pretrained weights in
        (before `parallelize` splits anything)."""
        m = self.cfg.model
        if self.plan.pp > 1:
            return build_stage(self.cfg, self.plan, self.pp_axis, self.rt.device, init_from)
        model = build_model(m, self.cfg.train.seed, self.rt.device)
        if init_from is not None:
            load_weights_into(model, m, init_from)
        return model

    def say(self, text: str) -> None:
        if self.rt.is_main:
            print(text, flush=True)

    # ------------------------------------------------------------------ one step

    def autocast(self):
        if self.compute == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=DTYPES[self.compute])

    def micro_batch_loss(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy (fp32) of one micro-batch."""
        with self.autocast():
            if self.loss_chunk:
                return linear_cross_entropy_sum(self.model.hidden_states(tokens_BT),
                                                self.model.output_weight(), targets_BT,
                                                self.loss_chunk, DTYPES[self.compute],
                                                self.cfg.train.compile)
            logits_BTV = self.model(tokens_BT)
        if self.tp_axis.size > 1:  # this rank's vocabulary columns only
            return vocab_parallel_cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(),
                                                self.cfg.model.vocab, self.tp_axis).sum()
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                               reduction="sum")

    def train_step(self, step: int) -> StepResult:
        """One optimizer step: every micro-batch's passes, the loss summed over the token
        axes (before the update, so the non-finite guard reads the global one), then the
        updater's update (fivefold.train.updaters)."""
        start = time.perf_counter()
        self.ledger.start_step(step)
        self.model.train()
        for _, moe in moe_layers(self.model):  # the aux losses scale as the token loss does
            moe.aux_grad_scale = self._loss_factor() / self.global_tokens  # fp16: times S
        lr = lr_at(step, self.cfg.train, self.schedule_steps)
        if self.pipeline:
            loss_sum = self.pipeline.passes(step, lr, self._loss_factor())
        else:
            loss_sum = self._accumulate(*self.train_sampler.rank_batch(step))
        C.all_reduce(loss_sum, self.token_axis, "loss")
        grad_norm = self._update(lr, self.cfg.train.grad_clip or math.inf, step, loss_sum)
        loss = loss_sum.item() / self.global_tokens
        moe = (moe_step(self.model, self.routing_axis, self.cfg.model.moe.bias_update_rate,
                        self.global_tokens) if self.cfg.model.moe else None)
        return StepResult(loss, grad_norm.item(), time.perf_counter() - start, moe)

    def _loss_factor(self) -> float:
        """What each micro-batch's loss is multiplied by before backward: fp16's loss scale."""
        scale = self.updater.loss_scale
        return scale.factor if scale else 1.0

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of each micro-batch in turn; the summed token cross-entropy."""
        n_micro = self.per_rank // self.micro_batch
        loss_sum = torch.zeros((), device=self.rt.device)
        for j in range(n_micro):
            rows = slice(j * self.micro_batch, (j + 1) * self.micro_batch)
            # copies of this micro-batch alone (as a GPU's host-to-device copy is): a CPU
            # view would keep the whole window's storage alive as the embedding's saved ids
            x = inputs[rows].to(self.rt.device, copy=True)
            y = targets[rows].to(self.rt.device, copy=True)
            self.ledger.recorder.micro_batch = j
            last = j == n_micro - 1
            self.updater.prepare_backward(last)
            with self.memory.count_activations(self.model):  # the run's first micro-batch
                ce_sum = self.micro_batch_loss(x, y)
            self.updater.backward(ce_sum / self.global_tokens)
            self.updater.after_backward(last)
            loss_sum += ce_sum.detach()
        return loss_sum

    def _update(self, lr: float, clip: float, step: int, loss_sum: torch.Tensor
                ) -> torch.Tensor:
        """The updater's update: clip the global gradient norm over the plan's axes
        (fivefold.parallel.grad_clip), then step unless the non-finite guard drops the
        update; the norm."""
        return self.updater.update(lr, clip, lambda norm: self._keep_update(step, loss_sum,
                                                                            norm))

    def _keep_update(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """The non-finite guard (fivefold.train.nonfinite), one decision for every update
        path from values all ranks share: False (and counted) when the update is skipped;
        NonFiniteError under "stop". With fp16 loss scaling only the loss is checked: an
        overflowing gradient is the loss scale's to skip (fivefold.train.loss_scale)."""
        keep = keep_step(self.cfg.train.on_nonfinite, step, loss_sum.item(), grad_norm.item(),
                         self.rt.rank, self.updater.first_nonfinite,
                         check_norm=not self.updater.loss_scale)
        if not keep:
            self.skipped_steps += 1
            self.say(f"step {step + 1}: non-finite loss or gradient norm, update skipped "
                     f"({self.skipped_steps} skipped so far)")
        return keep

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over `eval_batches` fixed global batches of the held-out split."""
        self.model.eval()
        total = torch.zeros((), device=self.rt.device, dtype=torch.float64)
        for i in range(self.cfg.train.eval_batches):
            inputs, targets = self.val_sampler.rank_batch(i)
            if self.pipeline:
                total += self.pipeline.eval_sum(inputs, targets).double()
                continue
            for j in range(0, self.per_rank, self.micro_batch):
                x = inputs[j:j + self.micro_batch].to(self.rt.device)
                y = targets[j:j + self.micro_batch].to(self.rt.device)
                total += self.micro_batch_loss(x, y).double()
        C.all_reduce(total, self.token_axis, "val_loss")
        return total.item() / (self.cfg.train.eval_batches * self.global_tokens)

    # ------------------------------------------------------------------ the run

    def _resume(self) -> int:
        """Load RUN_DIR's latest checkpoint, if any (fivefold.train.resume); its step."""
        return resume_run(self)

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """This rank's own torch optimizers, one by one (none under LOMO or the engine)."""
        return self.updater.torch_optimizers()

    def _shard_tag(self) -> str:
        return shard_tag(self.pp_axis.rank, self.pp_axis.size, self.tp_axis.rank,
                         self.tp_axis.size)

    def _checkpoint_state(self) -> dict:
        """What DCP saves and loads in place: the engine's shards, or the plain state dicts
        (PipeDream-2BW: with the stage's older weight version). Keys carry the pp and tp
        ranks where those hold different things under one name: every pipeline stage has a
        "root" unit, tp ranks hold different shards, and each 2BW stage's optimizer has its
        own parameter groups (its parameters and versions keep the whole model's names, so
        the stages' "model" entries together are the whole model's state)."""
        return self.updater.checkpoint_state(self._shard_tag())

    def _save(self, step: int) -> None:
        meta = {"data_position": step - self.train_sampler.start, "config": self.cfg.to_dict(),
                "data": data_record(self.cfg), "data_start": self.train_sampler.start,
                "skipped_steps": self.skipped_steps, "schedule_steps": self.schedule_steps,
                **layout_record(self.plan)}
        scale = self.updater.loss_scale
        extra = {"scaler": scale.state_dict() if scale else None}
        save_checkpoint(self.rt, self.run_dir, step, self._checkpoint_state(), meta, extra,
                        self.cfg.train.keep_checkpoints)

    def run(self) -> dict:
        """Train to `train.steps`, resuming from RUN_DIR's latest checkpoint; return a summary."""
        t = self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rt.is_main:  # for `fivefold convert` and `generate` of the checkpoints
            write_run_tokenizer(self.run_dir, self.cfg, self.data)
        start_step = self._resume()
        if start_step >= t.steps:
            self.say(f"{self.run_dir} is already complete at step {start_step}; "
                     "raise --steps or use a new --run-dir")
            return {"steps": start_step, "complete": True}
        self.say(start_line(self.cfg, self.plan, self.rt.device.type, self.model_name))
        if note := mfu_note(self.peak, self.rt.device):
            self.say(note)
        for note in (pipeline_note(self.plan), balance_note(self.cfg)):
            if note:
                self.say(note)
        if self.plan.asynchronous and t.optimizer == "adamw":
            self.say("note: PipeDream-2BW computes each step's gradient one update late; AdamW "
                     "loses markedly to that on short runs, Muon hardly (train.optimizer=muon;"
                     " docs/pipeline.md, 'Convergence against synchronous training')")
        initial_val = self.evaluate() if start_step == 0 else None
        if initial_val is not None:
            self.say(f"step      0  val_loss {initial_val:.4f}")
        log = MetricsLog(self.run_dir, t.steps, start_step, self.rt.is_main, t.tensorboard,
                         t.log_every)
        run_start, val_loss = time.perf_counter(), None
        saves = SaveSchedule(t, self.world_axis, self.rt.device, self.clock)
        try:
            for step in range(start_step, t.steps):
                result = self.train_step(step)
                done = step + 1
                tokens_per_s = self.global_tokens / result.step_time_s
                record = {"step": done, "loss": result.loss,
                          "lr": lr_at(step, t, self.schedule_steps),
                          "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_s,
                          "mfu": (self.flops_per_token * tokens_per_s / self.peak.flops
                                  if self.peak else None),
                          "mfu_profile": self.peak.profile if self.peak else None,
                          "peak_mem_bytes": peak_memory_bytes(self.rt.device),
                          "skipped_steps": self.skipped_steps,
                          "ledger": self.ledger.summary()}
                if result.moe:
                    record["moe"] = result.moe
                if done % t.eval_every == 0 or done == t.steps:
                    val_loss = record["val_loss"] = self.evaluate()
                log.log(record)
                due = saves.due(done)
                signum = self.stop.agreed(self.world_axis, self.rt.device)  # every rank
                if due or signum:
                    self._save(done)
                if signum and done < t.steps:
                    return interrupted(self.say, step_dir(self.run_dir, done), done,
                                       signum)
        finally:
            log.close()
        return finish_run(self, initial_val, val_loss, time.perf_counter() - run_start)
