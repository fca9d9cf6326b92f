"""Goodput: the share of wall-clock time that becomes training progress under failures.

A job of N devices stops at every failure of any of them; with each group's device-hours
between job-stopping failures (mtbf_hours_per_gpu) the job's failures arrive at rate
sum(gpus_g / mtbf_g), mean time between them M = 1 / that rate. After a failure the job
relaunches (cluster.restart_minutes: scheduling, process start, collective set-up), loads
its last checkpoint (and reshards it to the ranks it now has), and recomputes the work done
since that checkpoint. Checkpoints cost their save time delta each, every interval tau of
work.

- delta: the plan's checkpoint bytes (every parameter in the compute precision, its fp32
  master copy unless the precision is fp32, and the optimizer's state: what the runtime's
  DCP checkpoint writes, replicated state written once) spread evenly over the ranks, each
  writing through its host's link and its share of the host's NVMe drives
  (fivefold.hardware.HostTier), the slowest group deciding; capped by the cluster's shared
  storage (cluster.storage_GBps) when set. The load on restart reads them back the same way.
  Saves are taken as blocking (fivefold's DCP save is synchronous).
- tau: Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006):
  sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta for delta < 2M,
  else M. Its first term is Young's first-order optimum sqrt(2 delta M)
  (J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9), 1974).
- the productive fraction: Daly's complete model for exponentially distributed failures
  (ibid.): wall time T_w = M exp(R/M) (exp((tau + delta)/M) - 1) T_s / tau for T_s
  of work, so goodput = tau / (M exp(R/M) (exp((tau + delta)/M) - 1)), R the restart
  (relaunch plus checkpoint load).

The plan writes tau + delta (the wall time between the starts of two saves, which is what
the trainer's clock measures, fivefold.train.save_schedule) as train.checkpoint_minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.config import Config, ConfigError
from fivefold.parallel.plan import PRECISION_BYTES
from fivefold.planner.cluster import DeviceGroup
from fivefold.planner.memory import OPTIMIZER_STATE_BYTES
from fivefold.planner.params import total_params


@dataclass(frozen=True)
class Goodput:
    fraction: float  # productive share of wall-clock time
    checkpoint_minutes: float  # tau + delta, what train.checkpoint_minutes is set to
    interval_s: float  # tau: work between checkpoints
    save_s: float  # delta
    load_s: float  # reading the checkpoint back on restart
    restart_s: float  # R: relaunch + load
    job_mtbf_h: float  # M
    checkpoint_bytes: int

    def to_json(self) -> dict:
        return {"fraction": self.fraction, "checkpoint_minutes": self.checkpoint_minutes,
                "interval_s": self.interval_s, "save_s": self.save_s, "load_s": self.load_s,
                "restart_s": self.restart_s, "job_mtbf_hours": self.job_mtbf_h,
                "checkpoint_bytes": self.checkpoint_bytes}


def checkpoint_bytes(cfg: Config, precision: str) -> int:
    """Bytes of one checkpoint: parameters, fp32 master copies, optimizer state (docstring).
    Muon and GaLore are counted at AdamW's 8 bytes per element (an upper bound)."""
    p = PRECISION_BYTES[precision]
    state = OPTIMIZER_STATE_BYTES.get(cfg.train.optimizer, OPTIMIZER_STATE_BYTES["adamw"])
    return total_params(cfg.model) * (p + (0 if p == 4 else 4) + state)


def _rank_Bps(g: DeviceGroup, write: bool) -> float:
    """One rank's share of its host's path to local drives: its link, its share of them."""
    h = g.prof.host
    drives = (h.nvme_write_GBps if write else h.nvme_read_GBps) * 1e9
    sharing = max(1, min(h.gpus, g.gpus_per_node))
    return min(h.link_Bps, drives / sharing)


def transfer_s(nbytes: float, groups: list[DeviceGroup], storage_GBps: float | None,
               write: bool) -> float:
    """Seconds to write (or read) `nbytes` spread evenly over every rank of `groups`."""
    ranks = sum(g.gpus for g in groups)
    local = max(nbytes / ranks / _rank_Bps(g, write) for g in groups)
    return max(local, nbytes / (storage_GBps * 1e9)) if storage_GBps else local


def job_mtbf_hours(groups: list[DeviceGroup]) -> float | None:
    """Mean hours between job-stopping failures; None when a group has no failure rate."""
    if any(g.mtbf_hours_per_gpu is None for g in groups):
        return None
    return 1.0 / sum(g.gpus / g.mtbf_hours_per_gpu for g in groups)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly 2006's higher-order optimum checkpoint interval (module docstring)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def daly_fraction(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Work over wall time under Daly 2006's complete model (module docstring)."""
    m = mtbf_s
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + save_s) / m))


def goodput(cfg: Config, groups: list[DeviceGroup], precision: str) -> Goodput | None:
    """The plan's goodput and chosen checkpoint interval; None without failure rates."""
    mtbf_h = job_mtbf_hours(groups)
    if mtbf_h is None:
        return None
    nbytes = checkpoint_bytes(cfg, precision)
    storage = cfg.cluster.storage_GBps
    save = transfer_s(nbytes, groups, storage, write=True)
    load = transfer_s(nbytes, groups, storage, write=False)
    restart = 60.0 * cfg.cluster.restart_minutes + load
    m = 3600.0 * mtbf_h
    tau = daly_interval(save, m)
    return Goodput(daly_fraction(tau, save, restart, m), (tau + save) / 60.0, tau, save, load,
                   restart, mtbf_h, nbytes)


def require_failure_rates(groups: list[DeviceGroup]) -> None:
    """`--objective goodput` needs every group's failure rate; ConfigError naming the key."""
    for g in groups:
        if g.mtbf_hours_per_gpu is None:
            raise ConfigError(f"{g.prefix}.mtbf_hours_per_gpu",
                              "--objective goodput needs the device-hours between "
                              "job-stopping failures, e.g. 50000 (Llama 3's 16K H100 run: "
                              "about 45,600, docs/planner.md)")


def require_prices(groups: list[DeviceGroup]) -> None:
    """`--objective cost` needs every group's price; ConfigError naming the key."""
    for g in groups:
        if g.usd_per_gpu_hour is None:
            raise ConfigError(f"{g.prefix}.usd_per_gpu_hour",
                              "--objective cost needs the price of one device-hour in USD, "
                              "e.g. 2.5")
