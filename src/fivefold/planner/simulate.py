"""Predict one training step of a layout: memory per device and step time with its breakdown.

The step is assembled from the models of this package:

1. Per block and per micro-batch on one rank: compute (fivefold.planner.compute) and the
   communication each technique puts on the critical path (fivefold.planner.comm), under the
   overlap rules below. Blocks are cut into pipeline stages by the runtime's partitioner
   (fivefold.parallel.pipeline.partition).
2. The pipeline schedule's action lists (fivefold.planner.schedules) replayed event by event
   with those stage durations by the runtime's replay (fivefold.parallel.pipeline.replay):
   each rank's finish time, busy time and peak in-flight activations.
3. After the last backward: the data-parallel gradient synchronisation that did not hide
   behind that backward, then the optimizer step (memory bound) and, for ZeRO-1/2, the
   parameter all-gather that follows it. Under offload the offloaded units step on the CPU
   (fivefold.planner.offload) and what the next forward waits for them counts as optimizer
   time; the host must hold the offloaded state of its ranks for the layout to fit.

Overlap rules (each technique's own):
- tensor parallelism (Megatron-LM, arXiv 1909.08053): two all-reduces per block forward and
  two backward (all-gather + reduce-scatter pairs with sequence parallelism, arXiv
  2205.05198), on the critical path; full recomputation repeats the forward ones. Under fp8
  a stack with `fp8_sp_gather` (Transformer Engine, torchao's Float8 tensor parallel)
  all-gathers fp8 activations where the input class is in fp8 with tensorwise scales
  (activations.fp8_input_copy); fivefold's runtime gathers the compute dtype.
  Sequence parallelism gathers each region's input again in backward for its weight
  gradients, hidden behind those matmuls (2205.05198, Sec. 4.2.2). The end stages add the
  embedding's, final norm's and vocabulary-parallel loss's collectives as the runtime
  issues them (`_root_tp_comm`); these are the bytes fivefold.planner.ledger_model predicts.
- context parallelism: ring attention (arXiv 2310.01889) sends K/V shards around the ring
  while attention computes, so only what exceeds the attention time shows; Ulysses
  (arXiv 2309.14509) all-to-alls q, k, v and the output, on the critical path. A stack
  with `cp_kv_exchange = "allgather"` (torch 2.5/2.6's experimental context parallelism,
  torchtitan) all-gathers K/V once per pass, hidden only behind the first attention step,
  and passes fp32 dK/dV around the ring in backward (`_cp_allgather_exposed`).
- expert parallelism: dispatch and combine all-to-alls (GShard, arXiv 2006.16668) forward
  and backward, on the critical path. Each all-to-all waits for every rank, so a block's
  experts and all-to-alls are timed at the busiest rank's routed rows (`expert_load`:
  `model.moe.rank_imbalance` over the mean, 1 = balanced).
- ZeRO-3 / FSDP (arXiv 2304.11277): each block's all-gather is prefetched during the
  previous block's compute, and its gradient reduce-scatter runs during the next block's
  backward; only the excess over that compute shows, plus the first gather of each pass.
  A stack without `zero3_overlap` (DeepSpeed's ZeRO-3 of early 2021) gathers each parameter
  tensor with its own synchronous all-gather, all of it exposed, and reduce-scatters each
  gradient tensor behind its block's own backward only (`tensor_collectives_s`).
- DDP / ZeRO-1/2 (arXiv 2006.15704): a block's gradient bucket is reduced as soon as its
  backward ends, on one stream, in the order the blocks finish: during the remaining
  backward of the step's last micro-batch, and under the interleaved schedule behind the
  later model chunks' backward too (`hidden_grad_sync_s`); the root unit (embeddings,
  reduced last) is exposed.
- pipeline send/receive: activations and gradients cross stages on their own stream; the
  receiver waits for the transfer. With tied embeddings the first rank lends the matrix to
  the last stage at the start of the step (hidden behind the pipeline's fill) and receives
  its head gradient back after the last stage's final backward, before its own final
  backward (where the runtime's action lists read it): that return can be exposed.
A collective hidden behind compute still slows it by (1 - overlap_eff) of its time (shared
SMs and HBM bandwidth).

FLOPs follow docs/planner.md: model FLOPs are three times the forward matmul FLOPs, attention
over the full s x s square; hardware FLOPs add what recomputation repeats.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.hardware import HardwareProfile, load_profile
from fivefold.models.description import MOE_PARTS, block_parameters, is_moe_layer
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan, plan_from_config
from fivefold.parallel.pipeline.partition import balanced_counts, stage_layer_ranges
from fivefold.planner import activations as A
from fivefold.planner.comm import Group, Links, collective_time
from fivefold.planner.compute import (OpTimes, Shard, block_attention_time, block_times,
                                      embedding_times, head_times)
from fivefold.planner.expert_cost import expert_groups, moe_comm_s
from fivefold.planner.memory import Unit, model_state_bytes, stage_units
from fivefold.planner import offload
from fivefold.planner.matrix_update import matrix_update_time
from fivefold.planner.muon_cost import muon_step_s
from fivefold.planner.params import block_matrix_shapes, block_params, local_numel, root_params
from fivefold.planner.schedules import (Replay, action_durations, overlapped_pairs,
                                        replay_step, runtime_schedule)
from fivefold.planner.spec import check_model_fits_layout, cluster_gpus
from fivefold.planner.fitted import FITTED, Fitted, in_training
from fivefold.planner.stack import stack_of
from fivefold.planner.update_bytes import eager_adamw_traffic

MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "other", "total")
BREAKDOWN_FIELDS = ("compute", "exposed_comm", "bubble", "optimizer")


@dataclass
class Estimate:
    """A simulated step; `to_json()` gives exactly the fields of run_spec.md."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    memory_per_gpu_bytes: dict[str, int]
    fits: bool
    breakdown_s: dict[str, float]
    parallel: dict
    layout: ParallelPlan = field(repr=False)
    stage_layers: list[int] = field(default_factory=list, repr=False)
    replay: Replay | None = field(default=None, repr=False)
    dp_tail_s: list[float] = field(default_factory=list, repr=False)
    step_model: "StepModel | None" = field(default=None, repr=False)
    offload: dict | None = None  # fivefold.planner.offload.offload_summary

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
                "mfu": self.mfu, "hfu": self.hfu,
                "memory_per_gpu_bytes": dict(self.memory_per_gpu_bytes), "fits": self.fits,
                "breakdown_s": dict(self.breakdown_s), "parallel": dict(self.parallel),
                **({"offload": dict(self.offload)} if self.offload else {})}


