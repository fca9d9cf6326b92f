"""The device groups of a run spec's cluster, as the planner reads them.

A cluster is either one group (cluster.gpu, cluster.gpus, the links and the cluster-wide
price and failure keys: the single-group form of run_spec.md) or the `[[cluster.groups]]`
list, each with its own profile, node size, links, price per device-hour and failure rate
(fivefold.cluster_groups checks them). `group_config` turns one group into the single-group
config that the homogeneous simulator (fivefold.planner.simulate) prices, so every rank is
timed by its own group's profile. Links that cross groups are taken at the slowest group's
inter-node bandwidth: a collective or a pipeline transfer that spans groups runs at the pace
of its slowest link.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import Config, ConfigError
from fivefold.hardware import HardwareProfile, load_profile

@dataclass(frozen=True)
class DeviceGroup:
    """One kind of device in the cluster, with its figures resolved."""

    index: int  # in cluster.groups; -1 for the single-group form
    prof: HardwareProfile
    gpu: str  # the spec's name for the profile (a name or a file)
    gpus: int
    gpus_per_node: int
    intra_node_GBps: float
    inter_node_GBps: float
    usd_per_gpu_hour: float | None
    mtbf_hours_per_gpu: float | None

    @property
    def prefix(self) -> str:
        """Where the spec sets this group's keys: `cluster` or `cluster.groups[i]`."""
        return "cluster" if self.index < 0 else f"cluster.groups[{self.index}]"

    @property
    def label(self) -> str:
        return f"{self.prof.name} x{self.gpus}"


def cluster_groups(cfg: Config) -> list[DeviceGroup]:
    """The cluster's groups (one for the single-group form), validated specs assumed."""
    c = cfg.cluster
    if c.groups is None:
        if c.gpu is None or c.gpus is None:
            raise ConfigError("cluster.gpu" if c.gpu is None else "cluster.gpus",
                              "plan needs the devices: set cluster.gpu and cluster.gpus, or "
                              "list [[cluster.groups]] (docs/run_spec.md)")
        prof = load_profile(c.gpu)
        return [DeviceGroup(-1, prof, c.gpu, c.gpus, c.gpus_per_node,
                            c.intra_node_GBps or prof.intra_node_GBps,
                            c.inter_node_GBps or prof.inter_node_GBps,
                            c.usd_per_gpu_hour, c.mtbf_hours_per_gpu)]
    out = []
    for i, g in enumerate(c.groups):
        prof = load_profile(g.gpu)
        out.append(DeviceGroup(i, prof, g.gpu, g.gpus, g.gpus_per_node or prof.nvlink_domain,
                               g.intra_node_GBps or prof.intra_node_GBps,
                               g.inter_node_GBps or prof.inter_node_GBps,
                               g.usd_per_gpu_hour if g.usd_per_gpu_hour is not None
                               else c.usd_per_gpu_hour,
                               g.mtbf_hours_per_gpu or c.mtbf_hours_per_gpu))
    return out


def slowest_inter_GBps(groups: list[DeviceGroup]) -> float:
    """The inter-node bandwidth of the slowest group: what a cross-group transfer reaches."""
    return min(g.inter_node_GBps for g in groups)


def group_config(cfg: Config, g: DeviceGroup, gpus: int, global_batch: int,
                 inter_node_GBps: float) -> Config:
    """`cfg` as a single-group spec of `gpus` devices of group `g` training `global_batch`
    sequences per step, its cross-node links at `inter_node_GBps`."""
    cluster = dataclasses.replace(cfg.cluster, groups=None, gpu=g.gpu, gpus=gpus,
                                  gpus_per_node=g.gpus_per_node,
                                  intra_node_GBps=g.intra_node_GBps,
                                  inter_node_GBps=inter_node_GBps)
    parallel = dataclasses.replace(cfg.parallel, global_batch=global_batch)
    return dataclasses.replace(cfg, cluster=cluster, parallel=parallel)
