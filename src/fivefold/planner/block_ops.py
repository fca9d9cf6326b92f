"""One block's forward and backward for one micro-batch on one rank, as ops on the rank's
streams (fivefold.planner.events), and their scheduled seconds.

The ops are priced before they are listed (compute: fivefold.planner.compute; collectives:
fivefold.planner.comm, grouped in `BlockComm`); what hides behind what follows from which op
waits for which, and the scheduler's contention charges a hidden collective (1 - overlap_eff)
of its time:

- tensor parallelism (Megatron-LM, arXiv 1909.08053): the block's all-reduces (all-gather +
  reduce-scatter pairs with sequence parallelism, arXiv 2205.05198) on the "tp" stream, the
  next compute waiting for each; a stack that overlaps them (Transformer Engine's userbuffers,
  `Stack.overlaps_tp`) runs them beside the GEMMs they feed (the non-attention compute).
  Sequence parallelism gathers each region's input again in backward for its weight
  gradients, beside those matmuls (2205.05198, Sec. 4.2.2); a stack that issues the
  backward's input-gradient collectives asynchronously (`Stack.async_tp_grads`, Megatron-LM
  since 2021-09) runs them there too.
- context parallelism: ring attention (arXiv 2310.01889) sends K/V shards around the ring
  beside attention, and the output projection waits for the last; Ulysses (arXiv 2309.14509)
  all-to-alls q, k, v and the output, the compute waiting; the all-gather variant (torch
  2.5/2.6's experimental context parallelism, `cp_kv_exchange = "allgather"`) gathers K/V
  beside the first of cp attention steps, the rest waiting for it, and in backward passes each
  step's fp32 dK/dV to the next rank beside the next step, the last pass exposed.
- expert parallelism: the dispatch and combine all-to-alls (GShard, arXiv 2006.16668) and the
  forward's count exchange on the "ep" stream, the compute waiting.
- ZeRO-3 / FSDP (arXiv 2304.11277): the gather of the next block prefetched on the "dp"
  stream beside this block's forward; in backward the gather(s) and the reduce-scatter of a
  neighbouring block beside this block's backward. A stack without `zero3_overlap`
  (DeepSpeed's early ZeRO-3) gathers tensor by tensor synchronously (the compute waits) and
  reduce-scatters beside the block's own backward only. ZeRO-2 reduce-scatters beside the
  block's backward.
- full recomputation runs the forward's ops again (without its gathers) before the backward,
  up to the block's last GEMM and its region's close where the stack stops early
  (`Stack.recompute_early_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.planner.events import COMPUTE, Op, schedule


@dataclass(frozen=True)
class BlockComm:
    """Seconds of one block's collectives for one micro-batch on one rank."""

    tp_f: float = 0.0  # tensor-parallel collectives per direction (MoE: the MLP side's too)
    tp_recompute_f: float | None = None  # those a full recomputation reruns (None: tp_f)
    tp_b: float = 0.0
    sp_regather: float = 0.0  # sequence parallelism's backward re-gathers
    tp_overlapped: bool = False  # beside the GEMMs (Stack.overlaps_tp)
    tp_async_grads: bool = False  # backward's beside the weight gradients (Stack.async_tp_grads)
    cp_mode: str = "none"  # "ring", "allgather", "ulysses" or "none"
    cp_step: float = 0.0  # ring: one K/V shard's send; allgather: one fp32 dK/dV pass
    cp_gather: float = 0.0  # allgather: the K/V all-gather of one pass
    cp_a2a: float = 0.0  # Ulysses: q, k, v and output all-to-alls, each direction
    cp: int = 1
    ep_f: float = 0.0  # dispatch + combine (+ the forward's count exchange)
    ep_b: float = 0.0
    dp_prefetch_f: float = 0.0  # ZeRO-3: the prefetched gather beside the forward
    dp_prefetch_b: float = 0.0  # ZeRO-3: the backward's gather(s)
    dp_reduce: float = 0.0  # ZeRO-2/3: the gradient reduce-scatter
    dp_sync_f: float = 0.0  # synchronous per-tensor gathers (compute waits), forward
    dp_sync_b: float = 0.0  # and backward
    reduce_beside_backward_only: bool = False  # the reduce-scatter after the recomputation


@dataclass(frozen=True)
class Compute:
    """Seconds of one block's compute: forward, its attention part, backward (recomputation
    excluded), its attention and weight-gradient parts, recomputed forward."""

    fwd: float
    attn_f: float
    bwd: float
    attn_b: float
    wgrad: float
    recompute: float
    full_recompute: bool


