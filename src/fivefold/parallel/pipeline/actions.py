"""The vocabulary of pipeline schedules: actions, the lists' container, and their messages.

A schedule (fivefold.parallel.pipeline.schedules, which documents the actions) is, per pp
rank, an ordered list of `Action`s in a `Schedule`. Here: the action kinds, which rank holds a
virtual stage (`rank_of_stage`: round-robin, or in a V), each send's and receive's message
identity and peer, and the two passes every synchronous schedule shares: the point-to-point
actions around compute (`with_p2p`) and the tied-embedding exchange (`with_tied_embedding`).
Torch-free, like the lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.validate_parallel import V_SCHEDULES

F, B, I, W = "F", "B", "I", "W"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
SEND_TIED_WEIGHT, RECV_TIED_WEIGHT = "send_tied_weight", "recv_tied_weight"
SEND_TIED_GRAD, RECV_TIED_GRAD = "send_tied_grad", "recv_tied_grad"
SEND_LOSS, RECV_LOSS, UPDATE = "send_loss", "recv_loss", "update"

COMPUTE = (F, B, I, W)
GRADIENT_KINDS = (B, W)  # the actions that accumulate weight gradients
SENDS = (SEND_ACT, SEND_GRAD, SEND_TIED_WEIGHT, SEND_TIED_GRAD, SEND_LOSS)
RECVS = (RECV_ACT, RECV_GRAD, RECV_TIED_WEIGHT, RECV_TIED_GRAD, RECV_LOSS)
SYNC_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "terapipe") + V_SCHEDULES
SPLIT_SCHEDULES = ("zb",) + V_SCHEDULES  # zero-bubble: backward split into I and W


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int = 0  # virtual stage
    mb: int = 0  # micro-batch (PipeDream-2BW: the running index over all steps; UPDATE: step)
    slice: int = 0  # token slice (TeraPipe)

    def __str__(self) -> str:
        tail = f".{self.slice}" if self.slice else ""
        return f"{self.kind}[s{self.stage} mb{self.mb}{tail}]"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    vpp: int
    micro_batches: int  # per optimizer step
    slices: int
    ranks: tuple[tuple[Action, ...], ...]
    steps: int = 1  # optimizer steps the lists span (PipeDream-2BW runs without flushes)
    first_step: int = 0  # a resumed PipeDream-2BW run's lists start at this step
    v_shape: bool = False  # chunks placed in a V (ZB-V, DualPipe-V), else round-robin

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        return rank_of_stage(stage, self.pp, self.v_shape)


def rank_of_stage(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pp rank that holds virtual stage `stage`: round-robin (Megatron's interleaving),
    or in a V (chunk 0 down the ranks, chunk 1 back up: stage 2p-1-r on rank r)."""
    if v_shape and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def message(action: Action, stages: int) -> tuple:
    """The identity of the message a send or receive action moves (the sender's view)."""
    a = action
    if a.kind == SEND_ACT:
        return ("act", a.stage, a.mb, a.slice)
    if a.kind == RECV_ACT:
        return ("act", a.stage - 1, a.mb, a.slice)
    if a.kind == SEND_GRAD:
        return ("grad", a.stage, a.mb, a.slice)
    if a.kind == RECV_GRAD:
        return ("grad", a.stage + 1, a.mb, a.slice)
    if a.kind in (SEND_TIED_WEIGHT, RECV_TIED_WEIGHT):
        return ("tied_weight", 0, a.mb, 0)
    if a.kind in (SEND_TIED_GRAD, RECV_TIED_GRAD):
        return ("tied_grad", stages - 1, a.mb, 0)
    if a.kind in (SEND_LOSS, RECV_LOSS):
        return ("loss", stages - 1, a.mb, 0)
    raise ValueError(f"{a} moves no message")


def peer_stage(action: Action, stages: int) -> int:
    """The virtual stage at the other end of a send or receive."""
    kind = action.kind
    if kind == SEND_ACT or kind == RECV_GRAD:
        return action.stage + 1
    if kind == RECV_ACT or kind == SEND_GRAD:
        return action.stage - 1
    if kind in (SEND_TIED_WEIGHT, RECV_TIED_GRAD, RECV_LOSS):
        return stages - 1
    if kind in (RECV_TIED_WEIGHT, SEND_TIED_GRAD, SEND_LOSS):
        return 0
    raise ValueError(f"{action} has no peer")


def with_p2p(order: list[Action], stages: int) -> list[Action]:
    """Add the point-to-point actions around compute: receive right before use, send right
    after the result exists."""
    out = []
    for a in order:
        if a.kind == F:
            if a.stage > 0:
                out.append(Action(RECV_ACT, a.stage, a.mb, a.slice))
            out.append(a)
            if a.stage < stages - 1:
                out.append(Action(SEND_ACT, a.stage, a.mb, a.slice))
        elif a.kind in (B, I):
            if a.stage < stages - 1:
                out.append(Action(RECV_GRAD, a.stage, a.mb, a.slice))
            out.append(a)
            if a.stage > 0:
                out.append(Action(SEND_GRAD, a.stage, a.mb, a.slice))
        else:
            out.append(a)
    return out


def _index(actions: list[Action], pick, last: bool) -> int | None:
    hits = [i for i, a in enumerate(actions) if pick(a)]
    return (hits[-1] if last else hits[0]) if hits else None


def with_tied_embedding(ranks: list[list[Action]], stages: int, last_rank: int,
                        backward: bool) -> list[list[Action]]:
    """Add the tied-embedding exchange between the first rank (owner) and the last stage's
    rank `last_rank` (in a V the first rank itself: the messages go through its mailbox)."""
    first, last = ranks[0], ranks[last_rank]
    at = _index(last, lambda a: a.stage == stages - 1, last=False)
    last.insert(at, Action(RECV_TIED_WEIGHT))
    first.insert(0, Action(SEND_TIED_WEIGHT))
    if backward:
        at = _index(last, lambda a: a.kind in (B, I) and a.stage == stages - 1, True)
        at += 1
        while at < len(last) and last[at].kind in SENDS:  # keep the gradient sends first
            at += 1
        last.insert(at, Action(SEND_TIED_GRAD))
        at = _index(first, lambda a: a.kind in GRADIENT_KINDS and a.stage == 0, True)
        first.insert(at, Action(RECV_TIED_GRAD))
    return ranks
