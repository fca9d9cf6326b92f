"""The op trace scheduled: one training step's time from the ops each rank runs.

The simulator is built of three parts (docs/planner.md): a trace (each rank's ops for one
step, fivefold.planner.op_trace.rank_trace), prices (the hardware profile;
fivefold.planner.trace_prices over op_prices, comm and offload) and one scheduler
(fivefold.planner.events). `fivefold simulate` schedules the block model's per-block op
lists (fivefold.planner.block_ops); this module joins the trace to the scheduler (the issue
"the scheduler reads the op trace") for the `fivefold` stack, as a second prediction beside
the block model's, which it leaves as it is (`fivefold simulate SPEC --op-trace FILE`).

`op_step` prices every op of the trace (trace_prices.OpPrices, on the block model's own
sustained profile, groups and links) and schedules one step:

- pp = 1: the trace of global rank 0 through events.schedule (the data-parallel ranks run
  the same ops; under expert parallelism at the busiest rank's load, as priced).
- pp > 1: the pp ranks of one pipeline (dp, tp and cp coordinates 0) in one op list, each
  rank a device of its own (events.Op.device: contention counts per rank) and each receive
  waiting for its matching send (fivefold.parallel.pipeline.schedules.message). A rank's
  sends queue on its "comm:pp" stream in the trace's order; its receives take a stream of
  their own ("comm:pp recv") and wait for nothing but their send: the executor posts a
  receive as soon as its message is sent (fivefold.parallel.pipeline.p2p_plan), so a send
  never waits behind a receive whose message is still to come, as the trace's one pp stream
  would have it (0.03-0.1% of the 1B steps of tests/test_trace_step.py).

The step time is the schedule's makespan: the last op of any rank of the pipeline.

Scope: op_trace's (`check_scope` names the key it refuses): the fivefold stack (the trace
is this runtime's ops), the synchronous schedules, AdamW, dropless grouped experts without
etp, no fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.batch_shares import replica_plan
from fivefold.config import Config, ConfigError
from fivefold.hardware import HardwareProfile
from fivefold.parallel.pipeline import schedules as S
from fivefold.parallel.plan import ParallelPlan, plan_from_config
from fivefold.planner import events
from fivefold.planner.fitted import FITTED, Fitted
from fivefold.planner.ledger_pipeline import PURPOSES
from fivefold.planner.op_compute import Op
from fivefold.planner.op_trace import rank_trace
from fivefold.planner.simulate import default_precision, profile_of, shared_machine
from fivefold.planner.spec import check_model_fits_layout, cluster_gpus
from fivefold.planner.step import LayoutStep
from fivefold.planner.trace_prices import OpPrices

RECV_STREAM = "comm:pp recv"


@dataclass(frozen=True)
class ScheduledOp:
    """One op of the trace where the scheduler put it: its pipeline rank, the trace's op,
    the stream it ran on, its price and its interval."""

    pp_rank: int
    op: Op
    stream: str
    seconds: float
    start: float
    end: float


@dataclass(frozen=True)
class OpStep:
    """One step of the op trace scheduled (module docstring)."""

    step_time_s: float
    ranks: tuple[int, ...]  # the global rank of each pipeline rank scheduled
    ops: tuple[ScheduledOp, ...]


def check_scope(cfg: Config, lay: ParallelPlan) -> None:
    """ConfigError naming the key where the op trace does not reach: op_trace's refusals
    (its _check_scope and op_compute's experts), and a stack other than this runtime's."""
    moe = cfg.model.moe
    refusals = [
        ("train.stack", cfg.train.stack != "fivefold",
         f"the op trace lists the fivefold runtime's ops; stack {cfg.train.stack!r} runs others"),
        ("parallel.schedule", lay.asynchronous,
         "PipeDream-2BW's step is not one step's work (each stage updates asynchronously)"),
        ("train.optimizer", lay.optimizer != "adamw",
         f"the op trace models the engine's AdamW, not {lay.optimizer!r}"),
        ("parallel.precision", lay.precision == "fp8", "the op trace does not model fp8"),
        ("parallel.etp", lay.etp > 1, "the op trace does not model expert tensor parallelism"),
        ("model.moe.expert_matmul", moe is not None and moe.expert_matmul != "grouped",
         "the op trace models grouped expert matmuls only"),
        ("model.moe.capacity_factor", moe is not None and moe.capacity_factor is not None,
         "the op trace models dropless experts only")]
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(key, f"{why}; drop --op-trace or change the key "
                                   "(fivefold.planner.trace_step)")


def op_step(cfg: Config, prof: HardwareProfile | None = None, plan: ParallelPlan | None = None,
            fit: Fitted = FITTED) -> OpStep:
    """The op trace of `cfg` (or of `plan` on cfg's model and cluster) priced on `prof` and
    scheduled (module docstring); the profile and plan as `simulate` takes them."""
    prof = shared_machine(prof or profile_of(cfg), cfg.cluster.gpus or 1)
    plan = plan or plan_from_config(cfg, cluster_gpus(cfg), default_precision(prof))
    check_model_fits_layout(cfg.model, plan)
    check_scope(cfg, plan)
    sm = LayoutStep(cfg, prof, plan, fit=fit)
    prices = OpPrices(sm)
    device = "cpu" if prof.cores else "cuda"
    ranks = tuple(p * (plan.gpus // plan.pp) for p in range(plan.pp))
    traces = [rank_trace(cfg, plan, r, device) for r in ranks]
    messages = _messages(cfg, plan)
    listed, owners = _joint_ops(traces, messages, prices)
    timeline = events.schedule(listed, sm.prof.eff.overlap_eff)
    scheduled = tuple(ScheduledOp(p, traces[p][i], e.stream, e.seconds, s, t) for (p, i), e, s, t
                      in zip(owners, listed, timeline.start, timeline.end))
    return OpStep(timeline.makespan, ranks, scheduled)


def _messages(cfg: Config, lay: ParallelPlan) -> list[list[tuple[str, tuple, int]]]:
    """Per pipeline rank, its messages to other ranks in the order the trace lists them
    (op_trace: the schedule's send and receive actions whose peer is another rank):
    ("send" or "recv", the message's identity, the peer's pp rank)."""
    if lay.pp == 1:
        return [[]]
    schedule = replica_plan(lay, 0).pipeline_schedules(cfg.model.tied_embeddings)[0]
    out = []
    for p, actions in enumerate(schedule.ranks):
        out.append([])
        for a in actions:
            peer = schedule.rank_of(S.peer_stage(a, schedule.stages)) if a.kind in PURPOSES \
                else p
            if peer != p:
                out[-1].append(("send" if a.kind in S.SENDS else "recv",
                                S.message(a, schedule.stages), peer))
    return out


@dataclass(frozen=True)
class _RankOp:
    """One op of a rank's trace as it enters the joint list: its events.Op fields, the ops
    (by index in the rank's trace) it waits for, and the message it receives or sends."""

    name: str
    stream: str
    seconds: float
    deps: tuple[int, ...]
    receives: tuple | None = None
    sends: tuple | None = None


def _rank_ops(p: int, trace: list[Op], messages: list[tuple[str, tuple, int]],
              prices: OpPrices) -> list[_RankOp]:
    """Pipeline rank `p`'s trace priced, its receives on RECV_STREAM, and its messages
    freed of the waits the trace's one pp stream gives them on each other (module
    docstring)."""
    pipeline = [i for i, op in enumerate(trace) if op.axis == "pp" and op.kind in ("send",
                                                                                  "recv")]
    if [trace[i].kind for i in pipeline] != [kind for kind, _, _ in messages]:
        raise ValueError(f"pipeline rank {p}: the trace's messages are not its schedule's")
    message = dict(zip(pipeline, messages))
    seconds = prices.rank_seconds(trace, p, {i: abs(peer - p) for i, (kind, _, peer)
                                             in message.items() if kind == "send"})
    out = []
    for i, op in enumerate(trace):
        if i not in message:
            out.append(_RankOp(op.name, op.stream, seconds[i], op.deps))
            continue
        kind, key, _ = message[i]
        deps = tuple(d for d in op.deps if d not in message)
        out.append(_RankOp(op.name, RECV_STREAM, seconds[i], deps, receives=key)
                   if kind == "recv" else
                   _RankOp(op.name, op.stream, seconds[i], deps, sends=key))
    return out


def _joint_ops(traces: list[list[Op]], messages: list[list[tuple[str, tuple, int]]],
               prices: OpPrices) -> tuple[list[events.Op], list[tuple[int, int]]]:
    """The pipeline ranks' traces as one op list for events.schedule, each op after every
    op it waits for (a receive after its send, listed from another rank's trace first), and
    per listed op its (pp rank, index in the rank's trace)."""
    ranks = [_rank_ops(p, t, m, prices) for p, (t, m) in enumerate(zip(traces, messages))]
    listed: list[events.Op] = []
    owners: list[tuple[int, int]] = []
    where = [[0] * len(t) for t in traces]  # each rank's op's index in `listed`
    sent: dict[tuple, int] = {}  # each message's send's index in `listed`
    done = [0] * len(ranks)
    while any(k < len(ops) for k, ops in zip(done, ranks)):
        moved = False
        for p, ops in enumerate(ranks):
            while done[p] < len(ops) and (ops[done[p]].receives is None
                                          or ops[done[p]].receives in sent):
                i = done[p]
                op = ops[i]
                after = tuple(where[p][d] for d in op.deps) + (
                    (sent[op.receives],) if op.receives is not None else ())
                listed.append(events.Op(op.name, op.stream, op.seconds, after,
                                        device=f"pipeline rank {p}"))
                owners.append((p, i))
                where[p][i] = len(listed) - 1
                if op.sends is not None:
                    sent[op.sends] = len(listed) - 1
                done[p] += 1
                moved = True
        if not moved:
            raise ValueError("the pipeline's receives wait for sends no rank lists")
    return listed, owners
