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
              repeat at the start of a block's backward ("full": the whole forward;
              "selective": what the policy does not cache); the output head on the last stage
  element-wise per block and pass one op with the HBM bytes of its norms, rotary, activation
              and residual adds (`_elementwise_bytes`, an estimate: not compared with the
              runtime, whose eager element-wise kernels differ in number from any fused stack)
  messages    the pipeline's sends and receives where the schedule issues them, sized by
              fivefold.planner.ledger_pipeline (the ledger's own prediction)
  collectives every other record of fivefold.planner.ledger_model.predict_ledger, byte for
              byte: the step's gradient syncs after the last backward, the parameter
              all-gathers after the optimizer, the rest (tensor, context and expert
              parallelism's per-pass exchanges) in the ledger's order after the compute, not
              yet placed inside their passes
  optimizer   AdamW over the rank's shard: elements and bytes (7 x 4 bytes per element:
              parameter, gradient and two moments read, three written), on "host" for the
              units offload moves off the device (with a gradient download and a parameter
              upload of "host_copy", and under nvme the moments' "disk_copy" read and write)

Streams: "compute", "comm:<axis>" (a collective's mesh axis), "host", "disk". Dependencies:
each op waits for the previous op of its stream; a send for the compute op before it; a
compute action after a receive for that receive; a gradient collective for the last
backward op, the optimizer for the gradient collectives, a parameter gather for the
optimizer. tests/test_op_trace.py holds the GEMMs, grouped GEMMs and attention kernels equal
to what the runtime dispatches on CPU ranks (kinds, shapes, dtypes, counts) and the
collectives equal to the ledger; element-wise ops, optimizer work and copies are not compared.

Scope: synchronous schedules without TeraPipe's token slices, the engine's AdamW update (no
Muon, GaLore or LOMO), dropless grouped experts, no fp8; other configurations are refused.
"""

from __future__ import annotations

from dataclasses import replace

from fivefold.batch_shares import dp_rank_of, replica_plan
from fivefold.config import Config
from fivefold.parallel.pipeline import schedules as S
from fivefold.parallel.pipeline.partition import stage_layer_ranges
from fivefold.parallel.plan import ParallelPlan, compute_precision
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.ledger_pipeline import PURPOSES, stage_layers_of_rank
from fivefold.planner.memory import stage_units
from fivefold.planner.op_compute import (DTYPE_BYTES, Op, Pass, block_passes, head_pass,
                                         recomputed)

__all__ = ["Op", "rank_trace", "compute_counts"]
ADAMW_BYTES = 7 * 4  # fp32 parameter, gradient, two moments read; parameter, moments written
STEP_PURPOSES = ("grads", "grad_norm", "loss", "moe_load")  # after the last backward


def rank_trace(cfg: Config, lay: ParallelPlan, rank: int = 0, device: str = "cpu"
               ) -> list[Op]:
    """The ops global rank `rank` runs in one training step under plan `lay` (module
    docstring), each with its stream and dependencies."""
    _check_scope(cfg, lay)
    lay = replica_plan(lay, dp_rank_of(lay, rank))
    dtype = compute_precision(lay.precision, device)
    pp_rank = lay.pp_rank_of(rank)
    layers, _, _ = stage_layers_of_rank(cfg, lay, pp_rank)
    passes = {i: block_passes(cfg, lay, i, rank, dtype, device) for i in layers}
    head = head_pass(cfg, lay, dtype)
    ranges = stage_layer_ranges(cfg.model, lay.pp * lay.vpp, lay.stage_layers)
    trace = _Trace()
    ledger = predict_ledger(cfg, lay, rank=rank)
    pipeline = lambda r: r.op in ("send", "recv") and r.mesh_dim == "pp"
    messages = [r for r in ledger.records if pipeline(r)]
    schedule = lay.pipeline_schedules(cfg.model.tied_embeddings)[0] if lay.pp > 1 else None
    for a in _actions(lay, pp_rank, schedule):
        if a.kind in PURPOSES:  # a message to this very rank goes through a mailbox
            if schedule.rank_of(S.peer_stage(a, schedule.stages)) != pp_rank:
                trace.comm(messages.pop(0), a.mb)
            continue
        last = a.stage == lay.pp * lay.vpp - 1
        blocks = [passes[i] for i in ranges[a.stage]]
        if a.kind == S.F:
            for i, block in zip(ranges[a.stage], blocks):
                trace.compute([p.forward for p in block], a.mb)
                trace.elementwise(f"layers.{i}", "forward", _elementwise_bytes(cfg, lay, dtype),
                                  a.mb)
            if last:
                trace.compute([head.forward], a.mb)
            continue
        if last:
            trace.compute(_backward([head], a.kind), a.mb)
        for i, block in zip(reversed(ranges[a.stage]), reversed(blocks)):
            if a.kind in (S.B, S.I) and lay.recompute != "none":
                trace.compute(recomputed(block, lay.recompute), a.mb)
            trace.compute(_backward(block[::-1], a.kind), a.mb)
            if a.kind != S.W:
                trace.elementwise(f"layers.{i}", "backward",
                                  2 * _elementwise_bytes(cfg, lay, dtype), a.mb)
    assert not messages, f"sends or receives the schedule does not issue: {messages}"
    trace.step(cfg, lay, pp_rank, [r for r in ledger.records if not pipeline(r)])
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
    why = ("TeraPipe's token slices" if lay.slices > 1 else
           "an asynchronous schedule" if lay.asynchronous else
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
    return [replace(op, phase={S.B: "backward", S.I: "input_grad", S.W: "weight_grad"}[kind])
            if op.kind == "attention" else op for op in out]


def _elementwise_bytes(cfg: Config, lay: ParallelPlan, dtype: str) -> int:
    """HBM bytes of one block's eager element-wise passes for one micro-batch (estimate):
    two RMSNorms (read x, write y: 2 each, fp32 inside), rotary on q and k (read, write),
    the MLP's activation and product (SwiGLU: read two, write one; GELU: read one, write
    one), two residual adds (read two, write one)."""
    m, a = cfg.model, DTYPE_BYTES[dtype]
    tokens = lay.micro_batch * (m.seq_len // lay.cp)
    local = tokens // lay.tp if lay.sequence_parallel else tokens
    qk = (m.heads + m.n_kv_heads) // lay.tp * m.d_head
    ffn = m.ffn_hidden // lay.tp
    mlp = 3 * ffn if m.ffn_type == "swiglu" else 2 * ffn
    return a * (local * (2 * 2 * m.hidden + 2 * 3 * m.hidden) + tokens * (2 * qk + mlp))


class _Trace:
    """The op list under construction, with each stream's last op for its dependencies."""

    def __init__(self):
        self.ops: list[Op] = []
        self.last: dict[str, int] = {}
        self.pending_recv: int | None = None

    def add(self, op: Op, *deps: int | None) -> int:
        prev = self.last.get(op.stream)
        wait = tuple(sorted({d for d in (prev, *deps) if d is not None}))
        self.ops.append(replace(op, deps=wait))
        self.last[op.stream] = len(self.ops) - 1
        return len(self.ops) - 1

    def compute(self, ops: list[Op], mb: int) -> None:
        for op in ops:
            self.add(replace(op, micro_batch=mb), self.pending_recv)
            self.pending_recv = None

    def elementwise(self, name: str, phase: str, nbytes: int, mb: int) -> None:
        self.add(Op("elementwise", name, phase, bytes=nbytes, micro_batch=mb))

    def comm(self, record, mb: int = -1, *deps: int | None) -> int:
        op = Op(record.op if record.op in ("send", "recv") else "collective", record.purpose,
                "step" if mb < 0 else "pass", stream=f"comm:{record.mesh_dim}",
                dtype=record.dtype, bytes=record.bytes, kernel=record.op,
                axis=record.mesh_dim, group=record.group_size, purpose=record.purpose,
                micro_batch=mb)
        if record.op == "send" and mb >= 0:
            return self.add(op, self.last.get("compute"))
        index = self.add(op, *deps)
        if record.op == "recv" and mb >= 0:
            self.pending_recv = index
        return index

    def step(self, cfg: Config, lay: ParallelPlan, pp_rank: int, records) -> None:
        """Collectives, the optimizer and offload's copies after the last backward."""
        backward_end = self.last.get("compute")
        grads = [self.comm(r, -1, backward_end) for r in records
                 if r.purpose in STEP_PURPOSES]
        layers, first, last = stage_layers_of_rank(cfg, lay, pp_rank)
        units = stage_units(cfg.model, lay, layers, first, last, etp=lay.etp)
        local = [u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units]
        off = lay.offloaded_units(local)
        host, device = sum(local[:off]), sum(local[off:])
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
            elif r.purpose not in STEP_PURPOSES:
                self.comm(r, -1, 0 if self.ops else None)
