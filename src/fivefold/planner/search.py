"""`fivefold plan`: search the parallel layouts of a model on a cluster for the fastest one
(the space and its offload variants: fivefold.planner.search_space).

The space: tensor (powers of two within a node, dividing the heads), context (powers of two
dividing the sequence), pipeline (any degree up to the layers, blocks cut unevenly by
fivefold.parallel.pipeline.partition), data (the rest; it must divide the global batch)
and expert (MoE: divisors of dp*cp that divide the experts) degrees; virtual stages and schedule
(1f1b, gpipe, zb; interleaved with 2 or 4 virtual stages); ZeRO stage 0-3; micro-batch;
recomputation (none, selective, full); sequence parallelism with tp; and optimizer offload
(fivefold.planner.offload): a layout that does not fit the device is tried again with "cpu"
offload, then "nvme", each at offload_fraction 0.5 then 1, and kept at the first that fits
(device and host memory), so `plan` reports which tier it needed. Offload is tried only where
it composes (AdamW, not PipeDream-2BW: fivefold.compositions' refusals) and when the spec
leaves parallel.offload at "none"; a spec that sets a tier holds it for every layout.
Activation offload (fivefold.planner.activation_offload) is tried the same way, first: a
layout without recomputation that does not fit is tried with the fewest blocks per model
chunk (a stage without virtual stages) whose saved tensors, moved to the host, make it fit
(`hosted_activations`; recomputation is the search's other answer, its own candidates). A
spec's parallel.offload_activations is held instead, without recomputation (which it
refuses; a chunk with fewer blocks than the count offloads all of them); the fast pass,
the stage partition and the exact simulation all keep the offloaded blocks' saved tensors
off the device, and the fast pass and the exact one both check that the host holds them
beside any offloaded optimizer state.
Precision and the global batch stay as the spec says.

Two passes, as Alpa (arXiv 2201.12023) and Calculon do: every layout is scored by a fast
closed form built from the same per-block costs the simulator uses (the pipeline's bubble
from the schedule's theory, memory from the schedule's peak in-flight activations); layouts
that do not fit are dropped; the best few are then simulated exactly (event replay of the
schedule, blocks cut into stages by dynamic programming within each stage's memory) and
ranked by that step time. A fitting layout whose pipelined compute alone (no communication,
no optimizer) is already slower than the best few found so far is counted but not timed:
it could not be among them (in the 70B plan on 1024 H100, 38,048 of the 39,123 that fit).
Where those few do not hold up exactly (a stage split that does not fit, a slower exact
step), a second exact pass takes the layouts that could still be among the `top_k`
(`_second_look`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fivefold.config import Config
from fivefold.hardware import HardwareProfile
from fivefold.models.description import is_moe_layer
from fivefold.parallel.pipeline.schedules import rank_of_stage
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan, plan_from_config
from fivefold.planner import activations as A
from fivefold.planner.activation_offload import (backward_wait_s, inline_copy_s,
                                                 offloaded_layers)
from fivefold.planner.memory import (OPTIMIZER_STATE_BYTES, Unit, galore_state_bytes,
                                     offload_bytes)
from fivefold.planner.muon_cost import muon_axis, sharded_muon
from fivefold.planner import offload
from fivefold.planner.offload import UnitWork
from fivefold.planner.params import block_linear_params, block_vector_params, root_params
from fivefold.planner.schedules import bubble_fraction, peak_in_flight
from fivefold.planner.events import exposed
from fivefold.planner.simulate import Estimate, default_precision
from fivefold.planner.step import LayoutStep
from fivefold.planner.search_space import candidates, hosts_activations, offload_tries
from fivefold.planner.spec import cluster_gpus

# how far above the step to beat a layout's compute-only floor must be for it to go untimed:
# the scheduler ends an op within 1e-12 s of its seconds, so a block's communication can
# read a rounding error below zero, far under this
BEAT_SLACK = 1e-3


@dataclass
class SearchResult:
    best: list[Estimate]  # exactly simulated, fastest first
    scored: int  # layouts scored by the fast pass
    fitting: int  # of those, the ones that fit in memory
    seconds: float


class FastScorer:
    """The closed-form step time and peak memory of a layout (first pass)."""

    def __init__(self, cfg: Config, prof: HardwareProfile):
        self.cfg, self.prof, self.cache = cfg, prof, {}
        self.last: LayoutStep | None = None  # the layout `score` priced last, for hosting
        self.floor = 0.0  # the compute floor `score` compared with `beat` last
        m = cfg.model
        self.moe_layers = sum(is_moe_layer(m, i) for i in range(m.layers))

    def score(self, lay: ParallelPlan, beat: float = math.inf) -> tuple[float, float, float]:
        """(step seconds, peak bytes per device (infinite when offload's host tier cannot
        hold the offloaded state), the least peak any offloaded variant of it can reach). A
        layout over the device's memory is not timed: its step reads infinite; so does one
        whose pipeline alone, its blocks' communication left out, takes longer than `beat`
        (the search's step to beat: `search`)."""
        sm = self.last = LayoutStep(self.cfg, self.prof, lay, self.cache)
        m = self.cfg.model
        L, pp = m.layers, lay.pp
        dense_layers = L - self.moe_layers
        kinds = [(n, moe) for n, moe in ((dense_layers, False), (self.moe_layers, True)) if n]
        numel = sum(n * sm.block_numel(moe) for n, moe in kinds) / pp + \
            root_params(m, lay.tp, True, pp == 1)
        shard = lay.zero_group * lay.cp if lay.zero_stage >= 1 else 1
        matrices = low_rank = 0.0
        if lay.optimizer in ("muon", "galore"):  # their share of the state
            vectors = block_vector_params(m, lay.tp)
            matrices = sum(n * (sm.block_numel(moe, dense_only=True) - vectors)
                           for n, moe in kinds) / pp
            low_rank = sum(n * galore_state_bytes(m, sm.first_layer(moe), lay.tp)
                           for n, moe in kinds) / pp
        kept = 1.0 if lay.offload == "none" else 1.0 - lay.offload_fraction
        state = Unit(round(numel), 1, matrices=round(matrices),
                     low_rank_bytes=round(low_rank)).state_bytes(lay.optimizer)
        peak, unloaded = self._memory(sm, lay, numel, shard, math.ceil(L / pp), state, kept)
        if peak > self.prof.memory_bytes:  # does not fit: its time is never read
            return math.inf, peak, unloaded if lay.offload == "none" else peak
        if ((lay.offload != "none" or lay.offload_activations)
                and not self._host_fits(sm, lay, numel / shard)):
            return math.inf, math.inf, math.inf
        if beat < math.inf:
            self.floor = self._compute_floor(sm, lay, kinds)  # read by search when untimed
            if self.floor > beat * (1 + BEAT_SLACK):
                return math.inf, peak, peak
        costs = [(n, sm.moe_cost if moe else sm.dense_cost) for n, moe in kinds]
        pipe, per_rank = self._pipeline(sm, lay, costs)
        grad_bytes = (sum(n * c.grad_sync_bytes for n, c in costs) / pp,
                      sum(n * c.expert_sync_bytes for n, c in costs) / pp)
        tail, regather = self._dp(sm, lay, grad_bytes, per_rank)
        opt_s = numel / shard * 40 / (self.prof.hbm_GBps * 1e9 * self.prof.eff.mem_eff)
        if lay.optimizer in ("muon", "galore"):  # Muon's orthogonalization, GaLore's projections
            owners = muon_axis(lay, False)[1] if sharded_muon(lay) else 1  # Muon's, divided
            opt_s += sum(n * sm.matrix_update_s(sm.first_layer(moe)) for n, moe in kinds) / pp \
                / owners
        opt_s *= kept  # the offloaded share steps on the CPU
        step = pipe + tail + regather + opt_s
        if lay.offload_activations:
            step += self._activation_copies_s(sm, lay, costs)
        if lay.offload != "none":
            step += self._offload_exposed(sm, lay, costs, numel / shard, regather + opt_s)
        return step, peak, peak

    def _chunk_blocks(self, lay: ParallelPlan) -> int:
        """Blocks of a rank's largest model chunk (its stage without virtual stages): what
        offload_activations counts in (fivefold.parallel.parallelize.offloaded_blocks)."""
        return math.ceil(self.cfg.model.layers / (lay.pp * lay.vpp))

    def _hosted_blocks(self, lay: ParallelPlan) -> float:
        """Blocks per (chunk, micro-batch) in flight the fast pass keeps on the host."""
        chunk = math.ceil(self.cfg.model.layers / lay.pp) / lay.vpp
        return min(lay.offload_activations, chunk)

    def _activation_copies_s(self, sm: LayoutStep, lay: ParallelPlan, costs: list) -> float:
        """Seconds activation offload's copies add to the step: per micro-batch each of a
        rank's chunks' offloaded blocks, each the average block's saved bytes and backward,
        through fivefold.planner.activation_offload's model (StageCosts.offload_copy_s): both
        passes pay the copies where the stack queues them with compute, else each chunk's
        backward waits."""
        blocks = self._chunk_blocks(lay)
        k = min(lay.offload_activations, blocks)
        nbytes, link = sm.block_saved_bytes(self.cfg.model.layers - 1), self.prof.host.link_Bps
        chunks = lay.micro_batches * lay.vpp
        if sm.stack.offload_copies_inline:
            return chunks * 2 * inline_copy_s([nbytes] * k, link)
        b = max(c.b for _, c in costs)
        return chunks * backward_wait_s([(nbytes, b)] * k, (blocks - k) * b, link)

    def hosted_activations(self, lay: ParallelPlan, peak: float) -> ParallelPlan | None:
        """`lay`, whose fast-pass peak is `peak` bytes, with the fewest blocks per model
        chunk (a stage without virtual stages) offloaded (parallel.offload_activations) that
        bring it within the device's memory by the fast pass's own count (`_memory`: each
        offloaded block takes its saved bytes off every chunk's micro-batch in flight); None
        where it does not compose (`hosts_activations`, optimizer offload, a spec's own
        count) or even every block of a chunk would not do."""
        if (lay.offload_activations or lay.offload != "none"
                or not hosts_activations(lay.recompute, lay.schedule)):
            return None
        sm = (self.last if self.last is not None and self.last.lay is lay  # as search asks
              else LayoutStep(self.cfg, self.prof, lay, self.cache))
        inflight = peak_in_flight(lay.schedule, lay.pp, lay.micro_batches, 0, lay.vpp)
        per_block = sm.block_saved_bytes(self.cfg.model.layers - 1) * inflight
        blocks = math.ceil((peak - self.prof.memory_bytes) / per_block)
        if blocks > self._chunk_blocks(lay):
            return None
        return lay.replace(offload_activations=blocks)

    def _pipeline(self, sm: LayoutStep, lay: ParallelPlan, costs: list) -> tuple[float, float]:
        """(seconds of the pipelined forwards and backwards, a rank's share of one
        micro-batch) of the blocks' `costs`: (count, LayerCost) per kind of block. Each
        term grows with the blocks' seconds, so floors under them give a floor under it."""
        total = sum(n * (c.f + c.b) for n, c in costs)
        biggest = max(c.f + c.b for _, c in costs)
        emb, head = sm.embedding, sm.head
        extra = emb.fwd + emb.bwd + head.fwd + head.bwd
        per_rank = max((total + extra) / lay.pp, biggest + head.fwd + head.bwd)
        micro = lay.micro_batches
        bubble = bubble_fraction(lay.schedule, lay.pp, micro, lay.vpp)
        pipe = micro * per_rank / (1 - bubble) + 2 * (lay.pp - 1) * lay.vpp * sm.p2p_s
        return pipe, per_rank

    def _compute_floor(self, sm: LayoutStep, lay: ParallelPlan, kinds: list) -> float:
        """`_pipeline` seconds of the blocks' compute alone (BlockCosts.compute_only_cost),
        shared through `cache` by the layouts that differ in what it does not read (ZeRO
        stage, offload): the shard shape, the pipeline's degree, schedule and micro-batches,
        and dp (the stride of its sends' group)."""
        key = ("compute floor", lay.pp, lay.vpp, lay.schedule, lay.micro_batches,
               lay.dp) + sm.shape_key
        if key not in self.cache:
            floors = [(n, sm.compute_only_cost(moe)) for n, moe in kinds]
            self.cache[key] = self._pipeline(sm, lay, floors)[0]
        return self.cache[key]

    def _offload_exposed(self, sm: LayoutStep, lay: ParallelPlan, costs: list,
                         local: float, device_s: float) -> float:
        """Exposed seconds of offloading `offload_fraction` of the rank's `local` elements:
        fivefold.planner.offload on the rank's blocks, each one unit of the average block's
        share, in forward order."""
        blocks = math.ceil(self.cfg.model.layers / lay.pp)
        cost = max((c for _, c in costs), key=lambda c: c.f + c.b)
        per_block = local / blocks
        count = max(1, math.ceil(lay.offload_fraction * blocks))
        work = [UnitWork(round(per_block), cost.f)] * count
        return offload.work_offload(sm, work, device_s).exposed_s

    def _host_fits(self, sm: LayoutStep, lay: ParallelPlan, local: float) -> bool:
        """Whether the host holds what its ranks offload: each rank's `offload_fraction` of
        its `local` elements' state and its offloaded blocks' saved tensors, of every
        micro-batch in flight (as `_memory` takes them off the device; the exact pass checks
        both in LayoutStep.estimate)."""
        state = offload_bytes(lay.offload, OPTIMIZER_STATE_BYTES[lay.optimizer])[0]
        per_rank = state * lay.offload_fraction * local if lay.offload != "none" else 0.0
        if lay.offload_activations:
            inflight = peak_in_flight(lay.schedule, lay.pp, lay.micro_batches, 0, lay.vpp)
            per_rank += (sm.block_saved_bytes(self.cfg.model.layers - 1) * inflight
                         * self._hosted_blocks(lay))
        return per_rank * offload.sharing(sm) <= sm.prof.host.memory_bytes

    def _dp(self, sm: LayoutStep, lay: ParallelPlan, grad_bytes: tuple[float, float],
            window: float):
        """(exposed gradient sync, parameter re-gather) of a rank's (dense, routed-expert)
        gradient bytes."""
        regather = (sm._data_coll("all_gather", *(b * sm.regather_scale for b in grad_bytes))
                    if lay.zero_stage in (1, 2) else 0.0)
        if lay.zero_stage >= 2:
            return 0.0, regather
        op = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
        tail = exposed(sm._data_coll(op, *grad_bytes), window, self.prof.eff.overlap_eff)
        return tail, regather

    def _linear_numel(self, sm: LayoutStep, lay: ParallelPlan) -> float:
        """A pipeline rank's average elements of the blocks' linear weights."""
        m = self.cfg.model
        kinds = ((m.layers - self.moe_layers, sm.first_layer(False)),
                 (self.moe_layers, sm.first_layer(True)))
        return sum(n * sum(block_linear_params(m, i, lay.tp, lay.ep, sm.etp))
                   for n, i in kinds if n) / lay.pp

    def _memory(self, sm: LayoutStep, lay: ParallelPlan, numel: float, shard: int,
                rank_layers: int, state_bytes: float, kept: float = 1.0
                ) -> tuple[float, float]:
        """(peak device bytes, the peak with all of the master and optimizer state
        offloaded); `kept`: the share of that state that offload leaves on the device. Fp8
        weights count at the stack's bytes (LayoutStep.linear_bytes) and a stage's first
        offload_activations blocks keep their saved tensors on the host
        (fivefold.planner.activation_offload)."""
        m, p = self.cfg.model, PRECISION_BYTES[lay.precision]
        g = PRECISION_BYTES[lay.reduce_dtype]
        stage = lay.zero_stage
        params = numel * p
        if sm.linear_bytes is not None:  # the stack keeps fp8 weights
            params -= sm.fp8_weight_saving(self._linear_numel(sm, lay))
        params /= shard if stage == 3 else 1
        grads = numel * (g / shard if stage >= 2 else p)
        state = state_bytes + (0 if p == 4 else 4)
        optimizer = numel * state / (shard if stage >= 1 else 1)
        n = sm.shard.tokens
        per_block = sm.block_saved_bytes(m.layers - 1)
        inflight = peak_in_flight(lay.schedule, lay.pp, lay.micro_batches, 0, lay.vpp)
        on_device = rank_layers / lay.vpp - self._hosted_blocks(lay)  # per (chunk, micro)
        acts = (per_block * on_device + A.layout_root_saved_bytes(
            m, lay, True, lay.pp == 1, sm.stack)) * inflight
        if lay.recompute != "none":
            acts += sm.full_block_bytes()
        other = self.prof.eff.reserved_bytes + n * m.vocab / lay.tp * sm.stack.logit_bytes(p)
        if stage == 3:
            other += 2 * sm.block_numel(m.moe is not None) * p
        return (params + grads + optimizer * kept + acts + other,
                params + grads + acts + other)


def search(cfg: Config, prof: HardwareProfile, top_k: int = 5, exact: int = 24,
           accept: Callable[[ParallelPlan], bool] | None = None) -> SearchResult:
    """The `top_k` fastest layouts that fit, simulated exactly. `accept` restricts the space
    (fivefold.planner.auto: only layouts the runtime can execute); it sees every candidate
    before scoring and every winner again with its stage split."""
    start = time.perf_counter()
    base = plan_from_config(cfg, cluster_gpus(cfg), default_precision(prof))
    base = base.replace(stage_layers=None)
    scorer = FastScorer(cfg, prof)
    usable = prof.memory_bytes
    scored, ranked, untimed = 0, [], []
    leaders: list[float] = []  # the `exact` least steps so far, negated: a heap
    for candidate in candidates(cfg, base):
        tried = False  # a layout counts once, however many offload variants it needed
        for lay in offload_tries(candidate):  # the first variant that fits, if any
            if accept is not None and not accept(lay):
                continue
            tried = True
            # a layout slower than `exact` others already found is never simulated: the
            # scorer need not time one whose compute alone is slower than the last of them
            beat = -leaders[0] if exact and len(leaders) == exact else math.inf
            step, peak, floor = scorer.score(lay, beat)
            hosted = scorer.hosted_activations(lay, peak) if peak > usable else None
            if hosted is not None and (accept is None or accept(hosted)):
                hosted_step, hosted_peak, _ = scorer.score(hosted, beat)
                if hosted_peak <= usable:
                    lay, step, peak = hosted, hosted_step, hosted_peak
            if peak <= usable:
                ranked.append((step, lay))
                if step == math.inf:  # fits, untimed: its floor was above `beat`
                    untimed.append((scorer.floor, len(untimed), lay))
                if exact and step < beat:
                    (heapq.heappush if len(leaders) < exact else heapq.heapreplace)(
                        leaders, -step)
                break
            if lay.offload == "none" and floor > usable:  # nor with all of its state offloaded
                break
        scored += tried
    ranked.sort(key=lambda x: x[0])
    best = _exact_best(cfg, prof, [lay for _, lay in ranked[:exact]], scorer, accept)
    rest = [(step, -1 - i, lay) for i, (step, lay) in enumerate(ranked[exact:])
            if step < math.inf]
    best = _exact_best(cfg, prof, _second_look(scorer, rest, untimed, best, top_k, exact),
                       scorer, accept, best)
    return SearchResult(best[:top_k], scored, len(ranked), time.perf_counter() - start)


def _exact_best(cfg: Config, prof: HardwareProfile, lays: list[ParallelPlan],
                scorer: FastScorer, accept, best: list[Estimate] = ()) -> list[Estimate]:
    """`best` and those of `lays` that fit once simulated exactly, fastest first."""
    out = list(best)
    for lay in lays:
        est = exact_estimate(cfg, prof, lay, scorer.cache)
        if est is not None and est.fits and (accept is None or accept(est.layout)):
            out.append(est)
    return sorted(out, key=lambda e: e.step_time_s)


def _second_look(scorer: FastScorer, rest: list, untimed: list, best: list[Estimate],
                 top_k: int, exact: int) -> list[ParallelPlan]:
    """The layouts not simulated exactly that may still be among the `top_k`, for a second
    exact pass: the leaders of the fast pass may not fit once simulated exactly (the exact
    partition keeps each stage within memory) or run slower, so a fitting layout whose fast
    step (`rest`: (step, tie, layout) of the timed ones) or, untimed, whose compute floor
    (`untimed`: (floor, tie, layout)) is under the `top_k`-th exact step could be faster.
    The untimed are timed in floor order until `exact` timed steps are under the next floor
    (best first: no later one can beat those); the `exact` fastest under that step go on.
    Empty in the usual case, where the leaders hold."""
    bar = best[top_k - 1].step_time_s if len(best) >= top_k else math.inf
    timed = [r for r in rest if r[0] < bar]
    kept = heapq.nlargest(exact, (-r[0] for r in timed))  # the `exact` least steps, negated
    heapq.heapify(kept)
    for floor, i, lay in sorted(untimed, key=lambda u: u[:2]):
        if floor >= bar or len(kept) == exact and -kept[0] <= floor:
            break
        step = scorer.score(lay)[0]
        timed.append((step, i, lay))
        (heapq.heappush if len(kept) < exact else heapq.heappushpop)(kept, -step)
    return [lay for step, _, lay in heapq.nsmallest(exact, timed) if step < bar]


def exact_estimate(cfg: Config, prof: HardwareProfile, lay: ParallelPlan,
                   cache: dict) -> Estimate | None:
    """Simulate `lay` with its blocks cut into stages by the planner's partition (by time,
    each stage within its share of the device memory); None when no split fits."""
    sm = LayoutStep(cfg, prof, lay, cache)
    stages = lay.pp * lay.vpp
    if stages > 1:
        m, v = cfg.model, lay.vpp
        budget = prof.memory_bytes / v
        inflight = [peak_in_flight(lay.schedule, lay.pp, lay.micro_batches, r, v) / v
                    for r in range(lay.pp)]
        fixed = [sm.rank_fixed_bytes(r, inflight[r] * v) / v for r in range(lay.pp)]
        states = [sm.block_state_bytes(i) for i in range(m.layers)]  # the same on every rank
        per_block = [[states[i] + sm.block_saved_bytes(i) * inflight[r]
                      for i in range(m.layers)] for r in range(lay.pp)]

        def fits(stage: int, first: int, end: int) -> bool:
            r = rank_of_stage(stage, lay.pp, lay.v_shape)
            hosted = sum(sm.block_saved_bytes(i) * inflight[r]  # activation offload's blocks
                         for i in offloaded_layers(lay, range(first, end)))
            return fixed[r] + sum(per_block[r][first:end]) - hosted <= budget

        try:
            counts = sm.balanced_stage_layers(fits)
        except ValueError:
            return None
        sm = LayoutStep(cfg, prof, lay.replace(stage_layers=tuple(counts)), cache)
    return sm.estimate()
