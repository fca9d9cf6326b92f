"""How the global batch splits over the data-parallel replicas: evenly, or by
`parallel.dp_batch_shares` on replicas of unequal speed.

Heterogeneous data parallelism (Metis, ATC'24, Sec. 4; Sailor, SOSP'25) gives a faster
replica a larger part of the same global batch instead of a larger batch of its own. With
shares s_0..s_{dp-1} (positive integers, summing to S), replica r takes the rows
[G (s_0 + ... + s_{r-1}) / S, G (s_0 + ... + s_r) / S) of the global batch of G sequences
that the one-process run draws (fivefold.train.data.BatchSampler), so the replicas' rows
together are exactly that batch. Gradients are averaged by tokens, not by replicas: every
replica divides its summed token loss by the tokens of the whole global batch and the
engine's collectives sum (fivefold.train.trainer), so the sum over replicas is the
one-process gradient whatever each replica's share.

`parallel.micro_batch` keeps its meaning, the sequences of one micro-batch; unset, each
replica runs its whole share as one micro-batch. A replica with a larger share then runs
more micro-batches than the others, which is only sound where gradients are reduced once
per step (DDP, ZeRO-1): ZeRO-2/3 reduce-scatter every micro-batch, expert parallelism
exchanges tokens every micro-batch, and LOMO and GaLore's data-parallel update reduce inside
backward, so there every replica must run the same number of micro-batches
(`check_batch_split`).

Under a pipeline (parallel.pp > 1) each replica's pp ranks run the schedule built for the
replica's own micro-batch count (`replica_plan`): its stages exchange activations only with
each other, so the replicas' schedules need not match, and they meet only in the gradient
sync, once per step for DDP and ZeRO-1 (the engine reduces each unit after its last backward,
in the same order on every replica). The ledger model predicts a rank's step from the same
replica plan. Nothing here touches torch (validation imports it).
"""

from __future__ import annotations

from fivefold.config import ConfigError, ParallelConfig

KEY = "parallel.dp_batch_shares"


