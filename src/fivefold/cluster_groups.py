"""The checks of a cluster made of several device groups (`[[cluster.groups]]`) and of the
cluster's price and failure keys, run by `fivefold.validate.validate_cluster`.

A group is one kind of device (a hardware profile) with its count, its node size and links,
and optionally its price per device-hour and its failure rate (device-hours between
job-stopping failures). A cluster with groups names its devices there, not in cluster.gpu;
cluster.gpus is then the groups' total, derived when absent (as parallel.dp is). Each
problem raises ConfigError naming the key, e.g. `cluster.groups[1].gpus`, before the
planner reads a figure (docs/run_spec.md).
"""

from __future__ import annotations

from fivefold.config import Config, ConfigError
from fivefold.hardware import PROFILES, load_profile
from fivefold.models.validate_model import positive


def validate_cluster_money_and_failures(cfg: Config) -> None:
    """Prices at or above zero, failure rates, restart minutes and storage above zero."""
    c = cfg.cluster
    _price("cluster.usd_per_gpu_hour", c.usd_per_gpu_hour)
    positive("cluster.mtbf_hours_per_gpu", c.mtbf_hours_per_gpu)
    positive("cluster.restart_minutes", c.restart_minutes, allow_zero=True)
    positive("cluster.storage_GBps", c.storage_GBps)


def validate_groups(cfg: Config) -> None:
    """Every group names a known profile and a device count; the cluster-wide gpu/gpus keys
    agree with the groups (gpus is derived from them when absent); prices and failure
    figures in range."""
    c = cfg.cluster
    validate_cluster_money_and_failures(cfg)
    if c.groups is None:
        return
    if not c.groups:
        raise ConfigError("cluster.groups", "an empty list of groups; add [[cluster.groups]] "
                                            "tables (gpu, gpus) or drop the key")
    if c.gpu is not None:
        raise ConfigError("cluster.gpu", "a cluster with [[cluster.groups]] names its devices "
                                         "per group (cluster.groups[i].gpu); drop cluster.gpu")
    for i, g in enumerate(c.groups):
        key = f"cluster.groups[{i}]"
        if not g.gpu:
            raise ConfigError(f"{key}.gpu", f"a group needs its device: one of "
                                            f"{', '.join(PROFILES)} or a profile file")
        try:
            load_profile(g.gpu)
        except ConfigError as err:
            raise ConfigError(f"{key}.gpu", str(err).split(": ", 1)[-1]) from None
        if not g.gpus:
            raise ConfigError(f"{key}.gpus", "a group needs its number of devices, e.g. "
                                             "gpus = 256")
        positive(f"{key}.gpus", g.gpus)
        positive(f"{key}.gpus_per_node", g.gpus_per_node)
        positive(f"{key}.intra_node_GBps", g.intra_node_GBps)
        positive(f"{key}.inter_node_GBps", g.inter_node_GBps)
        _price(f"{key}.usd_per_gpu_hour", g.usd_per_gpu_hour)
        positive(f"{key}.mtbf_hours_per_gpu", g.mtbf_hours_per_gpu)
    total = sum(g.gpus for g in c.groups)
    if c.gpus is not None and c.gpus != total:
        raise ConfigError("cluster.gpus", f"{c.gpus} differs from the groups' {total} devices; "
                                          "drop cluster.gpus (it is derived from the groups)")
    c.gpus = total


def _price(key: str, value: float | None) -> None:
    if value is not None and not value >= 0:
        raise ConfigError(key, f"a price cannot be below zero, got {value}; write the USD "
                               "one device-hour costs, e.g. 2.5")
    positive(key, value, allow_zero=True)
