"""One executor for every synchronous pipeline schedule: it runs this rank's action list.

`PipelineEngine(stage, schedule, pp_axis)` walks `schedule.ranks[pp_axis.rank]` in order
(fivefold.parallel.pipeline.schedules): F runs a virtual stage on a micro-batch (the last
stage ends in the summed token cross-entropy, scaled by the caller's `loss_scale`, so the
accumulated gradient is the global-batch mean exactly as in the single-process trainer); B
runs its backward; I and W split that backward for zero-bubble schedules; the send and
receive actions move activations ("pp_activations"), input gradients ("pp_grads") and the
tied embedding ("pp_tied_weight", "pp_tied_grads") over the "pp" mesh axis through
fivefold.comm.collectives, so the ledger sees every byte. The sends and receives are issued
in batched groups (batch_isend_irecv, on every backend) at the points of the rank's issue
plan (fivefold.parallel.pipeline.p2p_plan), which NCCL's in-order pairing cannot deadlock; a
receive may be issued early, and is waited for right before the action that reads it, where
the list puts it. Sends are waited at the end of the step. TeraPipe's slices
attend to the cached keys and values of earlier slices (fivefold.parallel.pipeline.terapipe).

Zero-bubble split (ZB, arXiv 2401.10241, Sec. 2): I computes the input gradient and W the
weight gradients it skipped (fivefold.parallel.pipeline.split_backward says how, and which
weights I computes itself).

Data parallelism composes through `grad_sync`, an object with `prepare_backward(last)` and
`after_backward()` (fivefold.parallel.data_parallel.DataParallelEngine): `prepare_backward`
runs before every action that accumulates weight gradients (B or W, and I on a stage with
eager weights), with `last` on the last action of each virtual stage to touch each of its
weights (the later of its last B and last W, and of its last B and last I), and
`after_backward` once at the end of the step, so the engine's per-unit hooks reduce each
block's gradient once, when it is complete (ZeRO-0/1 count a unit's parameters over the
passes flagged `last`, fivefold.parallel.grad_sync). It also has
`hold_root()`, called before a step's (or an evaluation's) first action, and `release_root()`,
after an evaluation: under ZeRO-3 the stage's root unit (embedding, final norm, head) is
gathered once and kept through the step, since the tied-weight send reads it before any
forward (the engine's `after_backward` frees it after training).
"""

from __future__ import annotations

import contextlib
import time

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.parallel.pipeline.p2p_plan import Exchange, Step, issue_plan
from fivefold.parallel.pipeline.partition import slice_bounds
from fivefold.parallel.pipeline.replay import Event
from fivefold.parallel.pipeline.schedules import (B, F, GRADIENT_KINDS, I, RECV_ACT, RECV_GRAD,
                                                  RECV_TIED_GRAD, RECV_TIED_WEIGHT, SEND_ACT,
                                                  SEND_GRAD, SEND_TIED_GRAD, SEND_TIED_WEIGHT,
                                                  SENDS, W, Action, Schedule, message,
                                                  peer_stage)
from fivefold.parallel.pipeline.split_backward import (backward_input, backward_weight,
                                                       capture_weight_ops, eager_weights,
                                                       last_gradient_steps)
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.pipeline.terapipe import TokenSliceCache

MESSAGE_KINDS = ("act", "grad", "tied_weight", "tied_grad", "loss")
PURPOSES = {"act": "pp_activations", "grad": "pp_grads", "tied_weight": "pp_tied_weight",
            "tied_grad": "pp_tied_grads", "loss": "loss"}


def message_tag(key: tuple, space: int = 0) -> int:
    """A tag unique among the messages in flight: kind, sender stage, micro-batch, slice, and
    a space bit that keeps an evaluation pass apart from training messages still in flight."""
    kind, stage, mb, slc = key
    return MESSAGE_KINDS.index(kind) + 8 * (slc % 64 + 64 * (mb % 4096 + 4096 * (
        stage % 256 + 256 * space)))


