"""Each rank's ops for one training step of the `fivefold` runtime, from the config alone.

`rank_trace(cfg, plan, rank)` lists what global rank `rank` runs in one `Trainer.train_step`
(the "Trace" of issue 32: a trace per rank that a pricing and a scheduler consume), in
program order:

  compute     per action of the rank's pipeline schedule (F, B, I, W of
              fivefold.parallel.pipeline.schedules; without a pipeline F then B per
              micro-batch) the blocks' ops of fivefold.planner.op_compute: GEMMs (M, N, K,
              batch, dtype), grouped expert GEMMs, SDPA (B, H, Hkv, T, S, E, causal, kernel)
              and ring attention's math-kernel GEMMs; forward, the backward's input and
              weight gradients (I and W apart under a split backward), and recomputation's
              repeat at the start of a block's backward ("full": the forward up to its last
              GEMM; "selective": what the policy does not cache); the output head on the last stage
  element-wise per block and pass one op with the HBM bytes of its norms, rotary, activation
              and residual adds (`_elementwise_bytes`, an estimate: not compared with the
              runtime, whose eager element-wise kernels differ in number from any fused
              stack); the embedding's lookup and its table's gradient likewise
  messages    the pipeline's sends and receives where the schedule issues them (the
              ledger's records, fivefold.planner.ledger_pipeline, in the action list's order)
  collectives every other record of fivefold.planner.ledger_model.predict_ledger, byte for
              byte: the per-pass ones (tensor, sequence, context and expert parallelism,
              ZeRO-3's gathers, ZeRO-2/3's per-pass reduce-scatters) next to the compute op
              whose output they carry (fivefold.planner.op_comm), the step's gradient syncs
              (and any per-pass record no rule placed) after the last backward, ZeRO-1/2's
              parameter all-gathers after the optimizer (under offload in the forward: the
              engine re-gathers a unit in its pre-hook, once its host update is back)
  act. copies under activation offload, per offloaded block (the first of each virtual
              stage, fivefold.planner.activation_offload) and micro-batch a "host_copy" of
              its saved bytes (planner.activations) on the compute stream after its forward
              and one back before its backward (B or I), as the runtime queues them
              (fivefold.memory.activation_offload)
  optimizer   AdamW over the rank's shard: elements and bytes (7 x 4 bytes per element:
              parameter, gradient and two moments read, three written), on "host" for the
              units offload moves off the device (with a gradient download and a parameter
              upload of "host_copy", and under nvme the moments' "disk_copy" read and write)

Streams: "compute", "comm:<axis>" (a collective's mesh axis), "host", "disk". Dependencies:
each op waits for the previous op of its stream; a collective or send for the compute op
before it; the compute op after a collective, a pipeline receive or a ring step's transfer
for it (gradient reduce-scatters excepted: nothing in the pass reads them); the step's
gradient collectives for the last backward op, the optimizer for them, a parameter gather
for the optimizer. tests/test_op_trace.py holds the GEMMs, grouped GEMMs and attention
kernels equal to what the runtime dispatches on CPU ranks (kinds, shapes, dtypes, counts),
the collectives equal to the ledger and the optimizer's elements equal to the runtime's
optimizer state; element-wise ops, the optimizer's and copies' bytes and the dependencies
are not compared.

Scope: the synchronous schedules (TeraPipe's token slices included), the engine's AdamW
update (no Muon, GaLore or LOMO), dropless grouped experts without etp, no fp8; other
configurations are refused (PipeDream-2BW's step is not one step's work: its weights update
per stage, asynchronously).
"""

from __future__ import annotations

from copy import copy
from dataclasses import replace

from fivefold.batch_shares import dp_rank_of, replica_plan
from fivefold.config import Config
from fivefold.models.description import is_moe_layer
from fivefold.parallel.pipeline import schedules as S
from fivefold.parallel.pipeline.partition import stage_layer_ranges
from fivefold.parallel.plan import ParallelPlan, compute_precision
from fivefold.planner.activation_offload import rank_offloaded_layers
from fivefold.planner.activations import layout_block_saved_bytes
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.ledger_pipeline import PURPOSES, stage_layers_of_rank
from fivefold.planner.memory import (OPTIMIZER_STATE_BYTES, model_state_bytes, offload_bytes,
                                     stage_units)
from fivefold.planner.op_comm import RING, REGION_EXIT, SP_GATHER, CommPool, places
from fivefold.planner.op_compute import (DTYPE_BYTES, Op, Pass, block_passes, early_stop,
                                         head_pass, recomputed)
from fivefold.planner.op_compute import tokens as tokens_of