class _Ops:
    """An op list being built: a chain of ops each waiting for the previous one (`then`)
    with ops beside them (`beside`). Ops of zero seconds are left out: they would only hold
    their stream's place."""

    def __init__(self):
        self.ops: list[Op] = []
        self.tail: tuple[int, ...] = ()

    def add(self, name: str, stream: str, seconds: float, after: tuple[int, ...]
            ) -> tuple[int, ...]:
        if seconds <= 0.0:
            return ()
        self.ops.append(Op(name, stream, seconds, after))
        return (len(self.ops) - 1,)

    def then(self, name: str, stream: str, seconds: float):
        self.tail = self.add(name, stream, seconds, self.tail) or self.tail

    def beside(self, name: str, stream: str, seconds: float, *compute: tuple[str, float]):
        """`name` on `stream` beside the compute ops `compute` run one after the other;
        what follows waits for both."""
        comm = self.add(name, stream, seconds, self.tail)
        for label, s in compute:
            self.then(label, COMPUTE, s)
        self.tail = self.tail + comm


def _attention(o: _Ops, c: BlockComm, attn: float, backward: bool):
    if c.cp_mode == "ring":  # K/V shards (backward: and their gradients) around the ring
        o.beside("ring sends", "cp", (c.cp - 1) * c.cp_step * (2 if backward else 1),
                 ("attention", attn))
    elif c.cp_mode == "allgather":
        step = attn / c.cp
        o.beside("K/V all-gather", "cp", c.cp_gather, ("attention step 0", step))
        if not backward:
            o.then("attention", COMPUTE, attn - step)
            return
        for k in range(1, c.cp):  # the previous step's dK/dV passed beside this step
            o.beside(f"dK/dV pass {k - 1}", "cp", c.cp_step, (f"attention step {k}", step))
        o.then(f"dK/dV pass {c.cp - 1}", "cp", c.cp_step)
    else:
        if c.cp_mode == "ulysses":
            o.then("all-to-alls", "cp", c.cp_a2a)
        o.then("attention", COMPUTE, attn)


def _forward_body(o: _Ops, c: BlockComm, t: Compute, fwd: float, tp_f: float):
    _attention(o, c, t.attn_f, backward=False)
    rest = max(0.0, fwd - t.attn_f)
    if c.tp_overlapped:
        o.beside("tp collectives", "tp", tp_f, ("gemms", rest))
    else:
        o.then("gemms", COMPUTE, rest)
        o.then("tp collectives", "tp", tp_f)
    o.then("dispatch/combine", "ep", c.ep_f)


def forward_ops(c: BlockComm, t: Compute) -> list[Op]:
    o = _Ops()
    prefetch = o.add("prefetch gather", "dp", c.dp_prefetch_f, ())
    o.then("gathers", "dp", c.dp_sync_f)
    _forward_body(o, c, t, t.fwd, c.tp_f)
    o.tail += prefetch
    return o.ops


def backward_ops(c: BlockComm, t: Compute) -> list[Op]:
    o = _Ops()
    gather = o.add("prefetch gather", "dp", c.dp_prefetch_b, ())
    reduce_ = None if c.reduce_beside_backward_only else o.add(
        "reduce-scatter", "dp", c.dp_reduce, gather)
    o.then("gathers", "dp", c.dp_sync_b)
    if t.full_recompute:
        _forward_body(o, c, t, t.recompute,
                      c.tp_f if c.tp_recompute_f is None else c.tp_recompute_f)
    else:
        o.then("recompute", COMPUTE, t.recompute)
    if reduce_ is None:
        reduce_ = o.add("reduce-scatter", "dp", c.dp_reduce, o.tail)
    _attention(o, c, t.attn_b, backward=True)
    wgrad = min(t.wgrad, max(0.0, t.bwd - t.attn_b))
    dgrad = max(0.0, t.bwd - t.attn_b - wgrad)
    if c.tp_overlapped:
        o.beside("tp collectives", "tp", c.tp_b + c.sp_regather,
                 ("dgrad gemms", dgrad), ("wgrad gemms", wgrad))
    else:
        o.then("dgrad gemms", COMPUTE, dgrad)
        if c.tp_async_grads:
            o.beside("sp re-gathers, input-gradient collectives", "tp",
                     c.sp_regather + c.tp_b, ("wgrad gemms", wgrad))
        else:
            o.beside("sp re-gathers", "tp", c.sp_regather, ("wgrad gemms", wgrad))
            o.then("tp collectives", "tp", c.tp_b)
    o.then("dispatch/combine", "ep", c.ep_b)
    o.tail += gather + reduce_
    return o.ops


def block_seconds(c: BlockComm, t: Compute, overlap_eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of the block, recomputation included in backward."""
    return (schedule(forward_ops(c, t), overlap_eff).makespan,
            schedule(backward_ops(c, t), overlap_eff).makespan)


def beside_seconds(comm: float, compute: float, overlap_eff: float, stream: str = "dp"
                   ) -> float:
    """Seconds `comm` adds to `compute` when it runs beside it and what follows waits for
    both (a stage's gathers behind its first forward, a re-gather behind the next forward)."""
    return schedule([Op("compute", COMPUTE, compute), Op("collective", stream, comm)],
                    overlap_eff).makespan - compute
