"""`fivefold simulate` on a cluster of several device groups: the spec's own layout, placed
over the groups as `plan` places it (fivefold.planner.hetero), each rank priced by its own
group's profile and the slowest path deciding.

The spec's layout (tp, pp, cp, ZeRO stage, micro-batch, schedule, ...; dp = devices /
(tp pp cp)) is placed as
- whole replicas in groups, when tp x pp x cp divides every group's devices: each replica
  takes its `parallel.dp_batch_shares` entry (sequences per step, replicas numbered group by
  group in the spec's order) when the config carries that key, else the share the planner
  gives it by its group's speed (equal shares on identical groups); a group is timed at its
  largest replica's share, since the slowest replica decides;
- else whole stages in groups, when pp > 1 and the devices per stage (devices / pp) divide
  every group: the groups hold consecutive stages in the spec's order, blocks cut as
  `parallel.stage_layers` says, else by each group's speed and memory; an absent
  parallel.micro_batch is the runtime's default, the whole per-replica batch.
Any other layout cuts a replica or a stage across two kinds of device, which the runtime
does not do: ConfigError naming parallel.tp.
"""

from __future__ import annotations

import math

from fivefold.config import Config, ConfigError
from fivefold.planner.cluster import DeviceGroup, slowest_inter_GBps
from fivefold.planner.hetero import (GroupScorer, Placement, base_plan, batch_shares,
                                     dp_placement, pp_placement, sharding_group)
from fivefold.planner.hetero_pipeline import StageScorer
from fivefold.planner.mixed_step import split_layers


def simulate_groups(cfg: Config, groups: list[DeviceGroup]) -> Placement:
    """The spec's layout on `groups` (module docstring); ConfigError when it cannot be
    placed or does not fit."""
    p, total = cfg.parallel, cfg.parallel.global_batch
    ranks = p.tp * p.pp * p.cp
    gpus = sum(g.gpus for g in groups)
    if gpus % ranks:
        raise ConfigError("parallel.tp", f"tp*pp*cp = {ranks} does not divide the groups' "
                                         f"{gpus} devices")
    inter = slowest_inter_GBps(groups)
    whole = all(g.gpus % ranks == 0 for g in groups)  # whole replicas in every group
    micro = p.micro_batch or (1 if whole else total // (gpus // ranks))
    shape = base_plan(cfg, groups).replace(
        tp=p.tp, pp=p.pp, cp=p.cp, vpp=p.vpp, schedule=p.schedule, micro_batch=micro,
        zero_stage=p.zero_stage, recompute=p.recompute, sequence_parallel=p.sequence_parallel)
    if whole:
        scorers = [GroupScorer(cfg, g, inter, gpus) for g in groups]
        replicas = [g.gpus // ranks for g in groups]
        shape = sharding_group(shape, replicas)
        if p.zero_group is not None and shape.zero_group % p.zero_group:
            raise ConfigError("parallel.zero_group", f"{p.zero_group} replicas per shard "
                                                     "group must divide every group's "
                                                     f"{', '.join(map(str, replicas))}")
        shape = shape.replace(zero_group=p.zero_group or shape.zero_group)
        shares = _shares(cfg, scorers, shape, replicas)
        kind = "uniform" if len(set(shares)) == 1 else "dp-split"
        placed = dp_placement(cfg, groups, scorers, kind, shape, shares)
    elif p.pp > 1 and all(g.gpus % (gpus // p.pp) == 0 for g in groups):
        per_stage = gpus // p.pp
        dp = per_stage // (p.tp * p.cp)
        lay = shape.replace(dp=dp, zero_group=dp, global_batch=total)
        stage = StageScorer(cfg, groups, inter)
        member = [i for i, g in enumerate(groups) for _ in range(g.gpus // per_stage)]
        counts = list(p.stage_layers) if p.stage_layers else split_layers(
            stage.members(lay), member)
        placed = None if counts is None else pp_placement(cfg, groups, stage, lay, member,
                                                          counts)
    else:
        raise ConfigError("parallel.tp", f"tp*pp*cp = {ranks} ranks per replica divide "
                                         "neither every group's devices (whole replicas per "
                                         "group) nor, with pp, leave whole stages per group; "
                                         "choose degrees that do")
    if placed is None:
        raise ConfigError("parallel", "the layout does not fit some group's device memory "
                                      "(or its schedule cannot run that many "
                                      "micro-batches); `fivefold plan SPEC` searches ones "
                                      "that do")
    return placed


def _shares(cfg: Config, scorers: list[GroupScorer], shape, replicas: list[int]) -> list[int]:
    """Each group's sequences per replica: its largest dp_batch_shares entry, else the
    planner's speed-proportional split."""
    given = getattr(cfg.parallel, "dp_batch_shares", None)
    if given:
        if len(given) != sum(replicas) or sum(given) != cfg.parallel.global_batch:
            raise ConfigError("parallel.dp_batch_shares", f"{len(given)} shares summing to "
                                                          f"{sum(given)}; the layout has "
                                                          f"{sum(replicas)} replicas and "
                                                          f"global_batch "
                                                          f"{cfg.parallel.global_batch}")
        out, start = [], 0
        for n in replicas:
            out.append(max(given[start:start + n]))
            start += n
        return out
    total, mb = cfg.parallel.global_batch, shape.micro_batch
    ref = max(mb, total // sum(replicas) // mb * mb)
    steps = [s.score(shape, ref) for s in scorers]
    rates = [ref / t if math.isfinite(t) else 1.0 for t in steps]
    shares = batch_shares(total, replicas, mb, rates)
    if shares is None:
        raise ConfigError("parallel.global_batch", f"{total} sequences do not split into "
                                                   f"micro-batches of {mb} over "
                                                   f"{sum(replicas)} replicas")
    return shares
