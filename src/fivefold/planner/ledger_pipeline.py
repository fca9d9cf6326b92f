"""The pipeline's point-to-point messages of one step on one pp rank, predicted.

The executor (fivefold.parallel.pipeline.executor) runs its rank's action list of
fivefold.parallel.pipeline.schedules and records each send ("send", the buffer on the wire)
and each receive ("recv", no wire bytes) on the "pp" axis. The lists are data, so this
module walks the very same lists and sizes each message from the configuration:

  act, grad      a micro-batch's hidden states (rows x tokens of its slice x hidden) in the
                 compute dtype, one per (virtual stage boundary, micro-batch, slice);
                 "pp_activations" forward, "pp_grads" backward. With tensor parallelism
                 every tp rank sends to the rank of its own tp index: the full replica
                 without sequence parallelism, its tokens / tp sequence shard with it
                 (fivefold.parallel.pipeline.tensor_stage)
  tied weight    the embedding matrix (vocab x hidden; with tp this rank's ceil(vocab/tp)
                 rows), first rank -> last stage, once per step ("pp_tied_weight"), and its
                 head gradient back ("pp_tied_grads")

A message whose peer is this very rank (pp = 1) goes through a mailbox and is not recorded.

ZeRO-3 under a pipeline (`zero3_block_gathers`): the engine gathers a block when a pass uses
it and finds it freed, so how many all-gathers a step issues depends on the action list. The
same list is walked with the engine's rules: an F gathers each of the virtual stage's blocks
(and prefetches the rank's next one) and frees it after; a B or I gathers each block in
reverse (and prefetches the rank's previous one); a B or W frees a block once its gradients
are complete; an I leaves its blocks gathered for the W. With hpZ every backward gather
runs inside the node (ledger_model's `gather`): the block's secondary shard lives from its
first forward of the step to its last backward (fivefold.parallel.grad_sync.GatherAndFree).
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.models.description import is_moe_layer
from fivefold.parallel.pipeline import schedules as S
from fivefold.parallel.pipeline.partition import slice_bounds, stage_layer_ranges
from fivefold.parallel.plan import ParallelPlan

PURPOSES = {S.SEND_ACT: "pp_activations", S.RECV_ACT: "pp_activations",
            S.SEND_GRAD: "pp_grads", S.RECV_GRAD: "pp_grads",
            S.SEND_TIED_WEIGHT: "pp_tied_weight", S.RECV_TIED_WEIGHT: "pp_tied_weight",
            S.SEND_TIED_GRAD: "pp_tied_grads", S.RECV_TIED_GRAD: "pp_tied_grads"}


def pipeline_messages(cfg: Config, lay: ParallelPlan, pp_rank: int, elem_bytes: int
                      ) -> list[tuple[str, str, int]]:
    """(op, purpose, bytes) of every send and receive pp rank `pp_rank` makes in one step."""
    if lay.pp == 1:
        return []
    m = cfg.model
    schedule, _ = lay.pipeline_schedules(m.tied_embeddings)
    bounds = slice_bounds(m.seq_len // lay.cp, lay.slices)  # this cp rank's tokens
    table = -(-m.vocab // lay.tp) * m.hidden * elem_bytes  # this tp rank's vocabulary rows
    shards = lay.tp if lay.sequence_parallel else 1
    out = []
    for a in schedule.ranks[pp_rank]:
        if a.kind not in PURPOSES:
            continue
        if schedule.rank_of(S.peer_stage(a, schedule.stages)) == pp_rank:
            continue
        op = "send" if a.kind in S.SENDS else "recv"
        if a.kind in (S.SEND_TIED_WEIGHT, S.RECV_TIED_WEIGHT, S.SEND_TIED_GRAD,
                      S.RECV_TIED_GRAD):
            out.append((op, PURPOSES[a.kind], table))
        else:
            lo, hi = bounds[a.slice]
            out.append((op, PURPOSES[a.kind], lay.micro_batch * (hi - lo) // shards *
                        m.hidden * elem_bytes))
    return out


def stage_layers_of_rank(cfg: Config, lay: ParallelPlan, pp_rank: int
                         ) -> tuple[list[int], bool, bool]:
    """(blocks, holds the first stage, holds the last stage) of pp rank `pp_rank`: virtual
    stages pp_rank, pp_rank + pp, ... (ParallelPlan.stage_ids_of_rank)."""
    stages = lay.pp * lay.vpp
    ranges = stage_layer_ranges(cfg.model, stages, lay.stage_layers)
    ids = lay.stage_ids_of_rank(pp_rank)
    return [i for s in ids for i in ranges[s]], 0 in ids, stages - 1 in ids


def gradient_passes(cfg: Config, lay: ParallelPlan, pp_rank: int) -> list[int]:
    """Per non-expert unit of pp rank `pp_rank` (its root unit when it holds an end, then each
    block's), the backward passes that compute its gradients in one micro-batch, each of which
    ZeRO-2/3 reduce-scatters (fivefold.parallel.grad_sync.ShardedSync): 2 for a V schedule's
    first rank's root (the last stage's pass and stage 0's) and for an MoE block's under a
    split backward (I computes the MoE layer's weights, W the rest;
    fivefold.parallel.pipeline.split_backward), else 1."""
    layers, first, last = stage_layers_of_rank(cfg, lay, pp_rank)
    root = [2 if lay.v_shape and first and last else 1] if lay.pp == 1 or first or last else []
    return root + [2 if lay.split_backward and is_moe_layer(cfg.model, i) else 1
                   for i in layers]


def zero3_block_gathers(cfg: Config, lay: ParallelPlan, pp_rank: int) -> list[tuple[int, bool]]:
    """(position among the rank's blocks, backward) of each all-gather of block weights that
    ZeRO-3 issues on pp rank `pp_rank` in one step (fivefold.parallel.data_parallel)."""
    m = cfg.model
    schedule, _ = lay.pipeline_schedules(m.tied_embeddings)
    ranges = stage_layer_ranges(m, lay.pp * lay.vpp, lay.stage_layers)
    layers, _, _ = stage_layers_of_rank(cfg, lay, pp_rank)
    where = {layer: j for j, layer in enumerate(layers)}
    split_moe = {j for j, i in enumerate(layers) if lay.split_backward and is_moe_layer(m, i)}
    gathered, out, finished = [False] * len(layers), [], set()

    def gather(j: int, backward: bool) -> None:
        if 0 <= j < len(layers) and not gathered[j]:
            gathered[j] = True
            out.append((j, backward))

    for a in schedule.ranks[pp_rank]:
        if a.kind not in (S.F, S.B, S.I, S.W):
            continue
        blocks = [where[i] for i in ranges[a.stage]]
        if a.kind != S.F:  # an I that computed an MoE block's weights: reduced, freed now
            for j in finished:
                gathered[j] = False
            finished.clear()
        if a.kind == S.F:
            for j in blocks:
                gather(j, False)
                gather(j + 1, False)  # the prefetch
                gathered[j] = False
        elif a.kind in (S.B, S.I):
            for j in reversed(blocks):
                gather(j, True)
                gather(j - 1, True)  # the prefetch
                gathered[j] = gathered[j] and a.kind == S.I
                if a.kind == S.I and j in split_moe:
                    finished.add(j)
        else:
            for j in blocks:
                gathered[j] = False
    return out
