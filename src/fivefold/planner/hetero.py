"""`fivefold plan` on a cluster of several device groups: where each part of the model runs,
and how much of the batch each replica takes.

Three kinds of placement are searched, on every non-empty subset of the groups (a plan may
leave a group idle: cheaper, or fewer devices to fail, fivefold.planner.cost/goodput):

- uniform: one model-parallel shape (tp, pp, cp = 1, ZeRO stage, micro-batch, recomputation,
  sequence parallelism, schedule) whose data-parallel replicas each sit inside one group and
  take equal shares of the global batch: the homogeneous plan a runtime without batch shares
  trains, the baseline the others must beat;
- dp-split: the same, the replicas taking unequal shares, in proportion to their group's
  speed (Sailor, SOSP'25; Metis, ATC'24, place heterogeneous data parallelism this way):
  `parallel.dp_batch_shares` lists each replica's sequences per step, replicas numbered group
  by group in the spec's order, summing to the global batch;
- pp-split: pipeline stages placed on groups (each stage's ranks in one group, the first
  stages on one group, the next on the other), blocks split by each group's speed and memory
  (fivefold.planner.mixed_step), written as `parallel.stage_layers`; the groups' device
  counts must be in the ratio of their stage counts.

Every rank is priced by its own group's profile (fivefold.planner.cluster.group_config):
under dp-split a replica of each group is simulated in the whole layout as if every replica
were its group's (its compute its own, its data-parallel collectives spanning every replica
at the slowest group's inter-node link), and the step is the slowest group's; under pp-split the schedule's replay takes each stage's times from its group.
As `plan` on one group, two passes: the closed form (fivefold.planner.search.FastScorer, or
1F1B's slots of the slowest stage for pp-split) ranks every candidate, the best few of each
kind are simulated exactly. Precision, the global batch, the model and the optimizer stay as
the spec says; the other `parallel` keys are the search's.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from fivefold.config import Config
from fivefold.parallel.plan import ParallelPlan, plan_from_config
from fivefold.planner.cluster import DeviceGroup, group_config, slowest_inter_GBps
from fivefold.planner.hetero_pipeline import StageScorer, stage_layouts
from fivefold.planner.search import FastScorer, exact_estimate
from fivefold.planner.search_space import RECOMPUTE, powers_of_two
from fivefold.planner.simulate import Estimate, default_precision, shared_machine
from fivefold.planner.spec import check_model_fits_layout

EXACT_PER_KIND = 4  # candidates of each kind and group subset simulated exactly
MICRO_BATCHES = (1, 2)
ZERO_STAGES = (1, 3)
PIPELINE_DEGREES = (1, 2, 4, 8, 16)


@dataclass
class Placement:
    """One scored placement: its kind, the groups it uses, and the combined estimate whose
    `parallel` table carries the layout (with dp_batch_shares or stage_layers)."""

    kind: str  # "uniform" | "dp-split" | "pp-split"
    groups: list[DeviceGroup]
    estimate: Estimate
    detail: list[dict] = field(default_factory=list)  # per group: its part of the plan

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)


@dataclass
class HeteroResult:
    best: list[Placement]  # exactly simulated, fastest first
    scored: int
    seconds: float


def base_plan(cfg: Config, groups: list[DeviceGroup]) -> ParallelPlan:
    """The spec's plan on all of `groups` (precision: the spec's, else what every group's
    device runs at full rate), stage split cleared for the search."""
    gpus = sum(g.gpus for g in groups)
    precision = ("bf16" if all(default_precision(g.prof) == "bf16" for g in groups)
                 else "fp32")
    one = group_config(cfg, groups[0], gpus, cfg.parallel.global_batch,
                       slowest_inter_GBps(groups))
    return plan_from_config(one, gpus, precision).replace(stage_layers=None, dp=1,
                                                          zero_group=1)


def shapes(cfg: Config, groups: list[DeviceGroup], base: ParallelPlan) -> list[ParallelPlan]:
    """Model-parallel shapes whose ranks divide every group (dp set per group later)."""
    m, out = cfg.model, []
    node = min(g.gpus_per_node for g in groups)
    for tp, pp in itertools.product(powers_of_two(node), PIPELINE_DEGREES):
        if m.heads % tp or pp > m.layers or any(g.gpus % (tp * pp) for g in groups):
            continue
        scheds = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and 2 * pp <= m.layers
                                  else [])
        for mb, zero, rec, (sched, v) in itertools.product(MICRO_BATCHES, ZERO_STAGES,
                                                           RECOMPUTE, scheds):
            lay = base.replace(tp=tp, pp=pp, cp=1, vpp=v, schedule=sched, micro_batch=mb,
                               zero_stage=zero, recompute=rec, sequence_parallel=tp > 1)
            try:
                check_model_fits_layout(m, lay)
            except ValueError:
                continue
            out.append(lay)
    return out


class GroupScorer:
    """Scores a shape's replicas on one group: FastScorer and exact simulation on the
    group's own profile. A replica of this group is timed in the whole layout (every
    replica of the placement, `total_gpus` devices) as if every replica were this group's,
    each taking `per_replica` sequences: its compute is its own device's, and its
    data-parallel collectives span all the replicas, at the slowest group's links."""

    def __init__(self, cfg: Config, g: DeviceGroup, inter: float, total_gpus: int):
        self.g, self.inter, self.total = g, inter, total_gpus
        self.cfg = group_config(cfg, g, total_gpus, cfg.parallel.global_batch, inter)
        self.prof = shared_machine(g.prof, g.gpus)
        self.fast, self.cache = FastScorer(self.cfg, self.prof), {}

    def layout(self, shape: ParallelPlan, per_replica: int) -> ParallelPlan:
        """Every replica of `shape` on this group's devices; ZeRO shards within
        `shape.zero_group` replicas (`sharding_group`), so within one group."""
        dp = self.total // (shape.tp * shape.pp * shape.cp)
        return shape.replace(dp=dp, global_batch=dp * per_replica)

    def score(self, shape: ParallelPlan, per_replica: int) -> float:
        """Closed-form step seconds; infinite when it does not fit or its schedule cannot
        run this many micro-batches (interleaved: at most pp, or a multiple of pp)."""
        lay = self.layout(shape, per_replica)
        m = lay.micro_batches
        if per_replica % lay.micro_batch or lay.vpp > 1 and m > lay.pp and m % lay.pp:
            return math.inf
        step, peak, _ = self.fast.score(lay)
        return step if peak <= self.prof.memory_bytes else math.inf

    def exact(self, shape: ParallelPlan, per_replica: int) -> Estimate | None:
        if not math.isfinite(self.score(shape, per_replica)):
            return None
        lay = self.layout(shape, per_replica)
        cfg = group_config(self.cfg, self.g, self.total, lay.global_batch, self.inter)
        est = exact_estimate(cfg, self.prof, lay, self.cache)
        return est if est is not None and est.fits else None


