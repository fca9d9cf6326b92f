"""PipeDream-2BW: asynchronous 1F1B with double-buffered weights (Narayanan et al., arXiv
2006.09503, Sec. 3).

The pipeline never flushes (fivefold.parallel.pipeline.schedules.pipedream_2bw_schedule):
after one warm-up, every rank alternates forward and backward across step boundaries and
applies step t's update as soon as its own last backward of step t is done. Micro-batches
of step t all compute with weight version t-1, so that a micro-batch's forward and backward
see the same weights (PipeDream's weight stashing) and every stage of one micro-batch the
same version; the update is the paper's

    W(t+1) = W(t) - lr * grad f(W(t-1)),          (Sec. 3.1; W(-1) = W(0))

one step of gradient staleness. Only two versions are ever alive (the "2" in 2BW): the one
step t computes with (t-1) and the newest (t), which step t+1 will use; at UPDATE t version t-1
is dead, and its buffer receives W(t+1) = the optimizer's step applied to a copy of W(t). The
optimizer's parameters point at the newest buffer, so its state (Adam moments) carries on.

Weight prediction (`parallel.weight_prediction`, off by default). With AdamW the plain rule
costs the default 200-step run of the default model about 12% in validation loss
(docs/pipeline.md); one step of staleness is known to hurt AdamW and to spare Muon (Zmushko
et al., arXiv 2606.30634), which loses 0.6% here (`train.optimizer = "muon"`).
Linear weight prediction (Kosson et al., arXiv 2003.11666; SpecTrain, arXiv 1809.02839, predicts
the same way from the momentum) offsets part of it without touching the schedule or adding
messages: version t is extrapolated one update ahead, V(t) = W(t) + (W(t) - W(t-1)) ~ W(t+1),
so step t+1's gradient is taken near W(t+1), the weights it is applied to. The parameters
then hold the optimizer's master weights and both versions are separate buffers: one more
copy of the stage's weights. Tests check the predicted rule exactly against a
single-process implementation of it.

Each micro-batch runs the stage through `torch.func.functional_call` on leaf copies of its
version's tensors, so gradients of step t accumulate on step t's leaves and never touch the
buffers other micro-batches compute with. With tied embeddings the first rank sends each new
version of the matrix to the last stage, which returns its gradient share of each step; the
last stage sends each step's loss to the first rank. Nothing waits for all ranks during
training, so gradient clipping is per stage (each stage's own norm, after the data-parallel
all-reduce): a global norm would need the synchronization 2BW removes. The math differs from
synchronous training on purpose: tests/test_pipeline_parity.py checks the update rule above
exactly against a single-process implementation of it; how far the staleness moves the loss
is measured there too (slow) and tabled in docs/pipeline.md.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.func import functional_call

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.parallel.grad_clip import clip_grad_norm_
from fivefold.parallel.grad_reduce import all_reduce_grads
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.p2p_plan import Exchange, Step
from fivefold.parallel.pipeline.schedules import (RECV_LOSS, RECV_TIED_GRAD,
                                                  RECV_TIED_WEIGHT, SEND_LOSS, SEND_TIED_GRAD,
                                                  SEND_TIED_WEIGHT, UPDATE, Action, Schedule,
                                                  build_schedule, pipedream_2bw_schedule)
from fivefold.parallel.pipeline.stage import PipelineStage

Batch = tuple[torch.Tensor, torch.Tensor]


class PipeDream2BWEngine(PipelineEngine):
    """Runs rank `pp_axis.rank`'s share of a `steps`-step 2BW run, one step per `train_step`."""

    def __init__(self, stage: PipelineStage, pp_axis: Axis, micro_batches: int, steps: int,
                 optimizer: torch.optim.Optimizer, batch_fn: Callable[[int], Batch],
                 loss_scale: float, max_norm: float = math.inf, dp_axis: Axis | None = None,
                 autocast=None, record_timeline: bool = False, predict: bool = False):
        tied = stage.cfg.tied_embeddings
        schedule = pipedream_2bw_schedule(pp_axis.size, micro_batches, steps, tied)
        evaluation = build_schedule("gpipe", pp_axis.size, micro_batches, tied_embeddings=tied,
                                    forward_only=True)
        super().__init__(stage, schedule, pp_axis, None, None, autocast, record_timeline)
        self.evaluator = PipelineEngine(stage, evaluation, pp_axis, evaluation,
                                        autocast=autocast, tag_space=1)
        self.segments = self._split_by_update(self._plan(schedule), 0)
        self.m, self.steps, self.optimizer = micro_batches, steps, optimizer
        self.batch_fn = batch_fn
        self.loss_scale, self.max_norm, self.dp_axis = loss_scale, max_norm, dp_axis
        self.params = dict(stage.named_parameters())
        self.predict = predict  # the versions are predictions, the parameters the masters
        self.versions = {0: {n: q.data.clone() if predict else q.data
                             for n, q in self.params.items()}}
        self.tied_versions = ({0: stage.tied_head_weight.detach().clone()}
                              if stage.borrows_embedding else {})
        self.loaded: tuple[dict, dict] | None = None  # a checkpoint's versions (resume_at)
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.batches: dict[int, Batch] = {}
        self.loss_sums: dict[int, torch.Tensor] = {}
        self.head_grads: dict[int, torch.Tensor] = {}
        self.step_loss: dict[int, torch.Tensor] = {}
        self.state, self.kv = {}, None
        self.device = next(stage.parameters()).device
        self.act_dtype = next(stage.parameters()).dtype

    @staticmethod
    def _split_by_update(plan: tuple[Step | Exchange, ...],
                         first_step: int) -> dict[int, list[Step | Exchange]]:
        """Step t's segment of the issue plan: the items after UPDATE t-1 up to UPDATE t;
        the rest go last. A receive issued in one segment may be taken in the next."""
        segments, current = [], []
        for item in plan:
            current.append(item)
            if isinstance(item, Step) and item.action.kind == UPDATE:
                segments.append(current)
                current = []
        segments[-1] += current
        return dict(enumerate(segments, first_step))

    # ------------------------------------------------------------------ public API

    def train_step(self, step: int, lr: float) -> torch.Tensor:
        """Run this rank's actions up to its UPDATE of `step` (with learning rate `lr`).
        Returns step `step`'s summed token cross-entropy on the first and last pp ranks
        (NaN on the others, which never see it)."""
        self.stage.train()
        self.lr = lr
        inputs, _ = self._batch(step)
        self.mb_rows, self.bounds = inputs.shape[0] // self.m, [(0, inputs.shape[1])]
        self._run_items(self.segments[step], self.schedule, (), set())  # timeline: whole run
        self.sends = [work for work in self.sends if not work.is_completed()]
        if step == self.steps - 1:
            for work in self.sends:
                C.wait(work)
            self.sends.clear()
        if step in self.loss_sums:  # the last stage
            return self.loss_sums.pop(step)
        return self.step_loss.pop(step, torch.tensor(math.nan))

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The weight versions a checkpoint holds besides the stage's parameters (the
        optimizer's masters): "older", which the next step computes with, and, with
        prediction, "newer", the one after it (without prediction that is the parameters
        themselves). Saved after an UPDATE; before the first step these are fresh buffers
        for a checkpoint to load into, and `resume_at` puts them in place."""
        if len(self.versions) == 2:
            older, newer = (self.versions[v] for v in sorted(self.versions))
        else:
            older = {n: torch.empty_like(t) for n, t in self.params.items()}
            newer = {n: torch.empty_like(t) for n, t in self.params.items()}
            self.loaded = older, newer
        state = {f"older.{n}": t for n, t in older.items()}
        if self.predict:
            state.update({f"newer.{n}": t for n, t in newer.items()})
        return state

    def resume_at(self, step: int) -> None:
        """Continue a run from the checkpoint written after UPDATE step-1 (loaded into the
        buffers of `checkpoint_state` and, by the caller, into the parameters and the
        optimizer): the lists restart at `step` with a fresh warm-up, which recomputes the
        forwards that were in flight with the same version, so the run goes on exactly as
        the uninterrupted one. The last stage's copies of the tied matrix are sent again."""
        older, newer = self.loaded
        if not self.predict:
            newer = {n: q.data for n, q in self.params.items()}
        tied = self.stage.cfg.tied_embeddings
        schedule = pipedream_2bw_schedule(self.axis.size, self.m, self.steps, tied, step)
        self.schedule = schedule
        self.segments = self._split_by_update(self._plan(schedule), step)
        self.versions = {step - 1: older, step: newer}
        self.tied_versions.clear()

    def eval_step(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Validation with the newest weights (forwards only; in-flight training untouched)."""
        return self.evaluator.eval_step(inputs_BT, targets_BT)

    # ------------------------------------------------------------------ actions

    def _do(self, a: Action, schedule: Schedule) -> None:
        if a.kind == UPDATE:
            self._update(a.mb)
        else:
            super()._do(a, schedule)

    def _outgoing(self, a: Action) -> torch.Tensor:
        """What a send carries; copies, since the buffers are reused while the send is out."""
        if a.kind == SEND_LOSS:
            return self.loss_sums[a.mb].reshape(1).clone()
        if a.kind == SEND_TIED_GRAD:
            return self.leaves[a.mb]["tied_head_weight"].grad
        if a.kind == SEND_TIED_WEIGHT:
            return self.versions[a.mb]["tok_embeddings.weight"].clone()
        return super()._outgoing(a)

    def _buffer(self, a: Action) -> torch.Tensor:
        if a.kind == RECV_LOSS:
            return torch.empty(1, dtype=torch.float32, device=self.device)
        return super()._buffer(a)  # activations, gradients and the tied matrix

    def _deliver(self, a: Action, buf: torch.Tensor) -> None:
        if a.kind == RECV_LOSS:
            self.step_loss[a.mb] = buf[0]
        elif a.kind == RECV_TIED_GRAD:
            self.head_grads[a.mb] = buf
        elif a.kind == RECV_TIED_WEIGHT:
            self.tied_versions[a.mb] = buf
            self.tied_versions.pop(a.mb - 2, None)
        else:
            super()._deliver(a, buf)

    def _batch(self, step: int) -> Batch:
        if step not in self.batches:
            self.batches[step] = self.batch_fn(step)
        return self.batches[step]

    def _step_leaves(self, step: int) -> dict[str, torch.Tensor]:
        """Leaf copies of the weights step `step` computes with: version max(step - 1, 0)."""
        if step not in self.leaves:
            version = max(step - 1, 0)
            leaves = {n: t.detach().requires_grad_() for n, t in self.versions[version].items()}
            if self.stage.borrows_embedding:
                leaves["tied_head_weight"] = self.tied_versions[version].detach().requires_grad_()
            self.leaves[step] = leaves
        return self.leaves[step]

    def _forward(self, a: Action) -> None:
        step, j = divmod(a.mb, self.m)
        key = (a.stage, a.mb, a.slice)
        st = self.state.setdefault(key, {})
        inputs, targets = self._batch(step)
        rows = slice(j * (inputs.shape[0] // self.m), (j + 1) * (inputs.shape[0] // self.m))
        x = inputs[rows].to(self.device) if a.stage == 0 else st["input"]
        y = targets[rows].to(self.device) if a.stage == self.last_stage else None
        with self.autocast():
            out = functional_call(self.stage, self._step_leaves(step), (a.stage, x, y))
        if a.stage == self.last_stage:
            total = self.loss_sums.setdefault(step, torch.zeros((), device=self.device))
            total += out.detach()
            out = out * self.loss_scale
        st["output"] = out

    @torch.no_grad()
    def _update(self, step: int) -> None:
        """UPDATE step: W(step+1) = W(step) - lr * (step's gradient, taken at version step-1),
        and version step+1, which step+2 computes with, in the dead version step-1's buffer:
        W(step+1) itself, or with `predict` W(step+1) + (W(step+1) - W(step))."""
        leaves = self.leaves.pop(step)
        grads = {n: leaves[n].grad for n in self.params}
        if step in self.head_grads:  # the last stage's share of the tied matrix
            grads["tok_embeddings.weight"] += self.head_grads.pop(step)
        if self.dp_axis is not None and self.dp_axis.size > 1:
            all_reduce_grads(list(grads.values()), self.dp_axis)
        clip_grad_norm_(list(grads.values()), self.max_norm, [])
        newest = self.versions[step]
        spare = (self.versions.pop(step - 1) if step >= 1 else
                 {n: torch.empty_like(t) for n, t in newest.items()})
        for name, param in self.params.items():
            if self.predict:
                spare[name].copy_(param.data)  # W(step), kept for the prediction below
            else:  # the optimizer's parameters move to the new version's buffer
                spare[name].copy_(newest[name])
                param.data = spare[name]
            param.grad = grads[name]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.predict:
            for name, param in self.params.items():
                spare[name].neg_().add_(param.data, alpha=2)
        self.versions[step + 1] = spare
        self.batches.pop(step, None)
