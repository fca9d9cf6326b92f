"""Prices of the op trace's ops: seconds of each op of `rank_trace` on one hardware profile.

The simulator's second part (docs/planner.md: a trace, prices, one scheduler), applied to
the ops fivefold.planner.op_trace lists instead of the block model's per-block lists. Every
price comes from the functions the block model prices with, on the profile as a training
step sustains it: `OpPrices` takes the block model's own LayoutStep (fivefold.planner.step),
whose profile has passed fivefold.planner.fitted.in_training and whose links and stack are
the block model's, so that the two predictions differ only in what they schedule.

  gemm          op_prices.gemm_time at the op's own (M, N, K) and dtype (a backward GEMM at
                its transposed shape, where the block model prices all three at the forward's)
  grouped_gemm  the same over all of the rank's routed rows (one kernel, as the block model
                prices the experts), the routed dimension at the busiest ep rank's load
                (block_cost.expert_load, as the block model times the experts)
  attention     SDPA by op_prices.attention_time at the kernel generation the stack runs on
                the profile's architecture (stack.attention_generation, kernel_tables.
                attention_rate); a TeraPipe slice after the first, whose kernel sees its T
                queries against S keys, as the causal square of S keys less that of the S - T
                earlier ones, with one launch
  ring-math     ring attention's blockwise GEMMs share op_prices.math_ring_attention_time's
                forward (or backward) of one block by their FLOPs: that function prices the
                math kernel's eager element-wise passes with its GEMMs, which the trace does
                not list apart
  elementwise   op_prices.eltwise_time of the op's HBM bytes, with compute.block_times' launches
                (12 forward, 24 backward per block) and passes (the stack's or the profile's
                eager passes, one under train.compile), the embedding's with embedding_times'
  collective    comm.collective_time of the op's bytes over its group placed on the mesh
                (`group_of`: block_cost's placement), the routed all-to-alls at the busiest
                ep rank's load; a send over the link between its two ends (a ring's over its
                whole group, as block_cost prices a ring step: its slowest link), a receive
                free (its transfer is the matching send)
  optimizer     the device's AdamW step over the op's elements at the traffic per element
                and the passes of the stack's update (update_bytes.eager_adamw_traffic:
                fivefold's unfused torch AdamW, not the trace's fused 28 bytes), the host's
                at the host tier's AdamW rate shared by the ranks on one host
                (fivefold.planner.offload)
  host_copy,    the host tier's link, and its drives shared by the ranks on one host
  disk_copy     (fivefold.planner.offload)
"""

from __future__ import annotations

import functools
import math

from fivefold.kernel_tables import attention_rate
from fivefold.parallel.context.heads import ulysses_kv_heads
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner import offload
from fivefold.planner.comm import Group, collective_time
from fivefold.planner.op_compute import DTYPE_BYTES, Op
from fivefold.planner.op_prices import (Gemm, attention_time, eltwise_time, gemm_time,
                                        math_ring_attention_time)
from fivefold.planner.update_bytes import eager_adamw_traffic

FORWARD_PHASES = ("forward", "recompute")
BLOCK_ELTWISE_LAUNCHES = {"forward": 12, "backward": 24}  # compute.block_times
EMBEDDING_LAUNCHES = {"forward": 1, "weight_grad": 2}  # compute.embedding_times
ROUTED = frozenset({"moe_dispatch", "moe_combine", "moe_dispatch_backward",
                    "moe_combine_backward"})  # expert_cost.moe_comm_s: at the busiest rank's load
DISK = {"moments from disk": "nvme_read_GBps", "moments to disk": "nvme_write_GBps"}


