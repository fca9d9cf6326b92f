"""A layout's per-block costs on one rank: its groups, each block's collectives priced, and
the block's forward and backward scheduled as ops (fivefold.planner.block_ops).

`BlockCosts` holds what every later part of the step reads (fivefold.planner.stage_cost,
rank_cost, step): the layout's process groups placed on the mesh (tp innermost, then cp,
dp, pp), the micro-batch's shard on one rank, the collective model's links, the stack. A
block's cost is scheduled once per distinct shape and data-parallel grouping and shared
through `cache` by every layout that asks for it (the search scores tens of thousands).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fivefold.config import Config, ModelConfig
from fivefold.hardware import HardwareProfile
from fivefold.models.description import MOE_PARTS, block_parameters, is_moe_layer
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner import activations as A
from fivefold.planner.block_ops import BlockComm, Compute, block_seconds
from fivefold.planner.comm import Group, Links, collective_time
from fivefold.planner.compute import (OpTimes, Shard, block_attention_time, block_times,
                                      embedding_times, head_times)
from fivefold.planner.expert_cost import expert_groups, moe_comm_s
from fivefold.planner.fitted import FITTED, Fitted, in_training
from fivefold.planner.params import block_params, local_numel
from fivefold.planner.stack import stack_of


def expert_load(model: ModelConfig, ep: int) -> float:
    """The busiest expert-parallel rank's routed rows over the ranks' mean, at which a MoE
    block's experts and all-to-alls are timed: `model.moe.rank_imbalance`, capped at ep (all
    rows on one rank); 1 without expert parallelism, where every rank holds every expert."""
    if model.moe is None or ep == 1:
        return 1.0
    return min(float(ep), model.moe.rank_imbalance)


@dataclass(frozen=True)
class LayerCost:
    """One block, one micro-batch, one rank: compute and exposed communication seconds (the
    scheduled time less the compute)."""

    f_compute: float
    f_comm: float
    b_compute: float  # backward compute, recomputation included
    b_comm: float
    wgrad: float
    grad_sync_bytes: float  # this block's gradient bucket (data-parallel sync)
    expert_sync_bytes: float = 0.0  # its routed experts' bucket, synced over edp (ep > 1)

    @property
    def f(self) -> float:
        return self.f_compute + self.f_comm

    @property
    def b(self) -> float:
        return self.b_compute + self.b_comm


class BlockCosts:
    """The per-block quantities of one layout (module docstring)."""

    def __init__(self, cfg: Config, prof: HardwareProfile, lay: ParallelPlan,
                 cache: dict | None = None, fit: Fitted = FITTED):
        prof = in_training(prof, fit)  # what a training step sustains (GPU profiles)
        self.cfg, self.model, self.prof, self.lay = cfg, cfg.model, prof, lay
        self.cache = {} if cache is None else cache
        c = cfg.cluster
        gpn = c.gpus_per_node
        links_key = ("links", id(prof), gpn, c.intra_node_GBps, c.inter_node_GBps)
        if links_key not in self.cache or self.cache[links_key][0] is not prof:
            self.cache[links_key] = (prof, Links.of(prof, gpn, c.intra_node_GBps,
                                                    c.inter_node_GBps))
        self.links = self.cache[links_key][1]  # one object per search: collective_time's key
        self.stack = stack_of(cfg.train.stack, cfg.train.stack_release)
        groups_key = ("groups", gpn, cfg.train.stack, cfg.train.stack_release, lay.tp, lay.cp,
                      lay.dp, lay.pp, lay.ep, lay.etp, lay.zero_stage, lay.zero_group)
        if groups_key not in self.cache:
            self.cache[groups_key] = self._groups(gpn)
        (self.tp_group, self.cp_group, self.shard_group, self.etp, self.etp_group,
         self.ep_group, self.expert_shard_group, self.replicate_group,
         self.pp_pair) = self.cache[groups_key]
        self.shard = Shard(lay.micro_batch, self.model.seq_len, lay.tp, lay.cp,
                           lay.sequence_parallel, lay.ep, lay.precision, lay.recompute, lay.cp_mode, cfg.train.compile,
                           self.stack, lay.fp8_recipe, lay.fp8_tensors,
                           expert_load(self.model, lay.ep), lay.etp, lay.split_backward)
        self.a = PRECISION_BYTES[lay.precision]
        # what a block's compute and its tp, cp and ep collectives read of the layout: the
        # key of what `cache` shares between layouts, built once (every lookup asks for it)
        self.shape_key = (lay.tp, lay.cp, lay.ep, lay.etp, lay.sequence_parallel,
                          lay.micro_batch, lay.recompute, lay.precision, lay.fp8_recipe,
                          lay.fp8_tensors, lay.cp_mode, gpn, self.stack.name,
                          self.shard.expert_load,
                          lay.recompute == "full" and lay.split_backward)  # reruns whole blocks

    def _groups(self, gpn: int) -> tuple:
        """The layout's groups placed on the mesh (tp innermost, then cp, dp, pp): tp, cp,
        the ZeRO shard group, the routed experts' etp (as planner.params.block_params takes
        it), etp, ep and edp groups (planner.expert_cost), the ZeRO replicas', a pp pair."""
        lay = self.lay
        tp, cp, dp = lay.tp, lay.cp, lay.dp
        shard_group = Group.strided(lay.zero_group * cp if lay.zero_stage >= 1 else dp * cp,
                                    tp, gpn)
        experts = expert_groups(self.stack, lay, shard_group, gpn)
        replicate = Group.strided(dp // lay.zero_group, tp * cp * lay.zero_group,
                                  gpn) if lay.zero_stage >= 1 else Group(1, 1)
        pp_pair = Group.strided(2, tp * cp * dp, gpn) if lay.pp > 1 else Group(1, 1)
        return (Group.strided(tp, 1, gpn), Group.strided(cp, tp, gpn), shard_group,
                *experts, replicate, pp_pair)

    @functools.cached_property
    def dense_cost(self) -> LayerCost:
        return self._shared_layer_cost(False)

    @functools.cached_property
    def moe_cost(self) -> LayerCost:
        return self._shared_layer_cost(True)

    def layer_cost(self, i: int) -> LayerCost:
        return self.moe_cost if is_moe_layer(self.model, i) else self.dense_cost

    def _shared_layer_cost(self, moe: bool) -> LayerCost:
        """`_layer_cost`, shared through `cache` by the layouts with the same shard shape and
        data-parallel grouping (what it reads beyond `shape_key`)."""
        lay = self.lay
        key = ("layer", moe, lay.zero_stage, lay.zero_group, lay.dp, self.pp_unsharded,
               lay.reduce_dtype) + self.shape_key
        if key not in self.cache:
            self.cache[key] = self._layer_cost(moe)
        return self.cache[key]

    def compute_only_cost(self, moe: bool) -> LayerCost:
        """`layer_cost` with the block's communication left out: a floor under it (the
        scheduler only ever adds to the compute), shared by the layouts of one shard
        shape. The search skips timing a layout whose floor already loses."""
        key = ("compute only", moe) + self.shape_key
        if key not in self.cache:
            t = self.core(moe)[0]
            self.cache[key] = LayerCost(t.fwd, 0.0, t.bwd + t.recompute, 0.0, t.wgrad, 0.0)
        return self.cache[key]

    def _coll(self, op: str, nbytes: float, group: Group) -> float:
        return collective_time(op, nbytes, group, self.links)

    def _data_coll(self, op: str, dense_bytes: float, expert_bytes: float) -> float:
        """One data-parallel collective of a block: its dense part over the ZeRO group, its
        routed experts' part over their edp group."""
        return (self._coll(op, dense_bytes, self.shard_group)
                + self._coll(op, expert_bytes, self.expert_shard_group))

    def block_sync_s(self, op: str, i: int, scale: float = 1.0) -> float:
        """Block i's data-parallel collective `op` over its gradient buckets (`scale`: their
        bytes times this, for a collective of another element width)."""
        c = self.layer_cost(i)
        return self._data_coll(op, c.grad_sync_bytes * scale, c.expert_sync_bytes * scale)

    # ------------------------------------------------------------ a block's ops

    def core(self, moe: bool) -> tuple[OpTimes, Compute, BlockComm]:
        """A block's compute and its tensor-, context- and expert-parallel collectives, before
        data parallelism; shared through `cache` by every layout of the same shard shape."""
        key = ("core", moe) + self.shape_key
        if key not in self.cache:
            self.cache[key] = self._core(moe)
        return self.cache[key]

    def _core(self, moe: bool) -> tuple[OpTimes, Compute, BlockComm]:
        m, lay, sh = self.model, self.lay, self.shard
        t: OpTimes = block_times(m, sh, self.prof, moe)
        at_f, at_b = block_attention_time(m, sh, self.prof)
        act = sh.tokens * m.hidden * self.a  # one full-width activation of the micro-batch
        regather = 0.0
        if lay.sequence_parallel:  # fp8: the stack may gather the fp8 copy (Stack docs)
            fp8_copy = self.stack.fp8_sp_gather and A.fp8_input_copy(lay)
            ag = self._coll("all_gather", act / self.a if fp8_copy else act, self.tp_group)
            close = self._coll("reduce_scatter", act, self.tp_group)  # a region's close
            tp_one = ag + close
            regather = 2 * ag  # each region's input again for its weight gradients
        else:
            tp_one = close = self._coll("all_reduce", act, self.tp_group)
        tp_mlp, ep, ep_counts = moe_comm_s(self, act) if moe else (tp_one, 0.0, 0.0)
        tp = tp_one + (tp_one if tp_mlp is None else tp_mlp)
        # recomputation that stops before w2 leaves the MLP region's close out as well
        rerun = tp - close if sh.recompute_stops_early(moe) and lay.tp > 1 else tp
        comm = BlockComm(tp_f=tp, tp_b=tp, tp_recompute_f=rerun, sp_regather=regather,
                         tp_overlapped=self.stack.overlaps_tp_collectives(lay.tp, lay.sequence_parallel),
                         tp_async_grads=self.stack.async_tp_grads,
                         ep_f=ep + ep_counts, ep_b=ep, **self._cp_comm())
        compute = Compute(t.fwd, at_f, t.bwd, at_b, t.wgrad, t.recompute,
                          lay.recompute == "full")
        return t, compute, comm

    def _cp_comm(self) -> dict:
        """The context-parallel fields of `BlockComm` for the layout's mode and the stack's
        K/V exchange (fivefold.planner.block_ops)."""
        m, lay, n = self.model, self.lay, self.shard.tokens
        if lay.cp == 1:
            return {}
        kv = max(1, m.n_kv_heads // lay.tp) * m.d_head
        q = m.heads * m.d_head // lay.tp
        if lay.cp_mode == "ring" and self.stack.cp_kv_exchange == "allgather":
            width = q if self.stack.sdpa_repeats_kv else kv
            return {"cp_mode": "allgather", "cp": lay.cp,
                    "cp_gather": self._coll("all_gather", lay.cp * 2 * n * width * self.a,
                                            self.cp_group),
                    "cp_step": self._coll("send", 2 * n * width * 4, self.cp_group)}
        if lay.cp_mode == "ring":
            return {"cp_mode": "ring", "cp": lay.cp,
                    "cp_step": self._coll("send", 2 * n * kv * self.a, self.cp_group)}
        return {"cp_mode": "ulysses", "cp": lay.cp,
                "cp_a2a": sum(self._coll("all_to_all", n * width * self.a, self.cp_group)
                              for width in (q, kv, kv, q))}

    def core_cost(self, moe: bool) -> tuple[OpTimes, float, float]:
        """(compute times, forward exposed comm, backward exposed comm) of one block before
        data parallelism, scheduled once per shard shape (`cache`)."""
        key = ("core cost", moe) + self.shape_key
        if key not in self.cache:
            t, compute, comm = self.core(moe)
            f, b = block_seconds(comm, compute, self.prof.eff.overlap_eff)
            self.cache[key] = t, f - t.fwd, b - t.bwd - t.recompute
        return self.cache[key]

    def cp_exposed(self, moe: bool) -> tuple[float, float]:
        """(forward, backward) seconds context parallelism adds to one block on its own."""
        t, compute, comm = self.core(moe)
        only = BlockComm(cp_mode=comm.cp_mode, cp=comm.cp, cp_step=comm.cp_step,
                         cp_gather=comm.cp_gather, cp_a2a=comm.cp_a2a)
        f, b = block_seconds(only, compute, self.prof.eff.overlap_eff)
        return f - t.fwd, b - t.bwd - t.recompute

    def with_data_parallel(self, moe: bool) -> tuple[OpTimes, Compute, BlockComm]:
        """`core` with the block's ZeRO-2/3 collectives added (DDP and ZeRO-1 reduce after
        the backward: fivefold.planner.rank_cost)."""
        lay = self.lay
        t, compute, comm = self.core(moe)
        dense, expert = self.block_numels(moe)
        g = PRECISION_BYTES[lay.reduce_dtype]
        dp = {}
        if lay.zero_stage == 3 and not self.pp_unsharded:  # else gathered once: stage_once
            # the block is freed after its forward; under full recomputation the published
            # ZeRO-3 systems gather it once more (their pre-forward hook runs again), then
            # for the backward. fivefold's runtime recomputes on the backward gather (two
            # gathers, its ledger), so this is one gather pessimistic for it; kept for the
            # published runs the simulator is validated against (docs/planner.md)
            bwd_gathers = (self.stack.zero3_recompute_gathers - 1 if lay.recompute == "full"
                           else 1)
            if self.stack.zero3_overlap:
                ag = self._data_coll("all_gather", dense * self.a, expert * self.a)
                dp = dict(dp_prefetch_f=ag, dp_prefetch_b=bwd_gathers * ag,
                          dp_reduce=self._data_coll("reduce_scatter", dense * g, expert * g))
            else:  # one synchronous gather per parameter tensor (fivefold.planner.stack):
                # the gradient reduce-scatters run behind the block's own backward only,
                # since the next block's first gather synchronises the device
                ag = self.tensor_collectives_s(moe, "all_gather")
                dp = dict(dp_sync_f=ag, dp_sync_b=bwd_gathers * ag,
                          dp_reduce=self.tensor_collectives_s(moe, "reduce_scatter"),
                          reduce_beside_backward_only=True)
        elif lay.zero_stage == 2:
            dp = dict(dp_reduce=self._data_coll("reduce_scatter", dense * g, expert * g),
                      reduce_beside_backward_only=True)
        return t, compute, BlockComm(**{**comm.__dict__, **dp}) if dp else comm

    def _layer_cost(self, moe: bool) -> LayerCost:
        lay = self.lay
        t, compute, comm = self.with_data_parallel(moe)
        if comm is self.core(moe)[2]:
            _, f_comm, b_comm = self.core_cost(moe)
        else:
            f, b = block_seconds(comm, compute, self.prof.eff.overlap_eff)
            f_comm, b_comm = f - t.fwd, b - t.bwd - t.recompute
        dense, expert = self.block_numels(moe)
        width = self.a if lay.zero_stage <= 1 else PRECISION_BYTES[lay.reduce_dtype]
        return LayerCost(t.fwd, f_comm, t.bwd + t.recompute, b_comm, t.wgrad,
                         dense * width, expert * width)

    # ------------------------------------------------------------ a block's parameters

    def first_layer(self, moe: bool) -> int:
        """The first block of the kind (MoE or dense), which stands for all of them."""
        m = self.model
        return next((i for i in range(m.layers) if is_moe_layer(m, i) == moe), 0)

    def block_numel(self, moe: bool, dense_only: bool = False) -> int:
        """Parameters of one block of the kind on one rank (`dense_only`: without the
        routed experts), shared through `cache` (the search asks for them 100,000 times)."""
        key = ("block params", moe, self.lay.tp, self.lay.ep, self.etp)
        if key not in self.cache:
            self.cache[key] = block_params(self.model, self.first_layer(moe), self.lay.tp,
                                           self.lay.ep, self.etp)
        dense, expert = self.cache[key]
        return dense if dense_only else dense + expert

    def block_numels(self, moe: bool) -> tuple[int, int]:
        """(elements synced over the ZeRO group, routed-expert elements synced over edp) of
        one block of the kind on one rank; with ep = 1 the experts are data-parallel like
        every other parameter."""
        numel = self.block_numel(moe)
        if not self.experts_apart:
            return numel, 0
        dense = self.block_numel(moe, dense_only=True)
        return dense, numel - dense

    @functools.cached_property
    def experts_apart(self) -> bool:
        """Whether the routed experts are units of their own, synced over their edp group
        (fivefold.planner.memory.stage_units)."""
        return self.lay.expert_grid if self.etp is not None else self.lay.ep > 1

    @functools.cached_property
    def pp_unsharded(self) -> bool:
        """ZeRO-3 blocks stay gathered for the whole pipelined step (the stack's
        zero3_pp_unsharded, fivefold.planner.stack)."""
        lay = self.lay
        return (lay.zero_stage == 3 and lay.pp > 1 and self.stack.zero3_pp_unsharded
                and lay.schedule != "pipedream-2bw")

    def tensor_collectives_s(self, moe: bool, op: str) -> float:
        """Seconds of one block's per-tensor collectives `op` over the ZeRO-3 group (the
        routed experts' over theirs), one collective per parameter tensor (a latency term
        each): "all_gather" of the parameters, "reduce_scatter" of their gradients. Tensors
        below the stack's persistence threshold take part in neither, and a list collective
        adds its copy kernel per rank (fivefold.planner.stack: zero3_list_gather)."""
        lay, st = self.lay, self.stack
        width = self.a if op == "all_gather" else PRECISION_BYTES[lay.reduce_dtype]
        total = 0.0
        for p in block_parameters(self.model, self.first_layer(moe)):
            split = lay.tp if self.etp is None or p.part not in MOE_PARTS else (
                self.etp if p.part == "experts" else 1)  # planner.params.block_params
            numel = local_numel(self.model, p, split, lay.ep)
            group = (self.expert_shard_group if p.part == "experts" and self.experts_apart
                     else self.shard_group)
            if numel >= st.zero3_persist_numel and group.size > 1:
                copies = group.size * self.prof.eff.kernel_overhead_s
                total += (self._coll(op, numel * width, group)
                          + (copies if st.zero3_list_gather else 0.0))
        return total

    # ------------------------------------------------------------ root parts

    def _root_op(self, times) -> OpTimes:
        """`times(model, shard, profile)`, shared through `cache` by equal shard shapes."""
        key = (times.__name__,) + self.shape_key
        if key not in self.cache:
            self.cache[key] = times(self.model, self.shard, self.prof)
        return self.cache[key]

    @functools.cached_property
    def head(self) -> OpTimes:
        return self._root_op(head_times)

    @functools.cached_property
    def embedding(self) -> OpTimes:
        return self._root_op(embedding_times)

    def root_tp_comm(self, first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) tensor-parallel seconds of a stage's root parts, as the runtime
        issues them (fivefold.parallel.tensor), on the critical path. The vocabulary-parallel
        embedding (first stage) leaves through g: an all-reduce forward; with sequence
        parallelism a reduce-scatter forward and an all-gather backward. The final norm (last
        stage) enters the head through f: an all-reduce backward; with sequence parallelism
        an all-gather forward and a reduce-scatter backward. The vocabulary-parallel loss
        all-gathers three fp32 statistics per token (fivefold.parallel.vocab_parallel_loss)."""
        tokens, sp, group = self.shard.tokens, self.lay.sequence_parallel, self.tp_group
        act = tokens * self.model.hidden * self.a
        f = b = 0.0
        if first:
            f += self._coll("reduce_scatter" if sp else "all_reduce", act, group)
            b += self._coll("all_gather", act, group) if sp else 0.0
        if last:
            f += self._coll("all_gather", act, group) if sp else 0.0
            f += self._coll("all_gather", self.lay.tp * 3 * tokens * 4, group)
            b += self._coll("reduce_scatter" if sp else "all_reduce", act, group)
        return f, b