def exposed(comm: float, window: float, hide: float) -> float:
    """Seconds of a collective of `comm` seconds that show when it runs behind `window`
    seconds of compute: the excess over `hide` of the window, and never less than its own
    `1 - hide` (overlap_eff: a hidden collective still shares SMs and HBM)."""
    return max(comm - hide * window, (1 - hide) * comm)


def expert_load(model: ModelConfig, ep: int) -> float:
    """The busiest expert-parallel rank's routed rows over the ranks' mean, at which a MoE
    block's experts and all-to-alls are timed: `model.moe.rank_imbalance`, capped at ep (all
    rows on one rank); 1 without expert parallelism, where every rank holds every expert."""
    if model.moe is None or ep == 1:
        return 1.0
    return min(float(ep), model.moe.rank_imbalance)


def default_precision(prof: HardwareProfile) -> str:
    """bf16 where the device has bf16 units at least as fast as fp32, else fp32 (CPUs)."""
    peaks = prof.peak_tflops
    return "bf16" if peaks.get("bf16", 0.0) >= peaks["fp32"] else "fp32"


def profile_of(cfg: Config) -> HardwareProfile:
    if cfg.cluster.gpu is None:
        raise ConfigError("cluster.gpu", "plan and simulate need a hardware profile; set "
                                         "cluster.gpu to one of V100-32GB, A100-40GB, "
                                         "A100-80GB, H100-SXM, H800, H200, B200, GB200, cpu "
                                         "or a file written by `fivefold calibrate`")
    return load_profile(cfg.cluster.gpu)


def shared_machine(prof: HardwareProfile, ranks: int) -> HardwareProfile:
    """A CPU profile's rates when more ranks than it was measured for share the machine:
    `cores` ranks run at the measured rate; beyond that they split the cores evenly."""
    if not prof.cores or ranks <= prof.cores:
        return prof
    share = prof.cores / ranks
    return dataclasses.replace(prof, peak_tflops={k: v * share for k, v in
                                                  prof.peak_tflops.items()},
                               hbm_GBps=prof.hbm_GBps * share)


def simulate(cfg: Config, prof: HardwareProfile | None = None,
             plan: ParallelPlan | None = None, keep_events: bool = False,
             fit: Fitted = FITTED) -> Estimate:
    """The predicted step of `cfg` (or of `plan` on cfg's model and cluster); `fit`: the
    fitted constants (fivefold.planner.fitted; the validation's fits pass their own)."""
    prof = shared_machine(prof or profile_of(cfg), cfg.cluster.gpus or 1)
    plan = plan or plan_from_config(cfg, cluster_gpus(cfg), default_precision(prof))
    check_model_fits_layout(cfg.model, plan)
    return StepModel(cfg, prof, plan, fit=fit).estimate(keep_events)


