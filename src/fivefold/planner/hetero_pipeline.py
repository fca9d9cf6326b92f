"""The pp-split placements of fivefold.planner.hetero: pipeline stages on device groups.

A pipeline of pp stages with M = tp x dp ranks per stage (cp = 1) fills group g with
gpus_g / M stages, so M divides every group's device count and pp is the sum; the groups
hold consecutive stages, in the spec's order or the reverse (the last stage carries the
output head, the first the embedding: which group takes which end matters). Blocks are split
by fivefold.planner.mixed_step.split_layers; the first pass ranks candidates by 1F1B's
(micro-batches + pp - 1) slots of the slowest stage, the exact pass replays the schedule
with each stage priced by its own group (MixedLayoutStep).
"""

from __future__ import annotations

import itertools
import math
from functools import reduce
from typing import Iterator

from fivefold.config import Config
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.cluster import DeviceGroup, group_config
from fivefold.planner.mixed_step import MixedLayoutStep, closed_form_step, split_layers
from fivefold.planner.search_space import RECOMPUTE, powers_of_two
from fivefold.planner.simulate import shared_machine
from fivefold.planner.step import LayoutStep

MAX_STAGES = 64


def stage_layouts(cfg: Config, groups: list[DeviceGroup], base: ParallelPlan,
                  micro_batches: tuple[int, ...], zero_stages: tuple[int, ...]
                  ) -> Iterator[tuple[ParallelPlan, list[int]]]:
    """(layout without its split, the group index of every stage) of each pp-split."""
    m, total = cfg.model, cfg.parallel.global_batch
    gpus = sum(g.gpus for g in groups)
    common = reduce(math.gcd, (g.gpus for g in groups))
    node = min(g.gpus_per_node for g in groups)
    orders = [list(range(len(groups))), list(range(len(groups)))[::-1]]
    for ranks in (d for d in range(1, common + 1) if common % d == 0):
        pp = gpus // ranks
        if not 2 <= pp <= min(m.layers, MAX_STAGES):
            continue
        for tp in powers_of_two(min(node, ranks)):
            dp = ranks // tp
            if ranks % tp or m.heads % tp or total % dp:
                continue
            for mb, zero, rec in itertools.product(micro_batches, zero_stages, RECOMPUTE):
                if (total // dp) % mb:
                    continue
                lay = base.replace(tp=tp, pp=pp, cp=1, dp=dp, zero_group=dp, vpp=1,
                                   schedule="1f1b", micro_batch=mb, zero_stage=zero,
                                   recompute=rec, sequence_parallel=tp > 1,
                                   global_batch=total)
                for order in orders:
                    yield lay, [i for i in order for _ in range(groups[i].gpus // ranks)]


class StageScorer:
    """Prices pp-split layouts with one LayoutStep per group (caches kept per group)."""

    def __init__(self, cfg: Config, groups: list[DeviceGroup], inter: float):
        gpus = sum(g.gpus for g in groups)
        self.groups = groups
        self.cfgs = [group_config(cfg, g, gpus, cfg.parallel.global_batch, inter)
                     for g in groups]
        self.profs = [shared_machine(g.prof, gpus) for g in groups]
        self.caches = [{} for _ in groups]
        slow = min(range(len(groups)), key=lambda i: groups[i].inter_node_GBps)
        self.slow = slow
        self.peak_total = 0.0

    def members(self, lay: ParallelPlan) -> list[LayoutStep]:
        return [LayoutStep(c, p, lay, cache) for c, p, cache in
                zip(self.cfgs, self.profs, self.caches)]

    def first_pass(self, lay: ParallelPlan, stage_member: list[int]
                   ) -> tuple[float, list[int] | None]:
        """(closed-form step, the split) of a layout; infinite when no split fits."""
        members = self.members(lay)
        counts = split_layers(members, stage_member)
        if counts is None:
            return math.inf, None
        return closed_form_step(members, stage_member, counts), counts

    def exact(self, lay: ParallelPlan, stage_member: list[int], counts: list[int]):
        """The replayed estimate of the layout cut into `counts` blocks per stage."""
        lay = lay.replace(stage_layers=tuple(counts))
        precision = "bf16" if lay.precision == "fp8" else lay.precision
        peak = sum(g.gpus * g.prof.peak_flops(precision) for g in self.groups)
        mixed = MixedLayoutStep(self.cfgs[self.slow], self.profs[self.slow], lay,
                               self.members(lay), stage_member)
        return mixed.mixed_estimate(peak)
