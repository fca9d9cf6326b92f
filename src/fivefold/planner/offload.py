"""The step time and host memory of optimizer offload (`parallel.offload`), per rank.

ZeRO-Offload (arXiv 2101.06840, Sec. 4-5) keeps fp32 masters and Adam's moments in host
memory and runs the step on the CPU; ZeRO-Infinity (arXiv 2104.07857, Sec. 5-6) moves the
moments on to NVMe and streams them through the CPU step in chunks. What lives where is
fivefold.planner.memory's table (the offloaded units are the prefix ParallelPlan.
offloaded_units picks); this file prices the transfers and the CPU step on the profile's
host tier (fivefold.hardware.HostTier) and overlaps them as the runtime does
(fivefold.memory.offload):

1. Gradient download. Each offloaded unit's gradient shard (in the dtype the device holds it:
   the compute dtype at ZeRO 0-1, the reduce dtype at 2-3) crosses the host link once
   reduced; backward reduces the units in reverse order, so block u's gradient is ready when
   the backward of the blocks before it (in forward order) is still to run, the root's at the
   end of backward. The link carries one transfer at a time.
2. CPU step. The background thread steps the offloaded units one by one in forward order at
   this rank's share of the host's CPU AdamW rate (HostTier.adam_elems_per_s over the ranks
   sharing the host), each once its gradient is on the host. Nothing of the step overlaps
   backward: with gradient clipping (train.grad_clip > 0) the clipping factor needs the
   global norm, which exists only after the last backward, and in forward order the first
   unit (the root, or a middle stage's first block) is the last whose gradient completes,
   so also without clipping the thread cannot start earlier. Only the downloads overlap.
3. nvme: each unit's moments are read (8 B per element) and written back (8 B) in chunks of
   CHUNK_ELEMENTS while the CPU updates the chunk between them, so a unit takes the larger
   of its disk time (at this rank's share of the host's drives) and its CPU time, not their
   sum, plus one chunk's read and write (the pipeline's fill and drain; the whole unit when
   it is smaller than a chunk).
4. Parameter upload. A stepped unit's updated compute copy (the compute dtype) crosses the
   link back, in order.
5. The next step's forward waits per unit: unit u's forward (of the first micro-batch) starts
   when the previous unit's forward is done and u's parameters are back. What the forward
   loses to that waiting is the exposed offload time; the rest hides behind the forward.

Time 0 is the end of the last backward; the forward could start at `forward_start_s` (the
gradient synchronisation tail and the device's own step for the units kept on it). Not
modelled: the ZeRO-1/2 all-gather of updated parameters waiting for their upload, a CPU
device's step competing with its own compute (on a CPU profile host and device are one
machine), and contention of the host link between ranks behind one PCIe switch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.hardware import HostTier
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner.memory import Unit, model_state_bytes
from fivefold.planner.params import block_params, root_params

MOMENT_BYTES = 8  # exp_avg and exp_avg_sq, fp32
CHUNK_ELEMENTS = 1 << 16  # elements per streamed chunk: fivefold.memory.nvme_store's


@dataclass(frozen=True)
class UnitWork:
    """One offloaded unit on one rank: its shard elements, the forward seconds of the first
    micro-batch that wait for it, and the backward seconds that run before its gradient is
    ready (counted back from the end of backward)."""

    numel: int
    forward_s: float
    grad_ready_s: float  # <= 0: seconds before the end of backward


@dataclass(frozen=True)
class OffloadTimes:
    """Seconds of one rank's offloaded step: the totals of each resource and what shows."""

    download_s: float
    cpu_s: float
    disk_s: float
    upload_s: float
    exposed_s: float  # what the next forward waits, beyond its own time


def ranks_on_host(host: HostTier, gpus: int, gpus_per_node: int) -> int:
    """Ranks of a layout that share one host's memory, drives and CPU."""
    return max(1, min(host.gpus, gpus, gpus_per_node))


