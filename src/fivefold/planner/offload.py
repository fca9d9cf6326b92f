"""The step time and host memory of optimizer offload (`parallel.offload`), per rank.

ZeRO-Offload (arXiv 2101.06840, Sec. 4-5) keeps fp32 masters and Adam's moments in host
memory and runs the step on the CPU; ZeRO-Infinity (arXiv 2104.07857, Sec. 5-6) moves the
moments on to NVMe and streams them through the CPU step in chunks. What lives where is
fivefold.planner.memory's table (the offloaded units are the prefix ParallelPlan.
offloaded_units picks); this file prices the transfers and the CPU step on the profile's
host tier (fivefold.hardware.HostTier) and overlaps them as the runtime does
(fivefold.memory.offload):

1. Gradient download. After the last backward the engine copies each offloaded unit's
   reduced gradient shard (in the dtype the device holds it: the compute dtype at ZeRO 0-1,
   the reduce dtype at 2-3) into its host buffer, unit by unit in forward order, on the
   training thread (fivefold.parallel.data_parallel's after_backward): these copies are
   exposed.
2. Clipping (train.grad_clip > 0). The global norm reads the offloaded gradients where they
   now are, on the host, and scales them in place: CLIP_BYTES per element of host memory
   traffic, on the training thread, at this rank's share of the host's memory bandwidth
   (HostTier.memory_GBps x STREAM_EFF). The norm needs every gradient, so nothing of the
   step overlaps backward; without clipping the step still starts here, after the
   downloads.
3. CPU step. One background thread then steps the units in forward order at this rank's
   share of the host's CPU AdamW rate (HostTier.adam_elems_per_s over the ranks sharing the
   host) and copies each updated master back to the device's compute copy (in the compute
   dtype) before the next unit (fivefold.memory.offload), while the training thread goes on
   with the device's own step for the units kept there and the parameter re-gathers.
4. nvme: each unit's moments are read (8 B per element) and written back (8 B) in chunks of
   CHUNK_ELEMENTS while the CPU updates the chunk between them, so a unit takes the larger
   of its disk time (at this rank's share of the host's drives) and its CPU time, not their
   sum, plus one chunk's read and write (the pipeline's fill and drain; the whole unit when
   it is smaller than a chunk).
5. The next step's forward waits per unit: unit u's forward (of the first micro-batch) starts
   when the previous unit's forward is done and u's update is back. What the forward loses
   to that waiting, with the downloads and the clipping, is the exposed offload time; the
   rest of the CPU step hides behind the forward.

Time 0 is the end of the last backward's gradient synchronisation; after the downloads and
the clipping the training thread is busy `device_s` more (the device's step of the units it
keeps, the ZeRO-1/2 re-gathers) before the forward can start. Not modelled: the re-gather of
an offloaded unit waiting for its update (the runtime issues it in the forward's pre-hook),
the nvme store's commit (fsync and manifest, waited at the next step's submit), links
shared behind one PCIe switch, and (on a CPU profile) the CPU step competing with the CPU's
own compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.hardware import STREAM_EFF, HostTier
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner.memory import Unit, model_state_bytes
from fivefold.planner.params import root_params

MOMENT_BYTES = 8  # exp_avg and exp_avg_sq, fp32
CHUNK_ELEMENTS = 1 << 16  # elements per streamed chunk: nvme_store's (a test holds them equal)
CLIP_BYTES = 12  # the norm reads the fp32 gradient (4 B), the scaling reads and writes it (8 B)


@dataclass(frozen=True)
class UnitWork:
    """One offloaded unit on one rank: its shard elements and the forward seconds (of the
    next step's first micro-batch) that wait for its update."""

    numel: int
    forward_s: float


@dataclass(frozen=True)
class OffloadTimes:
    """Seconds of one rank's offloaded step: the totals of each resource and what shows."""

    download_s: float
    clip_s: float
    cpu_s: float
    disk_s: float
    upload_s: float
    exposed_s: float  # downloads, clipping and what the next forward waits for the thread


def ranks_on_host(host: HostTier, gpus: int, gpus_per_node: int) -> int:
    """Ranks of a layout that share one host's memory, drives and CPU."""
    return max(1, min(host.gpus, gpus, gpus_per_node))


def offload_times(work: list[UnitWork], tier: str, host: HostTier, sharing: int,
                  grad_bytes: int, param_bytes: int, clip: bool,
                  device_s: float = 0.0) -> OffloadTimes:
    """The module docstring's model for one rank's offloaded units `work` (forward order)
    on `host`, shared by `sharing` ranks; 0 for everything without offloaded units."""
    if tier == "none" or not work:
        return OffloadTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    link = host.link_Bps
    numel = sum(w.numel for w in work)
    download = numel * grad_bytes / link
    clip_s = (numel * CLIP_BYTES * sharing / (host.memory_GBps * 1e9 * STREAM_EFF)
              if clip else 0.0)
    up = [w.numel * param_bytes / link for w in work]
    cpu = [w.numel * sharing / host.adam_elems_per_s for w in work]
    disk = fill = [0.0] * len(work)
    if tier == "nvme":
        read = host.nvme_read_GBps * 1e9 / sharing
        write = host.nvme_write_GBps * 1e9 / sharing
        per_element = MOMENT_BYTES / read + MOMENT_BYTES / write
        disk = [w.numel * per_element for w in work]
        fill = [min(w.numel, CHUNK_ELEMENTS) * per_element for w in work]
    thread = 0.0  # from the submit, after downloads and clipping
    forward_end = device_s
    for u, w in enumerate(work):
        thread += max(cpu[u], disk[u]) + fill[u] + up[u]
        forward_end = max(forward_end, thread) + w.forward_s
    waits = max(0.0, forward_end - device_s - sum(w.forward_s for w in work))
    return OffloadTimes(download, clip_s, sum(cpu), sum(disk) + sum(fill), sum(up),
                        download + clip_s + waits)


def rank_work(sm, rank: int) -> list[UnitWork]:
    """The offloaded units of pipeline rank `rank` of LayoutStep `sm` (fivefold.planner.
    step), in the engine's order (fivefold.planner.memory.stage_units: the root when the
    stage has one, then each block's unit and, where they are apart, its experts' unit), with the
    simulator's per-block forward seconds. A block's forward waits for all its
    units, so it is charged to the last of them; the root's is the embedding's (the head
    runs after every block)."""
    lay, m = sm.lay, sm.model
    first, last = lay.ends_of_rank(rank)
    units = sm.rank_units(rank)
    local = [u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units]
    forward = []
    if root_params(m, lay.tp, first, last):
        forward.append(sm.embedding.fwd if first else 0.0)
    expert_after = [u.expert for u in units[1:]] + [False]  # units[k + 1] are experts
    for i in sm.rank_layers(rank):
        if expert_after[len(forward)]:  # the block's dense unit, then its experts'
            forward.append(0.0)
        forward.append(sm.layer_cost(i).f)
    return [UnitWork(n, f) for n, f in zip(local[:lay.offloaded_units(local)], forward)]


def device_units(units: list[Unit], lay: ParallelPlan) -> list[Unit]:
    """The units whose optimizer step stays on the device: those after the offloaded
    prefix."""
    local = [u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units]
    return units[lay.offloaded_units(local):]


def work_offload(sm, work: list[UnitWork], device_s: float) -> OffloadTimes:
    """`offload_times` of the offloaded units `work` of one rank of LayoutStep `sm`'s layout,
    whose training thread spends `device_s` on the device's step and re-gathers before the
    next forward."""
    lay = sm.lay
    grad_bytes = PRECISION_BYTES[lay.reduce_dtype] if lay.zero_stage >= 2 else sm.a
    return offload_times(work, lay.offload, sm.prof.host, sharing(sm), grad_bytes, sm.a,
                         sm.cfg.train.grad_clip > 0, device_s)


def rank_offload(sm, rank: int, device_s: float) -> OffloadTimes:
    """`work_offload` of pipeline rank `rank`'s own units."""
    return work_offload(sm, rank_work(sm, rank), device_s)


def sharing(sm) -> int:
    """Ranks of LayoutStep `sm`'s layout that share one host."""
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
            "download_s": times.download_s, "clip_s": times.clip_s,
            "cpu_step_s": times.cpu_s,
            "disk_s": times.disk_s, "upload_s": times.upload_s,
            "exposed_s": times.exposed_s}
