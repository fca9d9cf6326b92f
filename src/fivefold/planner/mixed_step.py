"""A pipeline whose stages run on different device groups: each stage priced by its own
group's hardware profile, blocks split by each group's speed and memory.

The stages of one pipeline sit on groups (the first stages on one group, the next on
another, as the plan places them); every stage's ranks belong to one group. `split_layers`
cuts the blocks into contiguous stages, at least one each, minimizing the slowest stage's
forward-plus-backward time for one micro-batch, each stage within its own device's memory
(its blocks' state and saved activations at its peak in-flight micro-batches, plus what the
rank holds besides: fivefold.planner.step.LayoutStep.rank_fixed_bytes): a bisection on that
time, each stage taking as many blocks as fit under it. `MixedLayoutStep` is a
fivefold.planner.step.LayoutStep whose per-stage quantities (stage times, activation
bytes, the data-parallel tail, the optimizer, memory) come from the LayoutStep of that
stage's group, so the schedule's event replay (the same one every layout uses) lets the
slowest path decide the step. Transfers between stages are priced on the slowest group's
links (fivefold.planner.cluster).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from fivefold.config import Config
from fivefold.hardware import HardwareProfile
from fivefold.models.description import is_moe_layer
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.schedules import peak_in_flight
from fivefold.planner.estimate import Estimate
from fivefold.planner.step import LayoutStep


class MixedLayoutStep(LayoutStep):
    """A LayoutStep whose stage `g` (= pipeline rank g: one virtual stage per rank) is priced
    by `members[stage_member[g]]`, a LayoutStep of the same layout on that group's profile."""

    def __init__(self, cfg: Config, prof: HardwareProfile, lay: ParallelPlan,
                 members: list[LayoutStep], stage_member: list[int]):
        super().__init__(cfg, prof, lay)
        self.members, self.stage_member = members, stage_member

    def member(self, g: int) -> LayoutStep:
        return self.members[self.stage_member[g]]

    def stage_times(self, g: int) -> tuple[float, float, float, float, float]:
        return self.member(g).stage_times(g)

    @functools.cached_property
    def stages_once(self) -> list[tuple[float, float]]:
        return [self.member(g).stage_once(g) for g in range(len(self.stage_layers))]

    def stage_activation_bytes(self, g: int) -> float:
        return self.member(g).stage_activation_bytes(g)

    def dp_sync(self, rank: int, last_grads: dict) -> tuple[float, float]:
        return self.member(rank).dp_sync(rank, last_grads)

    def optimizer_s(self, rank: int) -> float:
        return self.member(rank).optimizer_s(rank)

    def memory(self, rank: int, peak_act: float) -> dict[str, int]:
        return self.member(rank).memory(rank, peak_act)

    def mixed_estimate(self, peak_flops_total: float) -> Estimate:
        """The replayed step, with fits checked per rank against its own device and MFU
        over the devices' summed peak (`peak_flops_total`, FLOP/s of every device)."""
        est = self.estimate(keep_events=True)
        mems = [self.memory(r, est.replay.peak_weight[r]) for r in range(self.lay.pp)]
        fits = all(m["total"] <= self.member(r).prof.memory_bytes for r, m in enumerate(mems))
        model_fl, hw_fl = self.flops_per_sequence
        rate = self.lay.global_batch / est.step_time_s
        return dataclasses.replace(est, fits=fits, replay=None,
                                   mfu=model_fl * rate / peak_flops_total,
                                   hfu=hw_fl * rate / peak_flops_total,
                                   model_tflops_per_gpu=model_fl * rate / self.lay.gpus / 1e12,
                                   hardware_tflops_per_gpu=hw_fl * rate / self.lay.gpus / 1e12)


def split_layers(members: list[LayoutStep], stage_member: list[int]) -> list[int] | None:
    """Blocks per stage (module docstring); None when no split fits the devices' memory.
    `members` hold the layout (pp stages, any split); stage s runs on
    members[stage_member[s]]."""
    lay = members[0].lay
    layers, stages = members[0].model.layers, lay.pp
    if stages > layers:
        return None
    kinds = [is_moe_layer(members[0].model, i) for i in range(layers)]
    per_member = [_block_figures(sm, kinds) for sm in members]
    time, mem, fixed, budget = [], [], [], []
    for s in range(stages):
        sm = members[stage_member[s]]
        costs, state, saved = per_member[stage_member[s]]
        inflight = peak_in_flight(lay.schedule, stages, lay.micro_batches, s, 1)
        extra = ((sm.embedding.fwd + sm.embedding.bwd) * (s == 0)
                 + (sm.head.fwd + sm.head.bwd) * (s == stages - 1))
        time.append((costs, extra))
        mem.append(_prefix([a + b * inflight for a, b in zip(state, saved)]))
        fixed.append(sm.rank_fixed_bytes(s, inflight))
        budget.append(sm.prof.memory_bytes)

    def cut(limit: float) -> list[int] | None:
        counts, start = [], 0
        for s in range(stages):
            (t, extra), m = time[s], mem[s]
            end = start
            last = layers - (stages - 1 - s)  # leave a block for every later stage
            while (end < last and t[end + 1] - t[start] + extra <= limit
                   and fixed[s] + m[end + 1] - m[start] <= budget[s]):
                end += 1
            if s == stages - 1 and end < layers or end == start:
                return None
            counts.append(end - start)
            start = end
        return counts

    hi = max(t[layers] + extra for t, extra in time)
    if cut(hi) is None:
        return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cut(mid) is not None else (mid, hi)
    return cut(hi)


def _block_figures(sm: LayoutStep, kinds: list[bool]
                   ) -> tuple[list[float], list[float], list[float]]:
    """(prefix sums of forward + backward seconds, state bytes, saved bytes) per block of
    `sm`, each computed once per kind of block (dense or MoE): blocks of a kind are alike."""
    first = {moe: kinds.index(moe) for moe in set(kinds)}
    cost = {moe: sm.layer_cost(i).f + sm.layer_cost(i).b for moe, i in first.items()}
    state = {moe: sm.block_state_bytes(i) for moe, i in first.items()}
    saved = {moe: sm.block_saved_bytes(i) for moe, i in first.items()}
    return (_prefix([cost[k] for k in kinds]), [state[k] for k in kinds],
            [saved[k] for k in kinds])


def slowest_stage_s(members: list[LayoutStep], stage_member: list[int],
                    counts: list[int]) -> float:
    """Forward plus backward seconds of the slowest stage for one micro-batch."""
    out, start = 0.0, 0
    for s, n in enumerate(counts):
        sm = members[stage_member[s]]
        t = sum(sm.layer_cost(i).f + sm.layer_cost(i).b for i in range(start, start + n))
        t += (sm.embedding.fwd + sm.embedding.bwd) * (s == 0)
        t += (sm.head.fwd + sm.head.bwd) * (s == len(counts) - 1)
        out, start = max(out, t), start + n
    return out


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def closed_form_step(members: list[LayoutStep], stage_member: list[int],
                     counts: list[int]) -> float:
    """The first pass's step: 1F1B's (m + pp - 1) slots of the slowest stage."""
    lay = members[0].lay
    slot = slowest_stage_s(members, stage_member, counts)
    return (lay.micro_batches + lay.pp - 1) * slot if math.isfinite(slot) else math.inf
