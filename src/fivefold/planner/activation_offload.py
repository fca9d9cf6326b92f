"""Activation offload (`parallel.offload_activations`), predicted: which blocks' saved bytes
leave the device, what the host holds, and what the copies cost.

The runtime (fivefold.memory.activation_offload; Megatron-Core's cpu_offloading_num_layers,
PyTorch's save_on_cpu) keeps the saved tensors of the first `offload_activations` blocks of
each pipeline stage in host memory between forward and backward. The bytes are the blocks'
own saved bytes (fivefold.planner.activations.block_saved_bytes: the runtime copies each
saved storage once and leaves parameters and buffers where they are, so the same count):

* device: the stage's activations per micro-batch drop by the offloaded blocks' bytes;
* host: those bytes, once per micro-batch in flight on the rank (the schedule's peak, as
  on the device), per rank; the ranks sharing a host (HostTier.gpus) add up against its
  memory beside optimizer offload's state.

Time, stated simply: each offloaded block's bytes cross the host link twice per micro-batch,
device to host in forward and back in backward, at HostTier.link_Bps (one direction's
pinned-copy rate; the two directions are separate). The copies run on the "host" stream,
which does not contend with compute, so the forward's copies cost nothing (the device
memory is freed when each copy ends; not modelled). In backward the returns are issued when
the stage's backward of that micro-batch starts, the last offloaded block's first, one
after another, and a block's backward waits for its own activations: what it waits is added
to the stage's backward time (`backward_wait_s`), which the pipeline replay then carries.
Not modelled: the link shared with optimizer offload's copies, and a forward that outruns
its copies (the device would hold those bytes until they land). This is Megatron-Core's
behaviour (copies on a side stream, the return prefetched). fivefold's runtime issues its
copies on the current stream and each return when backward unpacks it (docs/memory.md), so
under the fivefold stack (Stack.offload_copies_inline) every copy adds to its pass:
`inline_copy_s` to the forward and to the backward of each micro-batch.
"""

from __future__ import annotations

from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.offload import ranks_on_host


def offloaded_layers(lay: ParallelPlan, layers) -> list[int]:
    """The blocks of one stage (its `layers`, in order) whose saved tensors go to the host
    (none without activation offload, at no cost: the planner asks for every stage it
    prices)."""
    return list(layers)[:lay.offload_activations] if lay.offload_activations else []


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
    offloaded per stage, the largest host bytes of one rank, per host against the host's
    memory, and per micro-batch the bytes each way, the copy seconds each way, what the
    copies add to the forward (inline copies only) and the backward's wait, on the rank where
    they are largest."""
    lay = sm.lay
    if not lay.offload_activations:
        return None
    per_rank = [sum(sm.block_saved_bytes(i) for i in offloaded_layers(lay, sm.stage_ranges[r]))
                for r in range(lay.pp)]
    host = max(b * k for b, k in zip(per_rank, inflight))
    sharing = ranks_on_host(sm.prof.host, lay.gpus, sm.cfg.cluster.gpus_per_node)
    moved = max(per_rank)
    return {"blocks_per_stage": lay.offload_activations, "host_bytes_per_gpu": host,
            "host_bytes_per_host": host * sharing,
            "host_memory_bytes": sm.prof.host.memory_bytes,
            "host_fits": host * sharing <= sm.prof.host.memory_bytes,
            "bytes_each_way_per_micro_batch": moved,
            "copy_s_each_way_per_micro_batch": moved / sm.prof.host.link_Bps,
            "forward_copy_s_per_micro_batch": max(sm.offload_copy_s(r)[0]
                                                  for r in range(lay.pp)),
            "backward_wait_s_per_micro_batch": max(sm.offload_copy_s(r)[1]
                                                   for r in range(lay.pp))}
