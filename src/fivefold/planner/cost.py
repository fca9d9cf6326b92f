"""What a layout costs: US dollars per million trained tokens, from the groups' prices.

The whole cluster is paid for while it trains, whatever share of it a layout keeps busy:
cost per second = sum over groups of devices x usd_per_gpu_hour / 3600; per million tokens
that times the step time over the tokens of one step (global_batch x seq_len), times 1e6.
Under failures only the productive fraction of wall time trains (fivefold.planner.goodput),
so the effective figure divides by it.
"""

from __future__ import annotations

from fivefold.planner.cluster import DeviceGroup


def usd_per_hour(groups: list[DeviceGroup]) -> float | None:
    """The cluster's price per hour; None when a group has no price."""
    if any(g.usd_per_gpu_hour is None for g in groups):
        return None
    return sum(g.gpus * g.usd_per_gpu_hour for g in groups)


def usd_per_million_tokens(groups: list[DeviceGroup], step_s: float,
                           tokens_per_step: int) -> float | None:
    """Dollars per million tokens at the predicted step; None without prices."""
    hourly = usd_per_hour(groups)
    if hourly is None:
        return None
    return hourly / 3600.0 * step_s / tokens_per_step * 1e6