def offload_times(work: list[UnitWork], tier: str, host: HostTier, sharing: int,
                  grad_bytes: int, param_bytes: int,
                  forward_start_s: float = 0.0) -> OffloadTimes:
    """The module docstring's model for one rank's offloaded units `work` (forward order)
    on `host`, shared by `sharing` ranks; 0 for everything without offloaded units."""
    if tier == "none" or not work:
        return OffloadTimes(0.0, 0.0, 0.0, 0.0, 0.0)
    link = host.link_Bps
    down = [w.numel * grad_bytes / link for w in work]
    up = [w.numel * param_bytes / link for w in work]
    cpu = [w.numel * sharing / host.adam_elems_per_s for w in work]
    disk = fill = [0.0] * len(work)
    if tier == "nvme":
        read = host.nvme_read_GBps * 1e9 / sharing
        write = host.nvme_write_GBps * 1e9 / sharing
        per_element = MOMENT_BYTES / read + MOMENT_BYTES / write
        disk = [w.numel * per_element for w in work]
        fill = [min(w.numel, CHUNK_ELEMENTS) * per_element for w in work]
    on_host = [0.0] * len(work)
    link_free = float("-inf")
    for u in reversed(range(len(work))):  # backward reduces the units in reverse order
        link_free = max(link_free, work[u].grad_ready_s) + down[u]
        on_host[u] = link_free
    cpu_free = link_back = float("-inf")
    forward_end = forward_start_s
    for u, w in enumerate(work):
        cpu_free = max(on_host[u], cpu_free) + max(cpu[u], disk[u]) + fill[u]
        link_back = max(link_back, cpu_free) + up[u]
        forward_end = max(forward_end, link_back) + w.forward_s
    exposed = max(0.0, forward_end - forward_start_s - sum(w.forward_s for w in work))
    return OffloadTimes(sum(down), sum(cpu), sum(disk) + sum(fill), sum(up), exposed)


def rank_work(sm, rank: int) -> list[UnitWork]:
    """The offloaded units of pipeline rank `rank` of StepModel `sm` (fivefold.planner.
    simulate), in the engine's order (fivefold.planner.memory.stage_units: the root when the
    stage has one, then each block's unit and, with ep > 1, its experts' unit), with the
    simulator's per-block forward and backward seconds. A block's forward waits for all its
    units, so it is charged to the last of them; the root's is the embedding's (the head
    runs after every block)."""
    lay, m = sm.lay, sm.model
    first, last = rank == 0, rank == lay.pp - 1
    units = sm.rank_units(rank)
    local = [u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units]
    forward, backward = [], []
    if root_params(m, lay.tp, first, last):
        forward.append(sm.embedding.fwd if first else 0.0)
        backward.append(0.0)
    for i in sm.rank_layers(rank):
        cost = sm.layer_cost(i)
        if lay.ep > 1 and block_params(m, i, lay.tp, lay.ep)[1]:
            forward.append(0.0)
            backward.append(0.0)
        forward.append(cost.f)
        backward.append(cost.b)
    ready, work = 0.0, []
    for numel, f, b in zip(local[:lay.offloaded_units(local)], forward, backward):
        work.append(UnitWork(numel, f, ready))
        ready -= b  # the blocks before the next unit still run their backward after it
    return work


def device_units(units: list[Unit], lay: ParallelPlan) -> list[Unit]:
    """The units whose optimizer step stays on the device: those after the offloaded
    prefix."""
    local = [u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units]
    return units[lay.offloaded_units(local):]


def rank_offload(sm, rank: int, forward_start_s: float) -> OffloadTimes:
    """`offload_times` of pipeline rank `rank` of StepModel `sm`; the forward could start
    `forward_start_s` after the last backward."""
    lay = sm.lay
    grad_bytes = PRECISION_BYTES[lay.reduce_dtype] if lay.zero_stage >= 2 else sm.a
    return offload_times(rank_work(sm, rank), lay.offload, sm.prof.host, sharing(sm),
                         grad_bytes, sm.a, forward_start_s)


def sharing(sm) -> int:
    """Ranks of StepModel `sm`'s layout that share one host."""
    return ranks_on_host(sm.prof.host, sm.lay.gpus, sm.cfg.cluster.gpus_per_node)


def offload_summary(sm, times: OffloadTimes) -> dict | None:
    """The `offload` table of simulate's output (None without offload): the tier, the
    fraction, host bytes per rank and per host against the host's memory, disk bytes per
    rank, and the critical rank's seconds."""
    lay = sm.lay
    if lay.offload == "none":
        return None
    states = [model_state_bytes(sm.rank_units(r), lay) for r in range(lay.pp)]
    host = max(s["host"] for s in states)
    per_host = host * sharing(sm)
    return {"tier": lay.offload, "fraction": lay.offload_fraction,
            "host_bytes_per_gpu": host, "host_bytes_per_host": per_host,
            "host_memory_bytes": sm.prof.host.memory_bytes,
            "host_fits": per_host <= sm.prof.host.memory_bytes,
            "disk_bytes_per_gpu": max(s["disk"] for s in states),
            "download_s": times.download_s, "cpu_step_s": times.cpu_s,
            "disk_s": times.disk_s, "upload_s": times.upload_s,
            "exposed_s": times.exposed_s}
