"""The `[cluster]` section of a config: the hardware a run is planned for, as one group of
devices (cluster.gpu, cluster.gpus, links) or several (`[[cluster.groups]]`), with prices
and failure figures for `fivefold plan --objective` (docs/run_spec.md, docs/planner.md).
Kept apart from fivefold.config so that file stays small; config re-exports both classes,
and fivefold.cluster_groups checks their values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class GroupConfig:
    gpu: str = _doc("this group's hardware profile name or calibrated profile file", "")
    gpus: int = _doc("devices in this group", 0)
    gpus_per_node: int | None = _doc("devices sharing this group's fast fabric; default the "
                                     "profile's NVLink domain", None)
    intra_node_GBps: float | None = _doc("per-device one-direction bandwidth in a node", None)
    inter_node_GBps: float | None = _doc("per-device one-direction bandwidth across nodes", None)
    usd_per_gpu_hour: float | None = _doc("price of one device-hour (plan --objective cost)",
                                          None)
    mtbf_hours_per_gpu: float | None = _doc("device-hours between job-stopping failures, per "
                                            "device (plan --objective goodput)", None)


@dataclass
class ClusterConfig:
    groups: list[GroupConfig] | None = _doc("[[cluster.groups]]: a cluster of several device "
                                            "groups, for plan and simulate (docs/run_spec.md); "
                                            "replaces gpu and gpus", None)
    usd_per_gpu_hour: float | None = _doc("price of one device-hour (plan --objective cost)",
                                          None)
    mtbf_hours_per_gpu: float | None = _doc("device-hours between job-stopping failures, per "
                                            "device (plan --objective goodput)", None)
    restart_minutes: float = _doc("minutes from a failure to the relaunched job's first step, "
                                  "checkpoint loading aside (goodput)", 10.0)
    storage_GBps: float | None = _doc("aggregate write/read bandwidth of the checkpoint "
                                      "storage; default the hosts' local NVMe", None)
    gpu: str | None = _doc("hardware profile name or calibrated profile file; default: detected",
                           None)
    gpus: int | None = _doc("total devices (plan/simulate); train uses the launched ranks", None)
    gpus_per_node: int = _doc("devices sharing the fast fabric (NVLink domain)", 8)
    intra_node_GBps: float | None = _doc("per-device one-direction bandwidth in a node", None)
    inter_node_GBps: float | None = _doc("per-device one-direction bandwidth across nodes", None)
