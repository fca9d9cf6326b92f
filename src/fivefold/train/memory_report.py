"""The memory report at the end of `fivefold train`: what this rank held, measured, next to
the planner's prediction (ZeRO-Offload's and ZeRO-Infinity's question, arXiv 2101.06840 and
2104.07857: where do parameters, gradients, optimizer states and activations live, and how
many bytes each).

Measured, on this rank:

* parameters, gradients, master copies and optimizer states: the data-parallel engine's own
  record of its flat buffers (fivefold.parallel.data_parallel), or, on the plain path, the
  model's parameters, the gradients they held at the first update and the tensors in torch's
  optimizer state (LOMO keeps no full gradient and no state); these rows are the device's;
* with offload (fivefold.memory.offload), the host's and the disk's: the offloaded units'
  master, gradient buffer and (cpu) moments in host memory, and (nvme) the bytes of the
  moments' two versions on disk, as the engine records them;
* activations: the bytes autograd saved for backward during the run's first micro-batch and
  still holds at the end of its forward, counted by saved-tensor hooks
  (fivefold.memory.activation_count's `resident_bytes`: ZeRO-3's released weight buffers
  are not activations; not with pp > 1, whose forwards run inside the schedule); under
  activation offload (fivefold.memory.activation_offload) the offloaded blocks' share is
  the host's row, "activations, host", apart from the device's;
* the process peak: the allocator's peak on a GPU, the resident set size on the CPU (which
  also holds the Python runtime, the data and torch's workspaces, so it is a bound, not a
  sum of the rows above).

The prediction comes from the launcher (fivefold.planner.rank_memory), since the trainer does
not import the planner; `fivefold train` passes it in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from fivefold.memory.activation_count import SavedActivations
from fivefold.optim import optimizer_state_bytes
from fivefold.train.metrics import peak_memory_bytes

ROWS = (("params", "parameters"), ("grads", "gradients"),
        ("optimizer", "optimizer states + master copies"),
        ("host", "optimizer states, host"), ("disk", "optimizer states, disk"),
        ("activations_per_micro_batch", "activations, one micro-batch"),
        ("activations_host", "activations, host, one micro-batch"))


class MemoryProbe:
    """Collects one run's measured figures; `report` puts them next to the prediction."""

    def __init__(self):
        self.activations: int | None = None
        self.activations_host: int | None = None
        self.grads: int | None = None

    @contextlib.contextmanager
    def count_activations(self, model: nn.Module):
        """Around the run's first micro-batch's forward: counts what autograd saves (later
        calls count nothing)."""
        if self.activations is not None:
            yield
            return
        with SavedActivations(model) as counter:
            yield
        self.activations = counter.resident_bytes
        self.activations_host = counter.host_bytes

    def note_grads(self, grads: Iterable[torch.Tensor]) -> None:
        """The plain path's gradients, at the first update (before they are freed)."""
        if self.grads is None:
            self.grads = _unique_bytes(grads)

    def report(self, model: nn.Module, model_state: dict[str, int],
               optimizers: Iterable[torch.optim.Optimizer], predicted: dict | None, rank: int,
               device: torch.device) -> tuple[dict, list[str]]:
        """(the summary.json entry, the lines printed at the end of the run). `model_state`:
        the engine's record (empty on the plain path); `optimizers`: the plain path's torch
        optimizers (an OptimizerPair's two, or none)."""
        if model_state:
            states = {"params": model_state["params"], "grads": model_state["grads"],
                      "optimizer": model_state["master"] + model_state["optimizer"],
                      "host": model_state["host"], "disk": model_state["disk"]}
        else:
            states = {"params": _unique_bytes(model.parameters()), "grads": self.grads or 0,
                      "optimizer": optimizer_state_bytes(optimizers), "host": 0, "disk": 0}
        measured = {**states, "activations_per_micro_batch": self.activations,
                    "activations_host": self.activations_host,
                    "process_peak": peak_memory_bytes(device)}
        lines = [f"memory on rank {rank} (MiB, measured / planner):"]
        for key, label in ROWS:
            want = None if predicted is None else predicted.get(key)  # host, disk: planner's
            lines.append(f"  {label:36s} {_mib(measured[key]):>10s} / {_mib(want)}")
        if predicted and predicted["micro_batches_in_flight"] > 1:
            lines.append(f"  (the pipeline holds up to {predicted['micro_batches_in_flight']} "
                         "micro-batches' activations at its peak)")
        peak = "allocator peak" if device.type == "cuda" else "resident set size, a bound"
        lines.append(f"  process peak ({peak}) {_mib(measured['process_peak']):>10s}")
        return {"rank": rank, "measured": measured, "predicted": predicted}, lines


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2 ** 20:.2f}"