__all__ = ["Op", "rank_trace", "compute_counts"]
ADAMW_BYTES = 7 * 4  # fp32 parameter, gradient, two moments read; parameter, moments written
PHASE = {S.B: "backward", S.I: "input_grad", S.W: "weight_grad"}  # a backward action's


def rank_trace(cfg: Config, lay: ParallelPlan, rank: int = 0, device: str = "cpu"
               ) -> list[Op]:
    """The ops global rank `rank` runs in one training step under plan `lay` (module
    docstring), each with its stream and dependencies."""
    _check_scope(cfg, lay)
    lay = replica_plan(lay, dp_rank_of(lay, rank))
    dtype = compute_precision(lay.precision, device)
    pp_rank = lay.pp_rank_of(rank)
    layers, _, _ = stage_layers_of_rank(cfg, lay, pp_rank)
    passes = {(i, k): block_passes(cfg, lay, i, rank, dtype, device, k) for i in layers
              for k in range(lay.slices)}
    heads = [head_pass(cfg, lay, dtype, k) for k in range(lay.slices)]
    ranges = stage_layer_ranges(cfg.model, lay.pp * lay.vpp, lay.stage_layers)
    ledger = predict_ledger(cfg, lay, rank=rank)
    pipeline = lambda r: r.op in ("send", "recv") and r.mesh_dim == "pp"
    messages = [r for r in ledger.records if pipeline(r)]
    trace = _Trace(CommPool([r for r in ledger.records if not pipeline(r)], lay.zero_stage,
                            lay.offload != "none"), lay.context_degrees[0])
    units = {i: 1 + int(lay.expert_grid and is_moe_layer(cfg.model, i)) for i in layers}
    hosted = {i: int(layout_block_saved_bytes(cfg.model, lay, i))
              for i in rank_offloaded_layers(lay, ranges, pp_rank)}
    schedule = lay.pipeline_schedules(cfg.model.tied_embeddings)[0] if lay.pp > 1 else None
    for a in _actions(lay, pp_rank, schedule):
        if a.kind in PURPOSES:  # a message to this very rank goes through a mailbox
            if schedule.rank_of(S.peer_stage(a, schedule.stages)) != pp_rank:
                trace.comm(messages.pop(0), a.mb)
            continue
        first, last = a.stage == 0, a.stage == lay.pp * lay.vpp - 1
        ids, head = ranges[a.stage], heads[a.slice]
        elementwise = _elementwise_bytes(cfg, lay, dtype, a.slice)
        lo, hi = tokens_of(cfg, lay, a.slice)  # the lookup writes, its gradient reads and adds
        embedding = lay.micro_batch * (hi - lo) * cfg.model.hidden * DTYPE_BYTES[dtype]
        if a.kind == S.F:
            if first:  # the root's ZeRO-3 gather, the lookup, the embedding's region exit
                trace.place([("all_gather", "params")], a.mb)
                trace.elementwise("embedding", "forward", embedding, a.mb)
                trace.place(REGION_EXIT, a.mb)
            for i in ids:
                trace.place([("all_gather", "params")] * units[i], a.mb)
                trace.compute([p.forward for p in passes[i, a.slice]], a.mb)
                trace.elementwise(f"layers.{i}", "forward", elementwise, a.mb)
                if i in hosted:  # its saved tensors to the host, on the compute stream
                    trace.add(Op("host_copy", f"layers.{i}", "forward", bytes=hosted[i]),
                              mb=a.mb)
            if last:
                trace.place([SP_GATHER], a.mb)
                trace.compute([head.forward], a.mb)
                trace.place([("all_gather", "vocab_loss")], a.mb)
            continue
        if last:
            trace.compute(_backward([head], a.kind), a.mb)
            if a.kind != S.W:  # the final norm's region and gain
                trace.place(REGION_EXIT + (("all_reduce", "sp_norm_grads"),), a.mb)
        for i in reversed(ids):
            block = passes[i, a.slice]
            if a.kind != S.W:
                trace.place([("all_gather", "params")] * units[i], a.mb)
            if a.kind != S.W and i in hosted:  # and back as its backward starts
                trace.add(Op("host_copy", f"layers.{i}", PHASE[a.kind], bytes=hosted[i]),
                          mb=a.mb)
            if a.kind in (S.B, S.I) and lay.recompute != "none":
                trace.compute(recomputed(block, lay.recompute,
                                         lay.split_backward or not early_stop(cfg, i)), a.mb)
            trace.compute(_backward(block[::-1], a.kind), a.mb)
            if a.kind != S.W:
                trace.place([("all_reduce", "sp_norm_grads")] * 2, a.mb)
                trace.elementwise(f"layers.{i}", "backward", 2 * elementwise, a.mb)
            if a.kind != S.I:
                trace.place([("reduce_scatter", "grads")] * units[i], a.mb)
        if first and a.kind != S.I:  # the embedding's region exit, its table's gradient
            trace.place([SP_GATHER], a.mb)
            trace.elementwise("embedding", "weight_grad", 2 * embedding, a.mb)
        if a.kind != S.I and (lay.pp == 1 or first or last):
            trace.place([("reduce_scatter", "grads")], a.mb)  # the root's
    assert not messages, f"sends or receives the schedule does not issue: {messages}"
    state = ledger.model_state_bytes or model_state_bytes(  # the plain path keeps no ledger
        stage_units(cfg.model, lay, layers, True, True), lay)
    trace.step(lay, state)
    return trace.ops


