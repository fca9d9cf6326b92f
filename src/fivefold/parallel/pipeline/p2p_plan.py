"""When each send and receive of a schedule is issued: batched groups that NCCL cannot deadlock.

The action lists (fivefold.parallel.pipeline.schedules) say what each rank computes and
which messages it sends and receives, with a receive placed right before the action that
reads it. gloo matches messages by tag, so issuing them in that order works there. NCCL
does not: it pairs a rank pair's sends and receives in issue order, a send completes only
once its receive is posted, and the operations one rank issues run one after another on
its communication stream, except those issued together as one group
(torch.distributed.batch_isend_irecv). Where both ranks of a pair send before they receive
(1F1B's steady state) the lists, issued one operation at a time, deadlock; Megatron-LM
(arXiv 2104.04473) pairs them by hand (send_forward_recv_backward and its siblings).

The plan here derives the groups from the lists for every schedule at once, by a lockstep
replay. In round t every rank runs its next non-communication action (a Step: F, B, I, W,
2BW's UPDATE) if every message it reads has been sent in a round before t; then each rank
issues one Exchange: the sends that follow its action in its list, and the receives of
every message any rank sent to it in round t, in the sender's order. So every message is
sent and received in the same round's exchange, and the exchanges of round t complete
together once every rank has finished round t - 1: by induction no rank ever waits for a
message its peer issues later, and each direction of each rank pair carries its messages in
one order on both ends (`replay.check_nccl` verifies both per schedule). A receive is thus
issued as soon as its message is sent, possibly several actions before the one that reads
it; the executor waits for it only right before that action (Step.needs), so nothing moves
on the compute side. The lockstep replay is the gloo replay with unit cost per action: it
finishes exactly when the lists run at all. The messages and their sizes are the lists'
own, so the ledger and the planner's prediction of it do not change.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.parallel.pipeline.schedules import RECVS, SENDS, Action, Schedule, message


@dataclass(frozen=True)
class Step:
    action: Action  # a compute action or 2BW's UPDATE
    needs: tuple[Action, ...]  # the receives listed before it (since the previous step)


@dataclass(frozen=True)
class Exchange:
    actions: tuple[Action, ...]  # sends and receives issued as one batch, in this order


def issue_plan(schedule: Schedule) -> tuple[tuple[Step | Exchange, ...], ...]:
    """Per rank, its Steps in list order with the Exchanges issued between them."""
    stages, n = schedule.stages, len(schedule.ranks)
    steps: list[list[Step]] = []
    sends_after: list[list[list[Action]]] = []  # rank, step (0 = before the first): sends
    receiver: dict[tuple, tuple[int, Action]] = {}
    for r, actions in enumerate(schedule.ranks):
        steps.append([])
        sends_after.append([[]])
        needs: list[Action] = []
        for a in actions:
            if a.kind in SENDS:
                sends_after[r][-1].append(a)
            elif a.kind in RECVS:
                receiver[message(a, stages)] = (r, a)
                needs.append(a)
            else:
                steps[r].append(Step(a, tuple(needs)))
                sends_after[r].append([])
                needs = []
        if needs:
            raise ValueError(f"rank {r} of {schedule.name} ends with receives {needs}")
    sent_round: dict[tuple, int] = {}
    exchanges: list[dict[int, list[Action]]] = [{} for _ in range(n)]  # rank: round -> actions

    def issue(r: int, t: int, sends: list[Action]) -> None:
        for a in sends:
            msg = message(a, stages)
            sent_round[msg] = t
            exchanges[r].setdefault(t, []).append(a)
            peer, recv = receiver[msg]
            exchanges[peer].setdefault(t, []).append(recv)

    for r in range(n):
        issue(r, -1, sends_after[r][0])
    ran_at: list[list[int]] = [[] for _ in range(n)]  # rank: the round of each step
    t = 0
    while any(len(ran_at[r]) < len(steps[r]) for r in range(n)):
        ready = [r for r in range(n) if len(ran_at[r]) < len(steps[r]) and all(
            sent_round.get(message(a, stages), t) < t for a in steps[r][len(ran_at[r])].needs)]
        if not ready:
            raise ValueError(f"{schedule.name}: the action lists deadlock")
        for r in ready:
            ran_at[r].append(t)
            issue(r, t, sends_after[r][len(ran_at[r])])
        t += 1
    plan = []
    for r in range(n):  # a round's step runs before its exchange
        timed = [(t, 0, step) for t, step in zip(ran_at[r], steps[r])]
        timed += [(t, 1, Exchange(tuple(acts))) for t, acts in exchanges[r].items()]
        plan.append(tuple(item for *_, item in sorted(timed, key=lambda e: e[:2])))
    return tuple(plan)
