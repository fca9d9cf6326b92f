"""`fivefold plan --objective time | cost | goodput`: each placement's step, cost and goodput,
and the order the objective puts them in.

- time: the predicted step, fastest first.
- cost: US dollars per million productive tokens: the devices the placement uses, at their
  groups' prices (fivefold.planner.cost; a group a placement leaves idle is not rented),
  over the tokens a step trains, divided by the goodput when failure rates are known.
- goodput: productive tokens per second, tokens/s times the productive fraction
  (fivefold.planner.goodput). The fraction depends on the devices a placement uses (each
  can fail), the checkpoint's bytes and the storage, not on how the model is cut, so among
  placements on the same devices this is the time order; it differs when a placement
  leaves a group idle.

Every placement carries the checkpoint interval the goodput model chose
(train.checkpoint_minutes), and the `--json` object of each adds `placement`, `cost`,
`goodput` and `train` to simulate's fields (run_spec.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError
from fivefold.planner.cluster import DeviceGroup
from fivefold.planner.cost import usd_per_hour, usd_per_million_tokens
from fivefold.planner.goodput import Goodput, goodput, require_failure_rates, require_prices
from fivefold.planner.simulate import Estimate

OBJECTIVES = ("time", "cost", "goodput")


@dataclass
class Scored:
    """A placement with its figures under every objective."""

    estimate: Estimate
    kind: str  # "uniform" | "dp-split" | "pp-split"
    groups: list[DeviceGroup]
    detail: list[dict] = field(default_factory=list)
    usd_per_million_tokens: float | None = None
    goodput: Goodput | None = None

    @property
    def fraction(self) -> float:
        return self.goodput.fraction if self.goodput else 1.0

    @property
    def productive_tokens_per_s(self) -> float:
        return self.estimate.tokens_per_s * self.fraction

    @property
    def usd_per_million_productive(self) -> float | None:
        cost = self.usd_per_million_tokens
        return None if cost is None else cost / self.fraction

    def key(self, objective: str) -> float:
        if objective == "cost":
            cost = self.usd_per_million_productive
            return math.inf if cost is None else cost
        if objective == "goodput":
            return -self.productive_tokens_per_s
        return self.estimate.step_time_s


def check_objective(objective: str, groups: list[DeviceGroup]) -> None:
    """The objective is known and the cluster has the figures it needs (ConfigError)."""
    if objective not in OBJECTIVES:
        raise ConfigError("--objective", f"unknown objective {objective!r}; choose "
                                         f"{' | '.join(OBJECTIVES)}")
    if objective == "cost":
        require_prices(groups)
    if objective == "goodput":
        require_failure_rates(groups)


def score(cfg: Config, est: Estimate, kind: str, groups: list[DeviceGroup],
          detail: list[dict]) -> Scored:
    tokens = cfg.parallel.global_batch * cfg.model.seq_len
    return Scored(est, kind, groups, detail,
                  usd_per_million_tokens(groups, est.step_time_s, tokens),
                  goodput(cfg, groups, est.layout.precision))


def ranked(items: list[Scored], objective: str) -> list[Scored]:
    return sorted(items, key=lambda s: (s.key(objective), s.estimate.step_time_s))


def scored_json(s: Scored) -> dict:
    """simulate's fields and the placement, cost, goodput and chosen checkpoint interval."""
    out = s.estimate.to_json()
    out["placement"] = {"kind": s.kind, "groups": s.detail,
                        "gpus": sum(g.gpus for g in s.groups)}
    out["cost"] = {"usd_per_hour": usd_per_hour(s.groups),
                   "usd_per_million_tokens": s.usd_per_million_tokens,
                   "usd_per_million_productive_tokens": s.usd_per_million_productive}
    out["goodput"] = s.goodput.to_json() if s.goodput else None
    out["productive_tokens_per_s"] = s.productive_tokens_per_s
    out["train"] = {"checkpoint_minutes": round(s.goodput.checkpoint_minutes, 2)
                    if s.goodput else None}
    return out


def cluster_lines(groups: list[DeviceGroup]) -> list[str]:
    """One line per group: its devices, price, failure rate and where its profile comes
    from; the profiles no one has measured (fivefold.hardware) are said to be so."""
    out = []
    for g in groups:
        price = f"${g.usd_per_gpu_hour:g}/device-hour" if g.usd_per_gpu_hour is not None \
            else "no price"
        mtbf = f"MTBF {g.mtbf_hours_per_gpu:,.0f} device-hours" if g.mtbf_hours_per_gpu \
            else "no failure rate"
        note = (f"; its kernels are NOT all measured ({g.prof.kernel_source})"
                if not g.prof.kernels_measured else "")
        out.append(f"group {g.label}: {price}, {mtbf}{note}")
    return out