def compute_counts(ops: list[Op]) -> dict[tuple, int]:
    """How often each compute kernel runs, keyed as tests/op_recorder.py records the
    runtime's: ("gemm", M, N, K, batch, dtype), ("grouped_gemm", M, N, K, groups, dtype,
    ragged) and ("attention", pass, B, H, Hkv, T, S, E, causal, dtype)."""
    out: dict[tuple, int] = {}
    for op in ops:
        if op.kind in ("gemm", "grouped_gemm"):
            key = (op.kind, *op.shape, op.dtype) + ((op.ragged,) if op.ragged else ())
        elif op.kind == "attention":
            key = ("attention", "forward" if op.phase in ("forward", "recompute") else
                   "backward", *op.shape, op.causal, op.dtype)
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return out


def _check_scope(cfg: Config, lay: ParallelPlan) -> None:
    why = ("an asynchronous schedule" if lay.asynchronous else
           f"the {lay.update} update path" if lay.update not in ("engine", "plain") else
           f"optimizer {lay.optimizer!r}" if lay.optimizer != "adamw" else
           "fp8" if lay.precision == "fp8" else None)
    if why:
        raise ValueError(f"the op trace does not model {why} yet (fivefold.planner.op_trace)")


def _actions(lay: ParallelPlan, pp_rank: int, schedule) -> list[S.Action]:
    if schedule is None:
        return [S.Action(kind, 0, mb) for mb in range(lay.micro_batches)
                for kind in (S.F, S.B)]
    return list(schedule.ranks[pp_rank])


def _backward(passes: list[Pass], kind: str) -> list[Op]:
    """A backward action's ops over `passes` (already reversed): B both gradients, I the
    inputs', W the weights' (fivefold.parallel.pipeline.split_backward)."""
    out = []
    for p in passes:
        if kind != S.W:
            out += p.input_grad
        if kind != S.I:
            out += p.weight_grad
    return [replace(op, phase=PHASE[kind]) if op.kind == "attention" else op for op in out]


def _elementwise_bytes(cfg: Config, lay: ParallelPlan, dtype: str, piece: int) -> int:
    """HBM bytes of one block's eager element-wise passes for one micro-batch (estimate):
    two RMSNorms (read x, write y: 2 each, fp32 inside), rotary on q and k (read, write),
    the MLP's activation and product (SwiGLU: read two, write one; GELU: read one, write
    one), two residual adds (read two, write one)."""
    m, a = cfg.model, DTYPE_BYTES[dtype]
    lo, hi = tokens_of(cfg, lay, piece)
    tokens = lay.micro_batch * (hi - lo)
    local = tokens // lay.tp if lay.sequence_parallel else tokens
    qk = (m.heads + m.n_kv_heads) // lay.tp * m.d_head
    ffn = m.ffn_hidden // lay.tp
    mlp = 3 * ffn if m.ffn_type == "swiglu" else 2 * ffn
    return a * (local * (2 * 2 * m.hidden + 2 * 3 * m.hidden) + tokens * (2 * qk + mlp))