def sharding_group(shape: ParallelPlan, replicas: list[int]) -> ParallelPlan:
    """`shape` with ZeRO sharding within groups of gcd(replicas per group) replicas
    (parallel.zero_group, MiCS/HSDP): replicas are numbered group by group, so no shard
    group spans two kinds of device and each group's replicas are simulated as their own
    layout; replication (the gradient all-reduce across shard groups) crosses groups."""
    return shape.replace(zero_group=math.gcd(*replicas))


def batch_shares(total: int, replicas: list[int], micro: int,
                 rates: list[float]) -> list[int] | None:
    """Sequences per replica of each group: multiples of `micro`, at least one micro-batch,
    summing over the replicas to `total`, minimizing the slowest group's batch over its
    rate (sequences per second per replica); None when no such split exists."""
    if total % micro:
        return None
    units = total // micro
    ideal = [units * r / sum(n * x for n, x in zip(replicas, rates)) for r in rates]
    best, best_cost = None, math.inf
    ranges = [range(max(1, math.floor(k) - 2), math.ceil(k) + 3) for k in ideal[:-1]]
    for head in itertools.product(*ranges):
        rest = units - sum(n * k for n, k in zip(replicas, head))
        if rest < replicas[-1] or rest % replicas[-1]:
            continue
        ks = [*head, rest // replicas[-1]]
        cost = max(k / r for k, r in zip(ks, rates))
        if cost < best_cost:
            best, best_cost = [k * micro for k in ks], cost
    return best


def dp_candidates(cfg: Config, groups: list[DeviceGroup], scorers: list[GroupScorer],
                  shape: ParallelPlan) -> list[tuple[float, str, ParallelPlan, list[int]]]:
    """(closed-form step, kind, shape, sequences per replica of each group) of the uniform
    and the dp-split placement of `shape`."""
    total = cfg.parallel.global_batch
    replicas = [g.gpus // (shape.tp * shape.pp * shape.cp) for g in groups]
    shape = sharding_group(shape, replicas)
    mb = shape.micro_batch
    out = []
    if total % (sum(replicas) * mb) == 0:
        even = total // sum(replicas)
        steps = [s.score(shape, even) for s in scorers]
        out.append((max(steps), "uniform", shape, [even] * len(groups)))
    if len(groups) > 1:
        ref = max(mb, total // sum(replicas) // mb * mb)
        steps = [s.score(shape, ref) for s in scorers]
        if all(map(math.isfinite, steps)):
            shares = batch_shares(total, replicas, mb, [ref / t for t in steps])
            if shares is not None:
                steps = [s.score(shape, b) for s, b in zip(scorers, shares)]
                out.append((max(steps), "dp-split", shape, shares))
    return [c for c in out if math.isfinite(c[0])]


def dp_placement(cfg: Config, groups: list[DeviceGroup], scorers: list[GroupScorer],
                 kind: str, shape: ParallelPlan, shares: list[int]) -> Placement | None:
    """The exact estimate of a uniform or dp-split placement: a replica of each group
    simulated in the whole layout (GroupScorer), the slowest group deciding."""
    ests = [s.exact(shape, b) for s, b in zip(scorers, shares)]
    if any(e is None for e in ests):
        return None
    total = cfg.parallel.global_batch
    slow = max(ests, key=lambda e: e.step_time_s)
    replicas = [g.gpus // (shape.tp * shape.pp * shape.cp) for g in groups]
    lay = shape.replace(dp=sum(replicas), global_batch=total)
    table = lay.parallel_table()
    if kind == "dp-split":
        table["dp_batch_shares"] = [b for n, b in zip(replicas, shares) for _ in range(n)]
    detail = [{"group": g.label, "replicas": n, "sequences_per_replica": b,
               "micro_batches_per_replica": b // shape.micro_batch,
               "step_time_s": e.step_time_s}
              for g, n, b, e in zip(groups, replicas, shares, ests)]
    return Placement(kind, groups, combine(cfg, groups, slow, ests, lay, table), detail)


def combine(cfg: Config, groups: list[DeviceGroup], slow: Estimate, ests: list[Estimate],
            lay: ParallelPlan, table: dict) -> Estimate:
    """One estimate for the groups together: the slowest group's step and breakdown, the
    most loaded device's memory, MFU over every device's peak."""
    step, total = slow.step_time_s, cfg.parallel.global_batch
    peak = sum(g.gpus * g.prof.peak_flops("bf16" if lay.precision == "fp8" else lay.precision)
               for g in groups)
    # each group's FLOPs in its own step: its devices at its estimate's rate per device
    model_fl = sum(e.model_tflops_per_gpu * g.gpus * e.step_time_s
                   for g, e in zip(groups, ests)) * 1e12
    hw_fl = sum(e.hardware_tflops_per_gpu * g.gpus * e.step_time_s
                for g, e in zip(groups, ests)) * 1e12
    gpus = sum(g.gpus for g in groups)
    return Estimate(step, total * cfg.model.seq_len / step, model_fl / step / gpus / 1e12,
                    hw_fl / step / gpus / 1e12, model_fl / step / peak, hw_fl / step / peak,
                    max((e.memory_per_gpu_bytes for e in ests), key=lambda m: m["total"]),
                    all(e.fits for e in ests), dict(slow.breakdown_s), table, lay,
                    list(slow.stage_layers))


def pp_placement(cfg: Config, groups: list[DeviceGroup], scorer: StageScorer,
                 lay: ParallelPlan, stage_member: list[int], counts: list[int]
                 ) -> Placement | None:
    est = scorer.exact(lay, stage_member, counts)
    if not est.fits:
        return None
    detail = []
    for i, g in enumerate(groups):
        mine = [n for n, s in zip(counts, stage_member) if s == i]
        detail.append({"group": g.label, "stages": len(mine), "stage_layers": mine})
    return Placement("pp-split", groups, est, detail)


def subsets(groups: list[DeviceGroup]) -> list[list[DeviceGroup]]:
    """Every non-empty subset of the groups, all of them first."""
    return [list(c) for k in range(len(groups), 0, -1)
            for c in itertools.combinations(groups, k)]


def hetero_search(cfg: Config, groups: list[DeviceGroup]) -> HeteroResult:
    """Every placement kind on every subset of `groups` (module docstring), the best
    EXACT_PER_KIND of each simulated exactly; all that fit, fastest first."""
    start, scored, best = time.perf_counter(), 0, []
    for subset in subsets(groups):
        inter = slowest_inter_GBps(subset)
        base = base_plan(cfg, subset)
        scorers = [GroupScorer(cfg, g, inter, sum(h.gpus for h in subset)) for g in subset]
        ranked: dict[str, list] = {"uniform": [], "dp-split": []}
        for shape in shapes(cfg, subset, base):
            for cand in dp_candidates(cfg, subset, scorers, shape):
                ranked[cand[1]].append(cand)
            scored += 1
        for kind, cands in ranked.items():
            cands.sort(key=lambda c: c[0])
            for _, _, shape, shares in cands[:EXACT_PER_KIND]:
                placed = dp_placement(cfg, subset, scorers, kind, shape, shares)
                best += [placed] if placed is not None else []
        if len(subset) < 2:
            continue
        stage = StageScorer(cfg, subset, inter)
        firsts = []
        for lay, member in stage_layouts(cfg, subset, base, MICRO_BATCHES, ZERO_STAGES):
            step, counts = stage.first_pass(lay, member)
            scored += 1
            if counts is not None:
                firsts.append((step, lay, member, counts))
        firsts.sort(key=lambda c: c[0])
        for _, lay, member, counts in firsts[:EXACT_PER_KIND]:
            placed = pp_placement(cfg, subset, stage, lay, member, counts)
            best += [placed] if placed is not None else []
    best.sort(key=lambda p: p.estimate.step_time_s)
    return HeteroResult(best, scored, time.perf_counter() - start)