class PipelineEngine:
    """Runs one rank's action lists: `train_step` for a step, `eval_step` for validation."""

    def __init__(self, stage: PipelineStage, schedule: Schedule, pp_axis: Axis,
                 eval_schedule: Schedule | None = None, grad_sync=None, autocast=None,
                 record_timeline: bool = False, tag_space: int = 0):
        if pp_axis.size != schedule.pp:
            raise ValueError(f"schedule for pp={schedule.pp} on a pp axis of {pp_axis.size}")
        self.stage, self.schedule, self.axis = stage, schedule, pp_axis
        self.eval_schedule = eval_schedule
        self.rank = pp_axis.rank
        self.grad_sync = grad_sync
        self.autocast = autocast or contextlib.nullcontext
        self.record_timeline = record_timeline
        self.timeline: list[Event] = []
        self.tag_space = tag_space
        self.sends: list = []  # handles of issued sends, waited at the end of the step
        self.pending: dict[tuple, tuple] = {}  # message: (buffer, handles) until taken
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.plans: dict[int, tuple] = {}
        self.last_stage = schedule.stages - 1
        split = any(a.kind == I for a in schedule.ranks[self.rank])
        self.eager = eager_weights(stage) if split else []
        if (split and stage.has_first and stage.has_last and stage.cfg.tied_embeddings
                and not stage.borrows_embedding):
            raise ValueError("a zero-bubble W pass computes one module's weight gradient; a "
                             "head tied to the embedding on the same rank (pp = 1) is two "
                             "uses of one matrix: use pp >= 2 or untied embeddings")

    # ------------------------------------------------------------------ public API

    def train_step(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor,
                   loss_scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; gradients
        accumulate in the stage's `.grad` (or the data-parallel engine's buffers). Returns the
        step's summed token cross-entropy, the same on every pp rank."""
        self.stage.train()
        if self.grad_sync is not None:
            self.grad_sync.hold_root()
        loss = self._run(self.schedule, inputs_BT, targets_BT, loss_scale)
        if self.grad_sync is not None:
            self.grad_sync.after_backward()
        return loss

    @torch.no_grad()
    def eval_step(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """The summed token cross-entropy of a batch (forwards only), on every pp rank."""
        if self.eval_schedule is None:
            raise ValueError("this engine was built without an evaluation schedule")
        self.stage.eval()
        if self.grad_sync is None:
            return self._run(self.eval_schedule, inputs_BT, targets_BT, 1.0)
        self.grad_sync.hold_root()
        try:
            return self._run(self.eval_schedule, inputs_BT, targets_BT, 1.0)
        finally:
            self.grad_sync.release_root()

    # ------------------------------------------------------------------ the loop

    def _run(self, schedule: Schedule, inputs_BT: torch.Tensor, targets_BT: torch.Tensor,
             loss_scale: float) -> torch.Tensor:
        m, rows = schedule.micro_batches, inputs_BT.shape[0]
        if rows % m:
            raise ValueError(f"{rows} sequences do not split into {m} micro-batches")
        self.mb_rows = rows // m
        self.inputs, self.targets, self.loss_scale = inputs_BT, targets_BT, loss_scale
        self.bounds = slice_bounds(inputs_BT.shape[1], schedule.slices)
        self.kv = TokenSliceCache() if schedule.slices > 1 else None
        self.act_dtype = next(self.stage.parameters()).dtype
        self.device = next(self.stage.parameters()).device
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.state: dict[tuple, dict] = {}
        plan = self._plan(schedule)
        self.split_backward = any(a.kind == I for a in schedule.ranks[self.rank])
        self.timeline = []
        kinds = GRADIENT_KINDS + ((I,) if self.eager else ())
        self._run_items(plan, schedule, kinds, last_gradient_steps(plan))
        for work in self.sends:
            C.wait(work)
        self.sends.clear()
        if self.stage.borrows_embedding:
            self.stage.tied_head_weight.grad = None
        C.all_reduce(self.loss_sum, self.axis, "loss")
        return self.loss_sum

    def _plan(self, schedule: Schedule) -> tuple[Step | Exchange, ...]:
        """This rank's issue plan (fivefold.parallel.pipeline.p2p_plan), built once."""
        if id(schedule) not in self.plans:
            self.plans[id(schedule)] = (schedule, issue_plan(schedule)[self.rank])
        return self.plans[id(schedule)][1]

    def _run_items(self, items, schedule: Schedule, kinds: tuple[str, ...],
                   last_grad: set[Step]) -> None:
        """Run plan items in order: an Exchange is issued, a Step first waits for the
        messages it reads, then runs."""
        for item in items:
            start = time.perf_counter()
            if isinstance(item, Exchange):
                self._exchange(item.actions, schedule)
                continue
            for a in item.needs:
                self._take(a, schedule)
                if self.record_timeline:  # the wait, on the system-wide monotonic clock
                    self.timeline.append(Event(self.rank, a, start, time.perf_counter()))
                    start = time.perf_counter()
            a = item.action
            if a.kind in kinds and self.grad_sync is not None:
                self.grad_sync.prepare_backward(last=item in last_grad)
            self._do(a, schedule)
            if self.record_timeline:
                self.timeline.append(Event(self.rank, a, start, time.perf_counter()))

    def _do(self, a: Action, schedule: Schedule) -> None:
        if a.kind == F:
            self._forward(a)
        elif a.kind == B:
            self._backward(a)
        elif a.kind == I:
            self._backward_input(a)
        elif a.kind == W:
            self._backward_weight(a)
        else:
            raise ValueError(f"the synchronous executor cannot run {a}")

    # ------------------------------------------------------------------ compute

    def _micro_batch(self, tensor: torch.Tensor, a: Action) -> torch.Tensor:
        lo, hi = self.bounds[a.slice]
        rows = slice(a.mb * self.mb_rows, (a.mb + 1) * self.mb_rows)
        return tensor[rows, lo:hi].to(self.device)

    def _forward(self, a: Action) -> None:
        key = (a.stage, a.mb, a.slice)
        st = self.state.setdefault(key, {})
        x = self._micro_batch(self.inputs, a) if a.stage == 0 else st["input"]
        targets = self._micro_batch(self.targets, a) if a.stage == self.last_stage else None
        block_fn = self.kv.block_fn(key) if self.kv is not None else None
        split = self.split_backward and torch.is_grad_enabled()
        capture = (capture_weight_ops(self.stage, self.eager) if split else
                   contextlib.nullcontext())
        with capture as ops, self.autocast():
            out = self.stage(a.stage, x, targets, self.bounds[a.slice][0], block_fn)
        if a.stage == self.last_stage:
            self.loss_sum += out.detach()
            out = out * self.loss_scale
        st["output"] = out
        if ops is not None:
            st["ops"] = ops
        if not torch.is_grad_enabled():  # evaluation: nothing will come back
            st.pop("input", None)
            if a.stage == self.last_stage:
                self.state.pop(key)

    def _tied_leaf(self, stage: int) -> list[torch.Tensor]:
        """The borrowed head matrix, whose gradient goes back to its owner (never deferred)."""
        return [self.stage.tied_head_weight] if (stage == self.last_stage and
                                                 self.stage.borrows_embedding) else []

    def _backward(self, a: Action) -> None:
        key = (a.stage, a.mb, a.slice)
        st = self.state.pop(key)
        outs, grads = [st["output"]], [st.get("output_grad")]
        if self.kv is not None:
            extra_outs, extra_grads = self.kv.backward_extras(key)
            outs, grads = outs + extra_outs, grads + extra_grads
        torch.autograd.backward(outs, grads)
        if self.kv is not None:
            self.kv.after_backward(key)
        if a.stage > 0:
            self.state[key] = {"input_grad": st["input"].grad}

    def _backward_input(self, a: Action) -> None:
        st = self.state[(a.stage, a.mb, a.slice)]
        backward_input(st, self._tied_leaf(a.stage), self.eager, self.stage)

    def _backward_weight(self, a: Action) -> None:
        backward_weight(self.state.pop((a.stage, a.mb, a.slice)))

    # ------------------------------------------------------------------ communication

    def _shape(self, a: Action) -> tuple[int, ...]:
        """An activation message: (rows, tokens, width), tokens split over sequence shards."""
        lo, hi = self.bounds[a.slice]
        return (self.mb_rows, (hi - lo) // self.stage.sequence_shards, self.stage.cfg.hidden)

    def _tied_shape(self) -> tuple[int, ...]:
        stage = self.stage
        return tuple((stage.tied_head_weight if stage.borrows_embedding else
                      stage.tok_embeddings.weight).shape)

    def _peer(self, a: Action, schedule: Schedule) -> int:
        return schedule.rank_of(peer_stage(a, schedule.stages))

    def _exchange(self, actions: tuple[Action, ...], schedule: Schedule) -> None:
        """Issue a plan Exchange as one batch: sends with their data, receives into fresh
        buffers that `_take` waits for and hands over right before the action that reads
        them. A message to this very rank goes through the mailbox."""
        ops, recvs = [], []
        for a in actions:
            msg, peer = message(a, schedule.stages), self._peer(a, schedule)
            is_send = a.kind in SENDS
            if peer == self.rank:
                if is_send:
                    self.mailbox[msg] = self._outgoing(a).clone()
                else:
                    self.pending[msg] = (None, [])
                continue
            tensor = self._outgoing(a).contiguous() if is_send else self._buffer(a)
            ops.append((is_send, tensor, peer, PURPOSES[msg[0]],
                        message_tag(msg, self.tag_space)))
            if not is_send:
                recvs.append((msg, tensor))
        works = C.batch_send_recv(ops, self.axis)
        if len(works) == len(ops):  # one handle per op: wait for exactly the receive
            self.sends += [w for w, (is_send, *_) in zip(works, ops) if is_send]
            recv_works = [[w] for w, (is_send, *_) in zip(works, ops) if not is_send]
        else:  # one handle for the group (NCCL): its wait orders the stream after all of it
            self.sends += works
            recv_works = [list(works) for _ in recvs]
        for (msg, buf), handles in zip(recvs, recv_works):
            self.pending[msg] = (buf, handles)

    def _take(self, a: Action, schedule: Schedule) -> None:
        """Wait for a received message and hand it to the step that reads it."""
        msg = message(a, schedule.stages)
        buf, handles = self.pending.pop(msg)
        for work in handles:
            C.wait(work)
        self._deliver(a, self.mailbox.pop(msg) if buf is None else buf)

    def _outgoing(self, a: Action) -> torch.Tensor:
        """What a send carries (the unit's state it no longer needs is dropped)."""
        key = (a.stage, a.mb, a.slice)
        if a.kind == SEND_ACT:
            tensor = self.state[key]["output"].detach()
            if not torch.is_grad_enabled():
                self.state.pop(key)
            return tensor
        if a.kind == SEND_GRAD:
            st = self.state[key]
            tensor = st.pop("input_grad")
            if not st:  # a full backward's unit is done; a split one waits for its W
                self.state.pop(key)
            return tensor
        if a.kind == SEND_TIED_WEIGHT:
            return self.stage.tok_embeddings.weight.detach()
        if a.kind == SEND_TIED_GRAD:
            return self.stage.tied_head_weight.grad
        raise ValueError(f"the synchronous executor cannot send {a}")

    def _buffer(self, a: Action) -> torch.Tensor:
        """An empty buffer for what a receive brings."""
        if a.kind in (RECV_ACT, RECV_GRAD):
            return torch.empty(self._shape(a), dtype=self.act_dtype, device=self.device)
        if a.kind in (RECV_TIED_WEIGHT, RECV_TIED_GRAD):  # (tp: the vocabulary shard of) it
            return torch.empty(self._tied_shape(), dtype=self.act_dtype, device=self.device)
        raise ValueError(f"the synchronous executor cannot receive {a}")

    def _deliver(self, a: Action, buf: torch.Tensor) -> None:
        key = (a.stage, a.mb, a.slice)
        if a.kind == RECV_ACT:
            self.state.setdefault(key, {})["input"] = buf.requires_grad_(torch.is_grad_enabled())
        elif a.kind == RECV_GRAD:
            self.state.setdefault(key, {})["output_grad"] = buf
        elif a.kind == RECV_TIED_WEIGHT:
            with torch.no_grad():
                self.stage.tied_head_weight.copy_(buf)
            self.stage.tied_head_weight.grad = None
            self.stage.tied_head_weight.requires_grad_(torch.is_grad_enabled())
        else:
            weight = self.stage.tok_embeddings.weight
            if weight.grad is None:
                weight.grad = buf
            else:
                weight.grad.add_(buf)