class _Trace:
    """The op list under construction, with each stream's last op and the messages the next
    compute op waits for."""

    def __init__(self, pool: CommPool, ring: int):
        self.ops: list[Op] = []
        self.last: dict[str, int] = {}
        self.waiting: list[int] = []  # results the next compute op consumes
        self.in_flight: list[int] = []  # ring: the next block's transfer
        self.pool, self.ring = pool, ring

    def add(self, op: Op, *deps: int | None, mb: int | None = None) -> int:
        """Append a copy of `op` (a block's ops are shared by its passes) with its deps."""
        op = copy(op)
        prev = self.last.get(op.stream)
        op.deps = tuple(sorted({d for d in (prev, *deps) if d is not None}))
        if mb is not None:
            op.micro_batch = mb
        self.ops.append(op)
        self.last[op.stream] = len(self.ops) - 1
        return len(self.ops) - 1

    def compute(self, ops: list[Op], mb: int) -> None:
        """`ops` in order, each pass's collectives at their places (fivefold.planner.op_comm);
        a ring step's first GEMM waits for the block the previous step set moving."""
        for k, op in enumerate(ops):
            new_name = k == 0 or ops[k - 1].name != op.name
            if new_name:
                self.place(places(op.name, op.phase, "before"), mb)
            if op.kernel == "ring-math" and (new_name or ops[k - 1].step != op.step):
                self.waiting += self.in_flight
                self.in_flight = []
                if op.step + 1 < self.ring:  # the next block's transfer, issued first
                    self.in_flight = self.place(RING[0], mb, consumed=False)
            self.add(op, *self.waiting, mb=mb)
            self.waiting = []
            end = k + 1 == len(ops) or ops[k + 1].name != op.name
            if op.kernel == "ring-math" and op.phase not in ("forward", "recompute") \
                    and (end or ops[k + 1].step != op.step):
                self.place(RING[1], mb)  # the block's dK/dV accumulator passed on
            if end:
                self.place(places(op.name, op.phase, "after"), mb)

    def place(self, keys, mb: int, consumed: bool = True) -> list[int]:
        """The pool's records of `keys` here, each waiting for the compute op before it (and a
        pipeline receive the pass has not consumed yet); the next compute op waits for them
        (`consumed`) but for gradient reduce-scatters and sends, which nothing in the pass
        reads."""
        out, received = [], [w for w in self.waiting if self.ops[w].kind == "recv"]
        for record in self.pool.take(keys):
            out.append(self.comm(record, mb, self.last.get("compute"), *received))
            if consumed and record.purpose != "grads" and record.op != "send":
                self.waiting.append(out[-1])
        return out

    def elementwise(self, name: str, phase: str, nbytes: int, mb: int) -> None:
        self.add(Op("elementwise", name, phase, bytes=nbytes, micro_batch=mb))

    def comm(self, record, mb: int = -1, *deps: int | None) -> int:
        """A ledger record as an op on its axis's stream; a pipeline receive holds the next
        compute op back, a send waits for the compute op before it."""
        op = Op(record.op if record.op in ("send", "recv") else "collective", record.purpose,
                "step" if mb < 0 else "pass", stream=f"comm:{record.mesh_dim}",
                dtype=record.dtype, bytes=record.bytes, kernel=record.op,
                axis=record.mesh_dim, group=record.group_size, purpose=record.purpose,
                micro_batch=mb)
        index = self.add(op, self.last.get("compute") if record.op == "send" else None, *deps)
        if record.op == "recv" and record.mesh_dim == "pp":
            self.waiting.append(index)
        return index

    def step(self, lay: ParallelPlan, state: dict[str, int]) -> None:
        """The pool's leftovers and the step's collectives after the last backward, the
        optimizer and offload's copies, then the parameter gathers of ZeRO-1/2. The
        optimizer's elements are the ledger's model state's (fivefold.planner.memory:
        AdamW's 8 state bytes per element on the device, offload_bytes' on the host)."""
        backward_end = self.last.get("compute")
        records = self.pool.leftovers() + self.pool.rest
        grads = [self.comm(r, -1, backward_end) for r in records if r.purpose != "params"]
        adamw = OPTIMIZER_STATE_BYTES["adamw"]
        device = state["optimizer"] // adamw
        host = state["host"] // offload_bytes(lay.offload, adamw)[0] if state["host"] else 0
        done = []
        if host:
            down = self.add(Op("host_copy", "grads to host", "step", stream="host",
                               bytes=host * lay.grad_bytes), *grads)
            if lay.offload == "nvme":
                down = self.add(Op("disk_copy", "moments from disk", "step", stream="disk",
                                   bytes=8 * host), down)
            work = self.add(Op("optimizer", "adamw (offloaded)", "step", stream="host",
                               shape=(host,), dtype="fp32", bytes=ADAMW_BYTES * host), down)
            if lay.offload == "nvme":
                self.add(Op("disk_copy", "moments to disk", "step", stream="disk",
                            bytes=8 * host), work)
            done.append(self.add(Op("host_copy", "params to device", "step", stream="host",
                                    bytes=host * lay.param_bytes), work))
        if device:
            done.append(self.add(Op("optimizer", "adamw", "step", shape=(device,),
                                    dtype="fp32", bytes=ADAMW_BYTES * device), *grads))
        for r in records:
            if r.purpose == "params":
                self.comm(r, -1, *done)