@dataclass(frozen=True)
class LayerCost:
    """One block, one micro-batch, one rank: compute and exposed communication seconds."""

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


class StepModel:
    """All per-layout quantities of one simulated step, computed once."""

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
        tp, cp, dp = lay.tp, lay.cp, lay.dp
        self.stack = stack_of(cfg.train.stack, cfg.train.stack_release)
        self.tp_group = Group.strided(tp, 1, gpn)
        self.cp_group = Group.strided(cp, tp, gpn)
        shard = lay.zero_group * cp if lay.zero_stage >= 1 else dp * cp
        self.shard_group = Group.strided(shard, tp, gpn)
        # the routed experts' groups: etp, ep and their edp (planner.expert_cost)
        self.etp, self.etp_group, self.ep_group, self.expert_shard_group = expert_groups(
            self.stack, lay, self.shard_group, gpn)
        self.replicate_group = Group.strided(dp // lay.zero_group, tp * cp * lay.zero_group,
                                             gpn) if lay.zero_stage >= 1 else Group(1, 1)
        self.pp_pair = Group.strided(2, tp * cp * dp, gpn) if lay.pp > 1 else Group(1, 1)
        self.shard = Shard(lay.micro_batch, self.model.seq_len, tp, cp, lay.sequence_parallel,
                           lay.ep, lay.precision, lay.recompute, lay.cp_mode, cfg.train.compile,
                           self.stack, lay.fp8_recipe, lay.fp8_tensors,
                           expert_load(self.model, lay.ep), lay.etp)
        self.a = PRECISION_BYTES[lay.precision]

    # ------------------------------------------------------------ per-block costs

    @functools.cached_property
    def dense_cost(self) -> LayerCost:
        return self._shared_layer_cost(False)

    @functools.cached_property
    def moe_cost(self) -> LayerCost:
        return self._shared_layer_cost(True)

    def _shared_layer_cost(self, moe: bool) -> LayerCost:
        """`_layer_cost`, shared through `cache` by the layouts with the same shard shape and
        data-parallel grouping (what it reads beyond `_shape_key`)."""
        lay = self.lay
        key = ("layer", moe, lay.zero_stage, lay.zero_group, lay.dp, self.pp_unsharded,
               lay.reduce_dtype) + self._shape_key()
        if key not in self.cache:
            self.cache[key] = self._layer_cost(moe)
        return self.cache[key]

    def layer_cost(self, i: int) -> LayerCost:
        return self.moe_cost if is_moe_layer(self.model, i) else self.dense_cost

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

    def _shape_key(self) -> tuple:
        lay = self.lay
        return (lay.tp, lay.cp, lay.ep, lay.etp, lay.sequence_parallel, lay.micro_batch,
                lay.recompute, lay.precision, lay.fp8_recipe, lay.fp8_tensors, lay.cp_mode,
                self.cfg.cluster.gpus_per_node, self.stack.name, self.shard.expert_load)

    def core_cost(self, moe: bool) -> tuple[OpTimes, float, float]:
        """(compute times, forward comm, backward comm) of one block and micro-batch, before
        data parallelism: tensor-, context- and expert-parallel collectives. Shared through
        `cache` by every layout with the same shard shape (the search's speed)."""
        key = ("core", moe) + self._shape_key()
        if key in self.cache:
            return self.cache[key]
        m, lay, sh = self.model, self.lay, self.shard
        t: OpTimes = block_times(m, sh, self.prof, moe)
        act = sh.tokens * m.hidden * self.a  # one full-width activation of the micro-batch
        regather = 0.0
        if lay.sequence_parallel:  # fp8: the stack may gather the fp8 copy (Stack docs)
            fp8_copy = self.stack.fp8_sp_gather and A.fp8_input_copy(lay)
            gathered = act / self.a if fp8_copy else act
            ag = self._coll("all_gather", gathered, self.tp_group)
            tp_one = ag + self._coll("reduce_scatter", act, self.tp_group)
            # each region's input gathered again for its weight gradients (2205.05198,
            # Sec. 4.2.2), which the paper overlaps with those gradients' matmuls
            hide = self.prof.eff.overlap_eff
            regather = exposed(2 * ag, t.wgrad, hide)
        else:
            tp_one = self._coll("all_reduce", act, self.tp_group)
        tp_mlp, ep, ep_counts = moe_comm_s(self, act) if moe else (tp_one, 0.0, 0.0)
        tp_f = tp_b = tp_one + (tp_one if tp_mlp is None else tp_mlp)
        if self.stack.overlaps_tp and lay.tp > 1:  # userbuffers: behind the GEMMs they feed
            hide = self.prof.eff.overlap_eff
            tp_f = exposed(tp_f, t.wgrad, hide)
            tp_b = exposed(tp_b + regather, 2 * t.wgrad, hide)
            regather = 0.0
        cp_f, cp_b = self._cp_exposed(moe)
        f_comm = tp_f + cp_f + ep + ep_counts
        b_comm = (tp_b + regather + cp_b + ep
                  + (f_comm if lay.recompute == "full" else 0.0))
        self.cache[key] = (t, f_comm, b_comm)
        return self.cache[key]

    def first_layer(self, moe: bool) -> int:
        """The first block of the kind (MoE or dense), which stands for all of them."""
        m = self.model
        return next((i for i in range(m.layers) if is_moe_layer(m, i) == moe), 0)

    def block_numel(self, moe: bool, dense_only: bool = False) -> int:
        """Parameters of one block of the kind on one rank (`dense_only`: without the
        routed experts)."""
        dense, expert = block_params(self.model, self.first_layer(moe), self.lay.tp,
                                     self.lay.ep, self.etp)
        return dense if dense_only else dense + expert

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

    @functools.cached_property
    def stages_once(self) -> list[tuple[float, float]]:
        """`stage_once` of every virtual stage."""
        return [self.stage_once(g) for g in range(len(self.stage_layers))]

    def stage_once(self, g: int) -> tuple[float, float]:
        """(first forward, last backward) exposed seconds that virtual stage g pays once a
        step when its ZeRO-3 blocks stay gathered: their all-gathers behind its first
        forward, their gradient reduce-scatters behind its last backward."""
        if not self.pp_unsharded:
            return 0.0, 0.0
        hide, g_bytes = self.prof.eff.overlap_eff, PRECISION_BYTES[self.lay.reduce_dtype]
        ag = rs = fwd = bwd = 0.0
        for i in self.stage_ranges[g]:
            dense, expert = self.block_numels(is_moe_layer(self.model, i))
            ag += self._data_coll("all_gather", dense * self.a, expert * self.a)
            rs += self._data_coll("reduce_scatter", dense * g_bytes, expert * g_bytes)
            cost = self.layer_cost(i)
            fwd, bwd = fwd + cost.f - cost.f_comm, bwd + cost.b - cost.b_comm
        return exposed(ag, fwd, hide), exposed(rs, bwd, hide)

    def _layer_cost(self, moe: bool) -> LayerCost:
        lay, e = self.lay, self.prof.eff
        t, f_comm, b_comm = self.core_cost(moe)
        dense, expert = self.block_numels(moe)
        z_f = z_b = 0.0
        hide = e.overlap_eff
        g = PRECISION_BYTES[lay.reduce_dtype]
        if lay.zero_stage == 3 and not self.pp_unsharded:  # else gathered once: stage_once
            ag = self._data_coll("all_gather", dense * self.a, expert * self.a)
            rs = self._data_coll("reduce_scatter", dense * g, expert * g)
            # the block is freed after its forward; under full recomputation the published
            # ZeRO-3 systems gather it once more (their pre-forward hook runs again), then
            # for the backward. fivefold's runtime recomputes on the backward gather (two
            # gathers, its ledger), so this term is one gather pessimistic for it; kept for
            # the published runs the simulator is validated against (docs/planner.md)
            bwd_gathers = (self.stack.zero3_recompute_gathers - 1 if lay.recompute == "full"
                           else 1)
            if self.stack.zero3_overlap:
                bwd_ag = ag * bwd_gathers
                z_f = exposed(ag, t.fwd, hide)
                z_b = exposed(bwd_ag + rs, t.bwd + t.recompute, hide)
            else:  # one synchronous gather per parameter tensor (fivefold.planner.stack):
                # the block's gradient reduce-scatters run behind its own backward only, since
                # the next block's first gather synchronises the device
                ag = self.tensor_collectives_s(moe, "all_gather")
                rs = self.tensor_collectives_s(moe, "reduce_scatter")
                z_f = ag
                z_b = bwd_gathers * ag + exposed(rs, t.bwd, hide)
        elif lay.zero_stage == 2:
            rs = self._data_coll("reduce_scatter", dense * g, expert * g)
            z_b = exposed(rs, t.bwd, hide)
        width = self.a if lay.zero_stage <= 1 else g
        return LayerCost(t.fwd, f_comm + z_f, t.bwd + t.recompute, b_comm + z_b, t.wgrad,
                         dense * width, expert * width)

    def block_numels(self, moe: bool) -> tuple[int, int]:
        """(elements synced over the ZeRO group, routed-expert elements synced over edp) of
        one block of the kind on one rank; with ep = 1 the experts are data-parallel like
        every other parameter."""
        numel = self.block_numel(moe)
        if not self.experts_apart:
            return numel, 0
        dense = self.block_numel(moe, dense_only=True)
        return dense, numel - dense

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

    def _cp_exposed(self, moe: bool) -> tuple[float, float]:
        m, lay, sh, e = self.model, self.lay, self.shard, self.prof.eff
        if lay.cp == 1:
            return 0.0, 0.0
        n = sh.tokens
        kv = max(1, m.n_kv_heads // lay.tp) * m.d_head
        q = m.heads * m.d_head // lay.tp
        if lay.cp_mode == "ring" and self.stack.cp_kv_exchange == "allgather":
            return self._cp_allgather_exposed(n, q if self.stack.sdpa_repeats_kv else kv)
        if lay.cp_mode == "ring":
            shard_kv = 2 * n * kv * self.a
            step = self._coll("send", shard_kv, self.cp_group)
            at_f, at_b = block_attention_time(m, sh, self.prof)  # the window it hides behind
            comm_f = (lay.cp - 1) * step
            comm_b = 2 * comm_f
            return (exposed(comm_f, at_f, e.overlap_eff), exposed(comm_b, at_b, e.overlap_eff))
        a2a = sum(self._coll("all_to_all", n * width * self.a, self.cp_group)
                  for width in (q, kv, kv, q))
        return a2a, a2a

    def _cp_allgather_exposed(self, n: int, kv_width: int) -> tuple[float, float]:
        """(forward, backward) exposed seconds of torch 2.5/2.6's all-gather context
        parallelism (fivefold.planner.stack, `cp_kv_exchange = "allgather"`) for one block:
        the forward's K/V all-gather hides only behind the first of cp equal attention steps;
        the backward's second all-gather likewise, and of its cp fp32 dK/dV passes each of
        the first cp - 1 hides behind the next step, the last not at all."""
        cp, hide = self.lay.cp, self.prof.eff.overlap_eff
        ag = self._coll("all_gather", cp * 2 * n * kv_width * self.a, self.cp_group)
        dkv = self._coll("send", 2 * n * kv_width * 4, self.cp_group)
        at_f, at_b = block_attention_time(self.model, self.shard, self.prof)
        fwd = exposed(ag, at_f / cp, hide)
        bwd = exposed(ag, at_b / cp, hide) + (cp - 1) * exposed(dkv, at_b / cp, hide) + dkv
        return fwd, bwd

    def _root_op(self, times) -> OpTimes:
        """`times(model, shard, profile)`, shared through `cache` by equal shard shapes."""
        key = (times.__name__,) + self._shape_key()
        if key not in self.cache:
            self.cache[key] = times(self.model, self.shard, self.prof)
        return self.cache[key]

    @functools.cached_property
    def head(self) -> OpTimes:
        return self._root_op(head_times)

    @functools.cached_property
    def embedding(self) -> OpTimes:
        return self._root_op(embedding_times)

    def _root_tp_comm(self, first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) tensor-parallel seconds of a stage's root parts, as the runtime
        issues them (fivefold.parallel.tensor). The vocabulary-parallel embedding (first
        stage) leaves through g: an all-reduce forward; with sequence parallelism a
        reduce-scatter forward and an all-gather backward. The final norm (last stage) enters
        the head through f: an all-reduce backward; with sequence parallelism an all-gather
        forward and a reduce-scatter backward. The vocabulary-parallel loss all-gathers
        three fp32 statistics per token (fivefold.parallel.vocab_parallel_loss)."""
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

    # ------------------------------------------------------------ stages

    @functools.cached_property
    def stage_layers(self) -> list[int]:
        """Blocks per virtual stage (pp * vpp stages): the layout's `stage_layers` when set
        (the planner's search sets it by `balanced_stage_layers`), else the runtime's own
        default split (fivefold.parallel.pipeline.partition), so that `simulate` predicts
        what `train` runs."""
        stages = self.lay.pp * self.lay.vpp
        given = self.lay.stage_layers
        if given:
            return list(given)
        if stages == 1:
            return [self.model.layers]
        return [len(r) for r in stage_layer_ranges(self.model, stages)]

    def balanced_stage_layers(self, fits=lambda stage, first, end: True) -> list[int]:
        """The planner's split: blocks cut by modelled time, each stage within `fits`
        (fivefold.parallel.pipeline.partition, Alpa's inter-operator pass)."""
        stages = self.lay.pp * self.lay.vpp
        if stages == 1:
            return [self.model.layers]
        costs = [self.layer_cost(i).f + self.layer_cost(i).b for i in range(self.model.layers)]
        emb, head = self.embedding, self.head
        return balanced_counts(costs, stages, emb.fwd + emb.bwd, head.fwd + head.bwd, fits)

    @functools.cached_property
    def stage_ranges(self) -> list[range]:
        out, start = [], 0
        for n in self.stage_layers:
            out.append(range(start, start + n))
            start += n
        return out

    def stage_times(self, g: int) -> tuple[float, float, float, float, float]:
        """(F, B, W, F comm, B comm) seconds of virtual stage g for one micro-batch."""
        costs = [self.layer_cost(i) for i in self.stage_ranges[g]]
        f = sum(c.f for c in costs)
        b = sum(c.b for c in costs)
        fc = sum(c.f_comm for c in costs)
        bc = sum(c.b_comm for c in costs)
        w = sum(c.wgrad for c in costs)
        stages = len(self.stage_layers)
        tp_f, tp_b = self._root_tp_comm(g == 0, g == stages - 1)
        f, b, fc, bc = f + tp_f, b + tp_b, fc + tp_f, bc + tp_b
        if g == 0:
            f, b = f + self.embedding.fwd, b + self.embedding.bwd
            w += self.embedding.wgrad
        if g == stages - 1:
            f, b = f + self.head.fwd, b + self.head.bwd
            w += self.head.wgrad
        return f, b, w, fc, bc

    @functools.cached_property
    def p2p_s(self) -> float:
        if self.lay.pp == 1:
            return 0.0
        act = self.shard.tokens * self.model.hidden * self.a
        if self.lay.sequence_parallel:
            act /= self.lay.tp
        return self._coll("send", act, self.pp_pair)

    @functools.cached_property
    def tied_grad_s(self) -> float:
        """Seconds to return the tied head's gradient (this tp rank's ceil(V/t) rows) from
        the last pipeline stage to the first; 0 without pipelining or tied embeddings."""
        lay, m = self.lay, self.model
        if lay.pp == 1 or not m.tied_embeddings or lay.v_shape:  # V: through the mailbox
            return 0.0
        first_last = Group.strided(2, lay.tp * lay.cp * lay.dp * (lay.pp - 1),
                                   self.cfg.cluster.gpus_per_node)
        rows = -(-m.vocab // lay.tp)
        return self._coll("send", rows * m.hidden * self.a, first_last)

    # ------------------------------------------------------------ the step

    def run_pipeline(self, keep_events: bool) -> Replay:
        """Replay the schedule; PipeDream-2BW never flushes, so its step is the steady-state
        difference between replays of two and three optimizer steps."""
        lay = self.lay
        stages, n, m = len(self.stage_layers), lay.slices, lay.micro_batches
        once = self.stages_once if self.pp_unsharded else None
        duration = action_durations([self.stage_times(g) for g in range(stages)], n, m, once,
                                    overlapped_pairs(lay.schedule, lay.pp, lay.vpp, m),
                                    self.prof.eff.overlap_eff)
        weights = [self.stage_activation_bytes(g) / n for g in range(stages)]
        if lay.schedule == "pipedream-2bw":
            two, three = (replay_step(runtime_schedule(lay.schedule, lay.pp, 1, m, steps=k),
                                      duration, self.p2p_s, lambda g: weights[g], keep_events)
                          for k in (2, 3))
            return Replay([c - b for b, c in zip(two.finish_s, three.finish_s)],
                          [c - b for b, c in zip(two.busy_s, three.busy_s)],
                          three.peak_weight, three.events, three.last_grads)
        sched = runtime_schedule(lay.schedule, lay.pp, lay.vpp, m, n)
        return replay_step(sched, duration, self.p2p_s, lambda g: weights[g], keep_events)

    def stage_activation_bytes(self, g: int) -> float:
        """Bytes virtual stage g keeps per in-flight micro-batch."""
        lay = self.lay
        n = self.shard.tokens
        total = sum(self.block_saved_bytes(i) for i in self.stage_ranges[g])
        first, last = g == 0, g == len(self.stage_layers) - 1
        return total + A.root_saved_bytes(self.model, n, self.a, lay.tp, first, last,
                                          self.stack, sp=lay.sequence_parallel)

    def dp_sync(self, rank: int, last_grads: dict[int, tuple[float, float]]
                ) -> tuple[float, float]:
        """(exposed gradient-sync seconds after the last backward, parameter re-gather after
        the optimizer) of pipeline rank `rank`, whose virtual stages' last gradient actions
        span `last_grads` (stage -> (start, end), Replay.last_grads)."""
        lay, e = self.lay, self.prof.eff
        layers = [i for g in lay.stage_ids_of_rank(rank) for i in self.stage_ranges[g]]
        first, last = lay.ends_of_rank(rank)
        root = root_params(self.model, lay.tp, first, last)
        p, g = self.a, PRECISION_BYTES[lay.reduce_dtype]
        costs = [self.layer_cost(i) for i in layers]
        tail = 0.0
        if lay.zero_stage <= 1:
            op = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
            blocks = sum(self.block_sync_s(op, i) for i in layers)
            root_t = self._coll(op, root * p, self.shard_group)
            hidden = self.hidden_grad_sync_s(rank, op, last_grads)
            tail = exposed(blocks, hidden, e.overlap_eff) + root_t
        elif lay.zero_stage >= 2:  # the root's reduce-scatter ends the last backward
            tail = self._coll("reduce_scatter", root * g, self.shard_group)
        if lay.zero_stage >= 1 and self.replicate_group.size > 1:
            shard_n, expert_n = self.shard_group.size, self.expert_shard_group.size
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

    def hidden_grad_sync_s(self, rank: int, op: str,
                           last_grads: dict[int, tuple[float, float]]) -> float:
        """Seconds of rank `rank`'s block gradient reductions that run while it still
        computes. Within a virtual stage's last gradient action its blocks complete their
        gradients in reverse order, evenly spread; one stream reduces the blocks in the order
        they become ready (PyTorch DDP's buckets; Megatron-Core's overlap_grad_reduce, which
        keeps one set of buckets per model chunk), so under the interleaved schedule a chunk
        whose last backward comes early in the replayed schedule reduces behind the later
        chunks' backward. What the stream still runs after the rank's last gradient action
        is exposed."""
        ready: list[tuple[float, float]] = []
        done = 0.0
        for g in self.lay.stage_ids_of_rank(rank):
            start, end = last_grads[g]
            done = max(done, end)
            blocks = self.stage_ranges[g][::-1]
            for k, i in enumerate(blocks):
                ready.append((start + (k + 1) * (end - start) / len(blocks),
                              self.block_sync_s(op, i)))
        clock = 0.0
        for at, seconds in sorted(ready):
            clock = max(clock, at) + seconds
        return sum(seconds for _, seconds in ready) - max(0.0, clock - done)

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

    def rank_layers(self, rank: int) -> list[int]:
        return [i for g in self.lay.stage_ids_of_rank(rank)
                for i in self.stage_ranges[g]]

    def rank_units(self, rank: int):
        return stage_units(self.model, self.lay, self.rank_layers(rank),
                           *self.lay.ends_of_rank(rank), etp=self.etp)

    def block_state_bytes(self, i: int) -> float:
        """Parameters, gradients and optimizer states of block i on its rank."""
        units = stage_units(self.model, self.lay, [i], False, False, etp=self.etp)
        return model_state_bytes(units, self.lay)["total"]

    def block_saved_bytes(self, i: int) -> float:
        lay = self.lay
        return A.block_saved_bytes(self.model, self.shard.tokens, self.a, lay.tp,
                                   lay.sequence_parallel, lay.recompute, i, self.stack,
                                   A.fp8_input_copy(lay), A.ring_kv_heads(self.model, lay))

    def rank_fixed_bytes(self, rank: int, inflight: float) -> float:
        """What pipeline rank `rank` holds besides its blocks: root parameters and their
        activations over `inflight` micro-batches, and the memory() 'other' terms."""
        lay = self.lay
        first, last = rank == 0, rank == lay.pp - 1
        units = stage_units(self.model, lay, [], first, last)
        states = model_state_bytes(units, lay)["total"] if units else 0
        root = A.root_saved_bytes(self.model, self.shard.tokens, self.a, lay.tp, first, last,
                                  self.stack, sp=lay.sequence_parallel)
        return states + root * inflight + self.other_bytes(rank)

    def other_bytes(self, rank: int) -> float:
        """Reserved memory, ZeRO-3's gathered buffers and the loss's logits on `rank`."""
        lay, m = self.lay, self.model
        other = self.prof.eff.reserved_bytes
        if lay.zero_stage == 3 and self.pp_unsharded:  # every block of the rank, all step
            unsharded = (sum(sum(block_params(m, i, lay.tp, lay.ep, self.etp))
                             for i in self.rank_layers(rank))
                         + root_params(m, lay.tp, rank == 0, rank == lay.pp - 1))
            other += unsharded * (self.a + PRECISION_BYTES[lay.reduce_dtype])
        elif lay.zero_stage == 3:  # the gathered unit being computed and the prefetched one
            dense, expert = block_params(m, m.layers - 1, lay.tp, lay.ep, self.etp)
            live = 2 * (dense + expert)
            if self.stack.zero3_live_params:
                live = min(live, self.stack.zero3_live_params)
            other += live * self.a
            other += root_params(m, lay.tp, rank == 0, rank == lay.pp - 1) * self.a
        if rank == lay.pp - 1:  # logits, their fp32 copy and gradient around the loss
            other += self.shard.tokens * m.vocab / lay.tp * self.stack.logit_bytes(self.a)
        return other

    def memory(self, rank: int, peak_act: float) -> dict[str, int]:
        lay, m = self.lay, self.model
        states = model_state_bytes(self.rank_units(rank), lay)
        if lay.recompute != "none":  # one block rematerialised during its backward
            peak_act += (A.full_block_bytes(m, self.shard.tokens, self.a, lay.tp,
                                            lay.sequence_parallel)
                         if not self.stack.fp8_saved_inputs else
                         A.block_saved_bytes(m, self.shard.tokens, self.a, lay.tp,
                                             lay.sequence_parallel, "none", 0, self.stack,
                                             A.fp8_input_copy(lay)))
        mem = {"params": states["params"], "grads": states["grads"],
               "optimizer": states["master"] + states["optimizer"],
               "activations": int(peak_act), "other": int(self.other_bytes(rank))}
        mem["total"] = sum(mem.values())
        return mem

    @functools.cached_property
    def flops_per_sequence(self) -> tuple[float, float]:
        """(model, hardware) FLOPs of one sequence through the whole model, all ranks."""
        one = Shard(1, self.model.seq_len, 1, 1, False, 1, "bf16", self.lay.recompute,
                    stack=self.stack)
        model = hw = 0.0
        for i in range(self.model.layers):
            t = block_times(self.model, one, self.prof, is_moe_layer(self.model, i))
            model, hw = model + t.model_flops, hw + t.hw_flops
        h = head_times(self.model, one, self.prof)
        return model + h.model_flops, hw + h.hw_flops

    def estimate(self, keep_events: bool = False) -> Estimate:
        lay, prof = self.lay, self.prof
        rp = self.run_pipeline(keep_events)
        ends, stages = [], len(self.stage_layers)
        times = [self.stage_times(g) for g in range(stages)]
        tails = []
        finish = list(rp.finish_s)
        if self.tied_grad_s:  # rank 0's final backward waits for the returned head gradient
            finish[0] = max(finish[0], finish[-1] + self.tied_grad_s + times[0][1])
        for r in range(lay.pp):
            tail, regather = self.dp_sync(r, rp.last_grads[r])
            if self.stack.dp_overlap and regather:  # behind the next step's first forward
                hide = prof.eff.overlap_eff
                window = sum(times[g][0] for g in range(r, stages, lay.pp))
                regather = exposed(regather, window, hide)
            opt = self.optimizer_s(r)
            offloaded = offload.rank_offload(self, r, opt + regather)
            opt += offloaded.exposed_s  # downloads, host clipping, the forward's waits
            tails.append(tail)
            ends.append((finish[r] + tail + opt + regather, r, tail, opt, regather, offloaded))
        step, r, tail, opt, regather, offloaded = max(ends)
        m = lay.micro_batches
        rank_stages = range(r, stages, lay.pp)
        comm_in = sum(m * (times[g][3] + times[g][4]) + sum(self.stages_once[g])
                      for g in rank_stages)
        busy = rp.busy_s[r]
        compute = busy - comm_in
        bubble = max(0.0, rp.finish_s[r] - busy)
        exposed_s = comm_in + tail + regather + (finish[r] - rp.finish_s[r])
        breakdown = {"compute": compute, "exposed_comm": exposed_s, "bubble": bubble,
                     "optimizer": opt}
        mems = [self.memory(k, rp.peak_weight[k]) for k in range(lay.pp)]
        mem = max(mems, key=lambda x: x["total"])
        model_fl, hw_fl = self.flops_per_sequence
        per_gpu = lay.global_batch / lay.gpus / step
        peak = prof.peak_flops("bf16" if lay.precision == "fp8" else lay.precision)
        tokens = lay.global_batch * self.model.seq_len
        host = offload.offload_summary(self, offloaded)
        fits = mem["total"] <= prof.memory_bytes and (host is None or host["host_fits"])
        return Estimate(step, tokens / step, model_fl * per_gpu / 1e12, hw_fl * per_gpu / 1e12,
                        model_fl * per_gpu / peak, hw_fl * per_gpu / peak, mem,
                        fits, breakdown, lay.parallel_table(), lay,
                        list(self.stage_layers), rp if keep_events else None, tails, self, host)


def model_flops_per_token(model: ModelConfig, prof: HardwareProfile) -> float:
    """Model FLOPs per trained token by the convention of docs/planner.md."""
    one = Shard(1, model.seq_len, 1, 1, False, 1, "bf16", "none")
    total = sum(block_times(model, one, prof, is_moe_layer(model, i)).model_flops
                for i in range(model.layers))
    return (total + head_times(model, one, prof).model_flops) / model.seq_len
