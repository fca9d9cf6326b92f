"""Activation offload (`parallel.offload_activations`), predicted: which blocks' saved bytes
leave the device, what the host holds, and what the copies cost.

The runtime (fivefold.memory.activation_offload; Megatron-Core's cpu_offloading_num_layers,
PyTorch's save_on_cpu) keeps the saved tensors of the first `offload_activations` blocks of
each virtual stage in host memory between forward and backward: of each pipeline stage, and
under vpp > 1 of each of a rank's model chunks (fivefold.parallel.parallelize.
offloaded_blocks says why). The bytes are the blocks' own saved bytes
(fivefold.planner.activations.block_saved_bytes: the runtime copies each saved storage once
and leaves parameters and buffers where they are, so the same count):

* device: each virtual stage's activations per micro-batch drop by its offloaded blocks'
  bytes (the replay weighs each chunk's in-flight micro-batches by them);
* host: those bytes, once per micro-batch in flight, per rank: without virtual stages the
  rank's offloaded bytes times the schedule's peak in-flight count, as on the device; under
  vpp the peak over the rank's action list of the in-flight (chunk, micro-batch) units,
  each weighed by its chunk's offloaded bytes (`host_peak_bytes`: the chunks hold different
  counts at the peak). The ranks sharing a host (HostTier.gpus) add up against its memory
  beside optimizer offload's state.

Time, stated simply: each offloaded block's bytes cross the host link twice per micro-batch,
device to host in forward and back in backward (under vpp in each chunk's own passes), at
HostTier.link_Bps (one direction's pinned-copy rate; the two directions are separate). The
copies run on the "host" stream, which does not contend with compute, so the forward's
copies cost nothing (the device memory is freed when each copy ends; not modelled). In
backward the returns are issued when the stage's (chunk's) backward of that micro-batch
starts, the last offloaded block's first, one after another, and a block's backward waits
for its own activations: what it waits is added to the stage's backward time
(`backward_wait_s`), which the pipeline replay then carries.
Not modelled: the link shared with optimizer offload's copies, and a forward that outruns
its copies (the device would hold those bytes until they land). This is Megatron-Core's
behaviour (copies on a side stream, the return prefetched). fivefold's runtime issues its
copies on the current stream and each return when backward unpacks it (docs/memory.md), so
under the fivefold stack (Stack.offload_copies_inline) every copy adds to its pass:
`inline_copy_s` to the forward and to the backward of each micro-batch.
"""

from __future__ import annotations

from fivefold.parallel.pipeline import replay as runtime_replay
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.offload import ranks_on_host
from fivefold.planner.schedules import runtime_schedule


def offloaded_layers(lay: ParallelPlan, layers) -> list[int]:
    """The blocks of one virtual stage (its `layers`, in order) whose saved tensors go to the
    host (none without activation offload, at no cost: the planner asks for every stage it
    prices)."""
    return list(layers)[:lay.offload_activations] if lay.offload_activations else []


def rank_offloaded_layers(lay: ParallelPlan, ranges: list[range], pp_rank: int) -> list[int]:
    """The offloaded blocks of pipeline rank `pp_rank`: each of its chunks' first ones
    (`ranges`: the blocks of every virtual stage)."""
    return [i for g in lay.stage_ids_of_rank(pp_rank) for i in offloaded_layers(lay, ranges[g])]


def host_peak_bytes(lay: ParallelPlan, stage_bytes: list[float], inflight: list[int]
                    ) -> list[float]:
    """Per pipeline rank, the most offloaded bytes its host memory holds at once;
    `stage_bytes`: one micro-batch's offloaded bytes of each virtual stage, `inflight`: each
    rank's peak in-flight micro-batches (used without virtual stages, where every unit
    in flight weighs the same). Under vpp the rank's action list is walked with each
    (chunk, micro-batch) unit weighed by its chunk's bytes."""
    if lay.vpp == 1 or lay.pp == 1:
        return [sum(stage_bytes[g] for g in lay.stage_ids_of_rank(r)) * k
                for r, k in zip(range(lay.pp), inflight)]
    sched = runtime_schedule(lay.schedule, lay.pp, lay.vpp, lay.micro_batches)
    return runtime_replay.peak_in_flight(sched, lambda g: stage_bytes[g])


def backward_wait_s(blocks: list[tuple[float, float]], before_s: float,
                    link_Bps: float) -> float:
    """Seconds a stage's backward of one micro-batch waits for offloaded activations.
    `blocks`: (saved bytes, backward seconds) of its offloaded blocks in forward order;
    `before_s`: the backward seconds it runs before reaching them (the head's and the
    blocks after them). The returns start at the backward's start, last block first."""
    returned = waited = 0.0
    t = before_s  # when the next block's backward could start
    for nbytes, b in reversed(blocks):
        returned += nbytes / link_Bps
        waited += max(0.0, returned - t)
        t = max(t, returned) + b
    return waited


def inline_copy_s(block_bytes: list[float], link_Bps: float) -> float:
    """Seconds the copies of one micro-batch's offloaded blocks (`block_bytes`, saved bytes
    each) add to one pass when they queue with compute: one direction of the host link."""
    return sum(block_bytes) / link_Bps


def activation_offload_summary(sm, inflight: list[int]) -> dict | None:
    """The `activation_offload` table of simulate's output (None without it), for
    LayoutStep `sm` whose pipeline ranks hold up to `inflight[r]` micro-batches: blocks
    offloaded per virtual stage (each chunk's under vpp), the largest host bytes of one rank
    (`host_peak_bytes`), per host against the host's memory, and per micro-batch (through
    all of a rank's chunks) the bytes each way, the copy seconds each way, what the copies
    add to the forward (inline copies only) and the backward's wait, on the rank where they
    are largest."""
    lay = sm.lay
    if not lay.offload_activations:
        return None
    stage_bytes = [sum(sm.block_saved_bytes(i) for i in offloaded_layers(lay, layers))
                   for layers in sm.stage_ranges]
    ranks = [lay.stage_ids_of_rank(r) for r in range(lay.pp)]
    host = max(host_peak_bytes(lay, stage_bytes, inflight))
    sharing = ranks_on_host(sm.prof.host, lay.gpus, sm.cfg.cluster.gpus_per_node)
    moved = max(sum(stage_bytes[g] for g in ids) for ids in ranks)  # all of a rank's chunks
    copies = [[sm.offload_copy_s(g) for g in ids] for ids in ranks]
    return {"blocks_per_stage": lay.offload_activations, "host_bytes_per_gpu": host,
            "host_bytes_per_host": host * sharing,
            "host_memory_bytes": sm.prof.host.memory_bytes,
            "host_fits": host * sharing <= sm.prof.host.memory_bytes,
            "bytes_each_way_per_micro_batch": moved,
            "copy_s_each_way_per_micro_batch": moved / sm.prof.host.link_Bps,
            "forward_copy_s_per_micro_batch": max(sum(f for f, _ in c) for c in copies),
            "backward_wait_s_per_micro_batch": max(sum(b for _, b in c) for c in copies)}