def replica_rows(global_batch: int, dp: int, shares: tuple[int, ...] | list[int] | None
                 ) -> list[int]:
    """Sequences of each replica per step: G / dp each, or G * s_r / sum(shares)."""
    if not shares:
        return [global_batch // dp] * dp
    unit = global_batch // sum(shares)
    return [unit * s for s in shares]


def replica_slice(global_batch: int, dp: int, shares: tuple[int, ...] | list[int] | None,
                  dp_rank: int) -> tuple[int, int]:
    """(first row, rows) of replica `dp_rank` in the global batch; ValueError if the batch
    does not split (validation says so first, naming the key)."""
    total = sum(shares) if shares else dp
    if global_batch % total:
        raise ValueError(f"global_batch {global_batch} does not split into {total} equal "
                         f"parts (dp {dp}, shares {shares})")
    rows = replica_rows(global_batch, dp, shares)
    return sum(rows[:dp_rank]), rows[dp_rank]


def replica_batch(plan, dp_rank: int) -> tuple[int, int]:
    """(rows, micro-batch) of replica `dp_rank` of a ParallelPlan. With shares and no
    `parallel.micro_batch` the plan's micro_batch is the largest replica's rows, and each
    replica runs its own rows as one micro-batch."""
    _, rows = replica_slice(plan.global_batch, plan.dp, plan.dp_batch_shares, dp_rank)
    return rows, min(plan.micro_batch, rows)


def replica_plan(plan, dp_rank: int):
    """The even ParallelPlan that runs a step as replica `dp_rank` of `plan` does: every
    replica taking this one's rows in micro-batches of this one's size (the pipeline
    schedule's micro-batch count, message sizes); `plan` itself without shares. Its global
    batch is not `plan`'s: the loss still divides by the whole global batch's tokens."""
    if not plan.dp_batch_shares:
        return plan
    rows, micro = replica_batch(plan, dp_rank)
    return plan.replace(global_batch=rows * plan.dp, micro_batch=micro, dp_batch_shares=None)


def dp_rank_of(plan, rank: int) -> int:
    """The data-parallel replica of global rank `rank` (mesh axes pp, dp, cp, tp, outermost
    first: fivefold.parallel.mesh)."""
    return rank // (plan.cp * plan.tp) % plan.dp


def shares_text(plan) -> str:
    """E.g. "batch shares 2:1:1, micro-batches 4/2/2 of 2/2/2" for a ParallelPlan's replicas."""
    rows = replica_rows(plan.global_batch, plan.dp, plan.dp_batch_shares)
    micro = [min(plan.micro_batch, r) for r in rows]
    return (f"batch shares {':'.join(map(str, plan.dp_batch_shares))}, micro-batches "
            f"{'/'.join(str(r // m) for r, m in zip(rows, micro))} of "
            f"{'/'.join(map(str, micro))}")


def micro_batch_counts(p: ParallelConfig, dp: int) -> list[int]:
    """Micro-batches each replica runs per step."""
    rows = replica_rows(p.global_batch, dp, p.dp_batch_shares)
    return [r // (p.micro_batch or r) for r in rows]


def per_micro_batch_collectives(p: ParallelConfig, optimizer: str) -> str | None:
    """What in this layout communicates every micro-batch (so replicas must run the same
    number of them), or None."""
    if p.zero_stage >= 2:
        return f"ZeRO-{p.zero_stage} reduce-scatters gradients every micro-batch"
    if p.ep > 1:
        return "expert parallelism exchanges tokens every micro-batch"
    if optimizer in ("lomo", "galore"):
        return f"{optimizer} reduces gradients inside backward"
    return None


def check_batch_split(p: ParallelConfig, dp: int, dp_known: bool, optimizer: str) -> None:
    """ConfigError unless the global batch splits over the `dp` replicas as configured
    (`dp_known`: whether dp is the real degree, which a spec planned without a rank count
    may not give) and `parallel.micro_batch` divides each replica's rows."""
    shares = p.dp_batch_shares
    if shares is None:
        if p.global_batch % dp:
            raise ConfigError("parallel.global_batch", f"{p.global_batch} sequences do not "
                                                       f"split evenly over dp = {dp} ranks; "
                                                       f"use a multiple of {dp}")
    else:
        if not shares or min(shares) < 1:
            raise ConfigError(KEY, f"{shares} must list one positive integer per "
                                   "data-parallel replica (its share of the global batch)")
        if dp_known and len(shares) != dp:
            raise ConfigError(KEY, f"{len(shares)} shares for dp = {dp} replicas; give one "
                                   "share per data-parallel replica")
        if p.global_batch % sum(shares):
            raise ConfigError(KEY, f"shares {shares} sum to {sum(shares)}, which does not "
                                   f"divide parallel.global_batch = {p.global_batch}; use a "
                                   f"global batch that is a multiple of {sum(shares)}")
        dp = len(shares)
    rows = replica_rows(p.global_batch, dp, shares)
    if p.micro_batch is not None and any(r % p.micro_batch for r in rows):
        split = f"shares {shares}" if shares else f"/ dp {dp}"
        raise ConfigError("parallel.micro_batch", f"{p.micro_batch} does not divide the "
                                                  f"{'/'.join(map(str, sorted(set(rows))))} "
                                                  f"sequences per dp rank (global_batch "
                                                  f"{p.global_batch} {split})")
    counts = micro_batch_counts(p, dp)
    reason = per_micro_batch_collectives(p, optimizer)
    if len(set(counts)) > 1 and reason:
        raise ConfigError("parallel.micro_batch", f"the replicas would run {counts} "
                                                  f"micro-batches, but {reason}, so every "
                                                  "replica must run the same number: leave "
                                                  "parallel.micro_batch unset (one "
                                                  "micro-batch per replica)")
