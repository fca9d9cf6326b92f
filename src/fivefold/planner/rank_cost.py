"""What a pipeline rank does after its last backward: the data-parallel gradient
synchronisation that did not hide behind that backward, the parameter re-gather that follows
the optimizer (ZeRO-1/2), and the optimizer step itself.

DDP / ZeRO-1/2 (arXiv 2006.15704): a block's gradient bucket is reduced as soon as its
backward ends, on one "dp" stream, in the order the blocks finish (PyTorch DDP's buckets;
Megatron-Core's overlap_grad_reduce, one set of buckets per model chunk). Within a virtual
stage's last gradient action (from the replayed schedule) its blocks complete their
gradients in reverse order, evenly spread: each is a compute op at the replay's clock, its
bucket's reduction waits for it, and the scheduler (fivefold.planner.events) runs them, so
under the interleaved schedule a chunk whose last backward comes early reduces behind the
later chunks' backward. The root unit (embeddings, reduced last) follows every bucket.
"""

from __future__ import annotations

from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner import offload
from fivefold.planner.events import COMPUTE, Op, schedule
from fivefold.planner.matrix_update import matrix_update_time
from fivefold.planner.memory import Unit, stage_units
from fivefold.planner.muon_cost import muon_step_s
from fivefold.planner.params import root_params
from fivefold.planner.stage_cost import StageCosts
from fivefold.planner.update_bytes import eager_adamw_traffic