def mesh_axes(lay: ParallelPlan) -> dict[str, tuple[int, int]]:
    """(size, rank distance between neighbours) of each mesh axis a ledger record names:
    tp innermost, then cp (the hybrid's Ulysses ranks inside its ring), dp_shard,
    dp_replicate, pp (fivefold.parallel.mesh); the experts' grid etp, ep, then their edp
    ranks, sharded inside and replicated across (fivefold.expert_grid)."""
    ring, ulysses = lay.context_degrees
    t, c, zero, rep = lay.tp, lay.cp, lay.zero_group, lay.dp_replicate
    ep, etp, edp = lay.ep, lay.etp, lay.expert_data_parallel
    return {"tp": (t, 1), "cp": (c, t), "cp_ulysses": (ulysses, t), "cp_ring": (ring, t * ulysses),
            "dp_shard": (zero, t * c), "dp_replicate": (rep, t * c * zero),
            "pp": (lay.pp, lay.gpus // lay.pp), "etp": (etp, 1), "ep": (ep, etp),
            "edp": (edp, ep * etp), "edp_shard": (edp // rep, ep * etp),
            "edp_replicate": (rep, ep * etp * (edp // rep))}


def group_of(axis: str, size: int, mesh: dict[str, tuple[int, int]], gpus_per_node: int
             ) -> Group:
    """The Group of a record's `size` ranks on `axis` (adjacent mesh axes joined by "+",
    outermost first, so the last one is innermost and sets the stride; ZeRO++'s ".intra"
    node groups keep it, its ".inter" groups take one rank of each): block_cost._groups'
    placement, written for every axis the ledger names."""
    joined, _, level = axis.partition(".")
    parts = joined.split("+")
    stride = mesh[parts[-1]][1]
    if level == "inter":
        stride *= math.prod(mesh[p][0] for p in parts) // size
    return Group.strided(size, stride, gpus_per_node)


class OpPrices:
    """Seconds of the op trace's ops on LayoutStep `sm`'s sustained profile (module
    docstring)."""

    def __init__(self, sm):
        self.sm, self.prof, self.lay = sm, sm.prof, sm.lay
        self.mesh = mesh_axes(sm.lay)
        self.gpn = sm.cfg.cluster.gpus_per_node
        self.rate = attention_rate(self.prof.attention_generations,
                                   sm.stack.attention_generation(self.prof.architecture))
        self.load = sm.shard.expert_load
        self.passes = sm.shard.passes(self.prof)
        self.sharing = offload.sharing(sm)
        self.cache: dict[tuple, float] = {}

    def rank_seconds(self, ops: list[Op], pp_rank: int, pp_distance: dict[int, int]
                     ) -> list[float]:
        """Seconds of each op of pipeline rank `pp_rank`'s trace `ops`; `pp_distance`: per
        pipeline send (by index) the pp ranks between its two ends. Ring attention's GEMMs
        share their pass (one block's forward or backward, a run of them in the list) by
        FLOPs."""
        runs, flops, key = [], [], None
        for op in ops:
            if op.kernel == "ring-math":
                k = (op.name, op.phase in FORWARD_PHASES, op.micro_batch)
                if k != key:
                    flops.append(0.0)
                key = k
                flops[-1] += math.prod(op.shape)
            elif op.stream == "compute":
                key = None
            runs.append(len(flops) - 1)
        out = []
        for i, op in enumerate(ops):
            if op.kernel == "ring-math":
                fwd, bwd = self.ring_pass_s
                out.append((fwd if op.phase in FORWARD_PHASES else bwd)
                           * math.prod(op.shape) / flops[runs[i]])
            elif op.kind == "optimizer" and op.stream == "compute":
                out.append(self.device_update_s(op, pp_rank))
            else:
                out.append(self.seconds(op, pp_distance.get(i, 1)))
        return out

    def seconds(self, op: Op, pp_distance: int = 1) -> float:
        """One op's price (remembered per distinct op: a step repeats its blocks' ops)."""
        key = (op.kind, op.name, op.phase, op.shape, op.dtype, op.bytes, op.causal,
               op.kernel, op.axis, op.group, op.ragged, op.purpose, pp_distance)
        if key not in self.cache:
            self.cache[key] = self._seconds(op, pp_distance)
        return self.cache[key]

    def _seconds(self, op: Op, pp_distance: int) -> float:
        prof, e = self.prof, self.prof.eff
        if op.kind == "gemm":
            m, n, k, _ = op.shape
            return gemm_time(Gemm(op.name, m, k, n), prof, False, DTYPE_BYTES[op.dtype])
        if op.kind == "grouped_gemm":
            m, n, k, _ = op.shape
            m, k = (m * self.load, k) if op.ragged == "M" else (m, k * self.load)
            return gemm_time(Gemm(op.name, m, k, n), prof, False, DTYPE_BYTES[op.dtype])
        if op.kind == "attention":
            return self.attention_s(op)
        if op.kind == "elementwise":
            if op.name == "embedding":
                return eltwise_time(op.bytes, prof, EMBEDDING_LAUNCHES[op.phase], 1.0)
            return eltwise_time(op.bytes, prof, BLOCK_ELTWISE_LAUNCHES[op.phase], self.passes)
        if op.kind == "recv":
            return 0.0
        if op.kind in ("collective", "send"):
            return self.comm_s(op, pp_distance)
        host = prof.host
        if op.kind == "optimizer":  # offloaded: the host's AdamW, shared by its ranks
            return op.shape[0] * self.sharing / host.adam_elems_per_s
        if op.kind == "host_copy":
            return op.bytes / host.link_Bps
        if op.kind == "disk_copy":
            return op.bytes / (getattr(host, DISK[op.name]) * 1e9 / self.sharing)
        raise ValueError(f"no price for op kind {op.kind!r} ({op.name})")

    def attention_s(self, op: Op) -> float:
        """SDPA forward or backward (module docstring)."""
        b, heads, _, t, s, d = op.shape
        forward = op.phase in FORWARD_PHASES
        price = lambda keys: attention_time(b, heads, keys, d, 1, self.prof,
                                            precision=op.dtype, speedup=self.rate)
        seconds = price(s)[0 if forward else 1]
        if t == s:
            return seconds
        launches = self.prof.eff.kernel_overhead_s * (1 if forward else 3)
        return seconds - price(s - t)[0 if forward else 1] + launches

    def comm_s(self, op: Op, pp_distance: int) -> float:
        """A collective or send over its group (module docstring)."""
        nbytes = op.bytes * (self.load if op.purpose in ROUTED else 1.0)
        if op.kind == "send" and op.axis == "pp":
            group = Group.strided(2, self.mesh["pp"][1] * pp_distance, self.gpn)
        else:
            group = group_of(op.axis, op.group, self.mesh, self.gpn)
        return collective_time(op.kernel, nbytes, group, self.sm.links)

    @functools.cached_property
    def ring_pass_s(self) -> tuple[float, float]:
        """(forward s, backward s) of one block's ring attention on this rank: the math
        kernel over the ring's T / r tokens and the rank's heads (the hybrid's H / u)."""
        m, lay = self.sm.model, self.lay
        ring, ulysses = lay.context_degrees
        kv = max(1, m.n_kv_heads // lay.tp)
        if ulysses > 1:
            kv = max(1, ulysses_kv_heads(kv, ulysses) // ulysses)
        return math_ring_attention_time(lay.micro_batch, m.heads // lay.tp // ulysses, kv,
                                        m.seq_len, m.d_head, ring, self.prof)

    def device_update_s(self, op: Op, pp_rank: int) -> float:
        """The device's AdamW step over the op's elements at the stack's update traffic per
        element (fivefold's unfused torch AdamW: update_bytes.eager_adamw_traffic over the
        rank's device units) and its passes: the block model's traffic for the rank's
        units, scaled to the op's element count."""
        lay = self.lay
        units = offload.device_units(self.sm.rank_units(pp_rank), lay)
        local = sum(u.shard_numel if lay.zero_stage >= 1 else u.padded for u in units)
        traffic, launches = eager_adamw_traffic(units, lay, self.sm.cfg.train.weight_decay)
        return eltwise_time(traffic * op.shape[0] / local, self.prof, launches, 1.0)
