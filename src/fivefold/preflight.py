"""The pre-flight memory check of `fivefold train`: refuse, before any rank starts (and before
the tokenizer and the data are prepared), a run whose predicted memory cannot fit this machine.

The prediction is the memory report's planner column (fivefold.planner.rank_memory): per rank
the parameters, gradients, optimizer states (master copies included) and one micro-batch's
saved activations times the micro-batches a pipeline stage holds at its peak, plus the
offloaded optimizer state in host memory. What it is measured against:

* on a GPU, each local rank's device: `torch.cuda.get_device_properties(...).total_memory`
  against that rank's parameters, gradients, optimizer states and activations; the host
  (offload's tier, all local ranks together) against MemAvailable;
* on the CPU, the host: every local rank's whole prediction together against MemAvailable
  (/proc/meminfo), since the ranks share the machine's memory.

Margin: the check refuses only when the prediction alone exceeds what is available. The
prediction leaves out the CUDA context, the allocator's caching and fragmentation, torch's
workspaces, the Python runtime and the data, so it is a lower bound of what the run uses:
a refused run cannot fit, while a run that passes may still run out of memory near the
limit (the memory report at the end of the run shows measured against predicted).

A refusal names the biggest term and the single switches (ZeRO stage, recomputation,
micro-batch, precision, offload) under which the same prediction fits, each tried as the
run's own config would be (a switch the runtime refuses for this run is not offered).
`train.preflight = false` skips the check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import Config, ConfigError
from fivefold.parallel.plan import ParallelPlan, training_plan
from fivefold.planner.rank_memory import predicted_rank_memory

GiB = 2**30
TERMS = (("params", "parameters"), ("grads", "gradients"),
         ("optimizer", "optimizer states"), ("activations", "activations"))
# single switches tried when a run does not fit: (section, key, value)
SWITCHES = (("parallel", "zero_stage", 1), ("parallel", "zero_stage", 2),
            ("parallel", "zero_stage", 3), ("parallel", "recompute", "selective"),
            ("parallel", "recompute", "full"), ("parallel", "micro_batch", 1),
            ("parallel", "precision", "bf16"), ("parallel", "offload", "cpu"))


@dataclass(frozen=True)
class Machine:
    """What this machine offers the local ranks, in bytes (None: unknown, not checked)."""

    device_type: str  # "cpu" | "cuda"
    device_bytes: int | None  # one GPU's memory; None on the CPU
    host_bytes: int | None  # MemAvailable


@dataclass(frozen=True)
class Need:
    """The predicted bytes of the local ranks: the fullest device's terms and the host's."""

    device_terms: dict[str, float]  # TERMS of the fullest local rank (GPU) or all ranks (CPU)
    host_bytes: float  # what the host must hold (CPU: everything; GPU: offloaded state)

    def fits(self, machine: Machine) -> bool:
        device_ok = (machine.device_type == "cpu" or machine.device_bytes is None
                     or self.total <= machine.device_bytes)
        host_ok = machine.host_bytes is None or self.host_bytes <= machine.host_bytes
        return device_ok and host_ok

    @property
    def total(self) -> float:
        return sum(self.device_terms.values())

    def compared(self, machine: Machine) -> float:
        """The bytes set against the machine's main memory: the host's on the CPU, else the
        fullest device's."""
        return self.host_bytes if machine.device_type == "cpu" else self.total


def predicted_need(cfg: Config, plan: ParallelPlan, local_ranks: int, device_type: str,
                   first_rank: int = 0) -> Need:
    """The prediction for global ranks first_rank .. first_rank + local_ranks - 1."""
    per_rank = []
    host = 0.0
    for rank in range(first_rank, first_rank + local_ranks):
        r = predicted_rank_memory(cfg, plan, rank, device_type)
        acts = r["activations_per_micro_batch"] * r["micro_batches_in_flight"]
        per_rank.append({"params": r["params"], "grads": r["grads"],
                         "optimizer": r["optimizer"], "activations": acts})
        host += r["host"]
    if device_type == "cpu":  # the ranks share the host's memory
        terms = {k: sum(t[k] for t in per_rank) for k, _ in TERMS}
        return Need(terms, host + sum(terms.values()))
    return Need(max(per_rank, key=lambda t: sum(t.values())), host)


def check(cfg: Config, plan: ParallelPlan, world_size: int, local_ranks: int,
          machine: Machine, fp8_units: bool = False, first_rank: int = 0) -> None:
    """ConfigError when the predicted memory of global ranks first_rank .. first_rank +
    local_ranks - 1 exceeds `machine` (module docstring): the biggest term, and the single
    switches under which it fits."""
    need = predicted_need(cfg, plan, local_ranks, machine.device_type, first_rank)
    if need.fits(machine):
        return
    key, label = max(TERMS, key=lambda t: need.device_terms[t[0]])
    where, have, total = _where(need, machine, local_ranks)
    terms = ", ".join(f"{name} {need.device_terms[k] / GiB:.1f}" for k, name in TERMS)
    fixes = [f"--set {s}.{k}={v} ({n.compared(machine) / GiB:.1f} GiB)"
             for s, k, v, n in _fitting_switches(cfg, world_size, local_ranks, machine,
                                                 fp8_units, first_rank)]
    advice = ("it fits with one of: " + "; ".join(fixes) if fixes else
              "no single switch (ZeRO stage, recompute, micro-batch, precision, offload) "
              "makes it fit: choose a smaller model (model.preset or model.*), a shorter "
              "model.seq_len, or a machine with more memory")
    raise ConfigError("model" if key in ("params", "grads", "optimizer") else
                      "parallel.micro_batch",
                      f"the run cannot fit: the planner predicts {total / GiB:.1f} GiB {where} "
                      f"({terms} GiB), more than the {have / GiB:.1f} GiB available; the "
                      f"biggest term is {label} ({need.device_terms[key] / GiB:.1f} GiB); "
                      f"{advice}; or skip this check with --set train.preflight=false")


def _where(need: Need, machine: Machine, local_ranks: int) -> tuple[str, float, float]:
    """(what is compared, its capacity, the predicted bytes) for the failing check."""
    if machine.device_type == "cpu":
        ranks = f"{local_ranks} CPU ranks" if local_ranks > 1 else "the CPU rank"
        return f"in host memory for {ranks}", machine.host_bytes, need.host_bytes
    if machine.device_bytes is not None and need.total > machine.device_bytes:
        return "on the fullest GPU", machine.device_bytes, need.total
    return ("in host memory (offloaded optimizer state)", machine.host_bytes,
            need.host_bytes)


def _fitting_switches(cfg: Config, world_size: int, local_ranks: int, machine: Machine,
                      fp8_units: bool, first_rank: int) -> list[tuple[str, str, object, Need]]:
    out = []
    for section, key, value in SWITCHES:
        if getattr(getattr(cfg, section), key) == value:
            continue
        changed = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
        try:
            plan = training_plan(changed, world_size, machine.device_type, fp8_units)
        except ConfigError:
            continue  # the runtime refuses this switch for this run
        need = predicted_need(changed, plan, local_ranks, machine.device_type, first_rank)
        if need.fits(machine):
            out.append((section, key, value, need))
    return out


def mem_available_bytes(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def this_machine(device) -> Machine:
    """What `device` (a torch.device) and the host offer the local ranks."""
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        return Machine("cuda", total, mem_available_bytes())
    return Machine("cpu", None, mem_available_bytes())