class RankCosts(StageCosts):
    """`StageCosts` with each rank's step tail (module docstring)."""

    def rank_layers(self, rank: int) -> list[int]:
        return [i for g in self.lay.stage_ids_of_rank(rank)
                for i in self.stage_ranges[g]]

    def rank_units(self, rank: int, lay: ParallelPlan | None = None):
        """Pipeline rank `rank`'s model-state units under `lay` (default the layout's)."""
        lay = lay or self.lay
        return stage_units(self.model, lay, self.rank_layers(rank), *lay.ends_of_rank(rank),
                           etp=self.etp)

    def dp_sync(self, rank: int, last_grads: dict[int, tuple[float, float]]
                ) -> tuple[float, float]:
        """(gradient-sync seconds after the last backward, parameter re-gather after the
        optimizer) of pipeline rank `rank`, whose virtual stages' last gradient actions span
        `last_grads` (stage -> (start, end), Replay.last_grads)."""
        lay = self.lay
        layers = self.rank_layers(rank)
        first, last = lay.ends_of_rank(rank)
        root = root_params(self.model, lay.tp, first, last)
        p, g = self.a, PRECISION_BYTES[lay.reduce_dtype]
        tail = 0.0
        if lay.zero_stage <= 1:
            op = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
            tail = self.grad_sync_tail_s(rank, op, last_grads, self.root_sync_s(rank, op))
        elif lay.zero_stage >= 2:  # the root's reduce-scatter ends the last backward
            tail = self._coll("reduce_scatter", root * g, self.shard_group)
        if lay.zero_stage >= 1 and self.replicate_group.size > 1:
            shard_n, expert_n = self.shard_group.size, self.expert_shard_group.size
            costs = [self.layer_cost(i) for i in layers]
            tail += sum(self._coll("all_reduce", c.grad_sync_bytes / shard_n
                                   + c.expert_sync_bytes / expert_n, self.replicate_group)
                        for c in costs)
            tail += self._coll("all_reduce", root * g / shard_n, self.replicate_group)
            tail += self._coll("all_reduce", 4, self.shard_group)
        regather = 0.0
        if lay.zero_stage in (1, 2):
            scale = self.regather_scale
            regather = (sum(self.block_sync_s("all_gather", i, scale) for i in layers)
                        + self._coll("all_gather", root * p, self.shard_group))
        return tail, regather

    def root_sync_s(self, rank: int, op: str) -> float:
        """Seconds of rank `rank`'s root unit's data-parallel collective `op` (DDP, ZeRO-1)."""
        root = root_params(self.model, self.lay.tp, *self.lay.ends_of_rank(rank))
        return self._coll(op, root * self.a, self.shard_group)

    def grad_sync_ops(self, rank: int, op: str, last_grads: dict[int, tuple[float, float]],
                      root_s: float = 0.0) -> list[Op]:
        """Rank `rank`'s last gradient actions as per-block compute slices at the replay's
        clock, each block's bucket reduction `op` after its slice, the root's after all
        (module docstring). Between two virtual stages' last actions the rank runs other
        actions (other micro-batches' backward), compute that the reductions contend with."""
        slices = []
        for g in self.lay.stage_ids_of_rank(rank):
            start, end = last_grads[g]
            blocks = self.stage_ranges[g][::-1]
            width = (end - start) / len(blocks) if blocks else 0.0
            slices += [(start + k * width, width, i) for k, i in enumerate(blocks)]
        ops: list[Op] = []
        computed: tuple[int, ...] = ()
        clock = None
        for at, width, i in sorted(slices):
            if clock is not None and at > clock:  # the replay's other actions between them
                ops.append(Op("other actions", COMPUTE, at - clock, computed, clock))
                computed = (len(ops) - 1,)
            clock = at + width
            ops.append(Op(f"backward {i}", COMPUTE, width, computed, not_before=at))
            computed = (len(ops) - 1,)
            ops.append(Op(f"reduce {i}", "dp", self.block_sync_s(op, i), computed))
        ops.append(Op("reduce root", "dp", root_s, computed))
        return ops

    def grad_sync_tail_s(self, rank: int, op: str, last_grads: dict[int, tuple[float, float]],
                         root_s: float = 0.0) -> float:
        """Seconds from the end of rank `rank`'s last gradient action in the replay to the end
        of its gradient reductions (`grad_sync_ops` scheduled): what did not hide, and what
        the hidden reductions slowed the backward by."""
        done = max((end for _, end in last_grads.values()), default=0.0)
        ops = self.grad_sync_ops(rank, op, last_grads, root_s)
        return max(0.0, schedule(ops, self.prof.eff.overlap_eff).makespan - done)

    @property
    def regather_scale(self) -> float:
        """The blocks' parameter re-gather after the step (ZeRO-1/2) in bytes per byte of
        their gradient buckets: parameters at their own width (the buckets hold ZeRO-2's
        reduce dtype), one byte each where the stack gathers fp8 parameters
        (fivefold.planner.stack)."""
        lay, p = self.lay, self.a
        scale = p / PRECISION_BYTES[lay.reduce_dtype] if lay.zero_stage == 2 else 1.0
        if lay.precision == "fp8" and self.stack.gathers_fp8_params:
            scale /= p
        return scale

    def optimizer_s(self, rank: int) -> float:
        """The optimizer step over this rank's shard of parameters: memory bound (fp32
        master, moments); Muon reads one momentum instead of two moments on the blocks'
        matrices and adds their Newton-Schulz orthogonalization (compute bound; sharded, the
        busiest owner's and the gathers: fivefold.planner.muon_cost). A stack with
        `eager_adamw` runs AdamW as torch's unfused passes (planner.update_bytes)."""
        lay, e = self.lay, self.prof.eff
        units = offload.device_units(self.rank_units(rank), lay)  # the rest steps on the CPU
        if self.stack.eager_adamw and lay.optimizer == "adamw":
            traffic, launches = eager_adamw_traffic(units, lay, self.cfg.train.weight_decay)
        else:
            traffic, launches = self.fused_update_traffic(units), 4
        ns = (muon_step_s(self, rank) if lay.optimizer == "muon"  # and its gathers
              else sum(self.matrix_update_s(i) for i in self.rank_layers(rank)))  # GaLore
        return (traffic / (self.prof.hbm_GBps * 1e9 * e.mem_eff) + launches * e.kernel_overhead_s
                + ns)

    def fused_update_traffic(self, units: list[Unit]) -> float:
        """Bytes of a fused optimizer kernel over `units` (one pass: master, gradient and
        states read, master and states written, the gradient zeroed, the compute copy
        re-published); Muon's matrices carry one momentum instead of two moments."""
        lay = self.lay
        g = PRECISION_BYTES[lay.reduce_dtype]
        adamw, momentum = 28 + 2 * g + self.a, 16 + 2 * g + self.a
        per_param = {"adamw": adamw, "muon": adamw, "sgd": momentum, "lomo": 0,
                     "galore": momentum}[lay.optimizer]
        traffic = 0.0
        for u in units:
            local = u.shard_numel if lay.zero_stage >= 1 else u.padded
            matrices = u.matrices * local / u.numel if lay.optimizer == "muon" else 0
            traffic += local * per_param - matrices * (adamw - momentum)
        return traffic

    def matrix_update_s(self, layer: int) -> float:
        """Muon's orthogonalization, or GaLore's projections and amortized refresh, of
        block `layer`'s weight matrices on one rank (fivefold.planner.matrix_update)."""
        return matrix_update_time(self.model, layer, self.lay.tp, self.cfg.train, self.prof)
