"""The host tier of optimizer offload: fp32 master weights, Adam's moments and the gradient
of the offloaded units in host memory, the AdamW step on the CPU, overlapped with the next
step's forward (ZeRO-Offload, arXiv 2101.06840, Sec. 4-5; ZeRO-Infinity, arXiv 2104.07857,
Sec. 5 for the disk tier, fivefold.memory.nvme_store).

The data-parallel engine (fivefold.parallel.data_parallel) hands this module the units that
`ParallelPlan.offloaded_units` picks, each as this rank's shard of the unit's flat buffer:

* host memory per element: the fp32 master (4 B) and an fp32 gradient buffer (4 B), plus,
  with tier "cpu", exp_avg and exp_avg_sq (8 B); with tier "nvme" the moments live in
  files (fivefold.memory.nvme_store, two versions: 16 B per element on disk). Host buffers
  are pinned when the compute device is a GPU, so the copies to and from it are DMA
  transfers; on a CPU-only machine "host" is a second CPU buffer.
* the gradient streams to the host as soon as the unit's reduced gradient is final (when
  the engine waits for its last collective), and the global norm is clipped there;
* SGD (`train.optimizer = "sgd"`): the same host master and gradient, plus, with momentum
  (train.beta1 > 0), its fp32 momentum (4 B on the host with "cpu", 8 B on disk with
  "nvme"), without momentum nothing more; the step is `cpu_sgd_`, torch's SGD with the L2
  weight decay added to the gradient, bit for bit the engine's in-memory SGD.
* the step: decoupled weight decay on the matrices, then Adam, by torch's multi-tensor
  ("foreach") AdamW kernel, which on the CPU gives bit for bit what the engine's in-memory
  torch AdamW gives, in pieces of 65,536 elements so that its passes stay in cache (1.5x
  over whole tensors, measured), through the disk tier's chunks with nvme; or, with
  `parallel.offload_kernel = "fused"`, torch's fused CPU kernel, about 5x faster and as fast
  as DeepSpeed's CPU Adam, which rounds differently (bench/offload.py; docs/memory.md);
* the updated master is copied back to the unit's compute shard; the engine then
  re-publishes it (stages 1-2: its usual all-gather).

Overlap: with gradient clipping the global norm needs every gradient, so no update can
start before backward has finished and the norm is known: that part does not overlap. The
updates then run unit by unit in forward order on one background thread while the trainer
goes on (logging, the next step's data) and the next forward starts; that forward waits per
unit, in a forward pre-hook, for the unit's update (`wait`). Each unit's update reads and
writes only its own tensors, so the results are bit-identical to running them in order
before the next step. Collectives stay on the calling thread (the stage 1-2 all-gather runs
in the pre-hook), so every rank issues them in one order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from fivefold.config import TrainConfig
from fivefold.memory.nvme_store import NvmeStore


@dataclass(frozen=True)
class Offload:
    """Where the offloaded units' optimizer goes: `tier` "cpu" or "nvme" (files under
    offload_path/rank{rank}/), the share of units (ParallelPlan.offloaded_units) and the
    CPU AdamW `kernel` ("foreach" or "fused", `cpu_adamw_`)."""

    tier: str
    path: str | None
    fraction: float
    rank: int = 0
    kernel: str = "foreach"


CHUNK_ELEMENTS = 1 << 16  # the cpu tier's update runs in L2-sized pieces (measured fastest)


def decay_ranges(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, stop) runs of True in a 1-D bool mask (the matrices of a unit's shard)."""
    edges = torch.nonzero(torch.cat([torch.zeros(1, dtype=torch.int8), mask.cpu().to(torch.int8),
                                     torch.zeros(1, dtype=torch.int8)]).diff()).flatten()
    edges = edges.tolist()
    return list(zip(edges[::2], edges[1::2]))


def ranges_within(ranges: list[tuple[int, int]], start: int, stop: int
                  ) -> list[tuple[int, int]]:
    """`ranges` cut to [start, stop), relative to start."""
    return [(max(a, start) - start, min(b, stop) - start) for a, b in ranges
            if a < stop and b > start]


def cpu_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, updates: int, lr: float, train: TrainConfig,
               decay: list[tuple[int, int]], fused: bool = False) -> None:
    """One AdamW update in place of host tensors (any contiguous slice of a unit's shard:
    every operation is elementwise), after `updates` earlier ones: decoupled weight decay on
    the `decay` ranges, then torch's foreach Adam with weight decay 0, bit for bit what the
    engine's in-memory path computes (its masked multiply by 1 - lr wd leaves the other
    elements as they are, as skipping them does). `fused`: torch's fused CPU Adam kernel
    instead, one pass over memory, which orders its float operations otherwise (about 1e-8
    apart after a few steps at lr 1e-3)."""
    if train.weight_decay:
        factor = 1.0 - lr * train.weight_decay
        for start, stop in decay:
            master[start:stop].mul_(factor)
    step = torch.tensor(float(updates))  # the kernel counts it up to updates + 1
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [step], foreach=not fused,
         fused=fused or None, amsgrad=False, beta1=train.beta1, beta2=train.beta2, lr=lr,
         weight_decay=0.0, eps=train.eps, maximize=False, decoupled_weight_decay=True)


def state_kinds(train: TrainConfig) -> tuple[str, ...]:
    """The fp32 per-element optimizer states the host step keeps, as torch names them:
    AdamW's two moments, SGD's momentum buffer (none without momentum)."""
    if train.optimizer == "sgd":
        return ("momentum_buffer",) if train.beta1 else ()
    return ("exp_avg", "exp_avg_sq")


def cpu_sgd_(master: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor | None,
             lr: float, train: TrainConfig, decay: list[tuple[int, int]]) -> None:
    """One SGD update in place of host tensors (a slice of a unit's shard starting at a
    multiple of CHUNK_ELEMENTS): the matrices' L2 weight decay added to the gradient on the
    `decay` ranges, then torch's single-tensor SGD with momentum train.beta1, bit for bit
    what the engine's in-memory SGD computes on the CPU. The decay is its masked add over the
    whole slice, not an add per range: the CPU kernel rounds its vector body (fused
    multiply-add) and its scalar tail differently, and ranges would move the tails. A zero
    momentum buffer before the first update is bit for bit torch's first step
    (0 * beta1 + g = g)."""
    if train.weight_decay and decay:
        mask = torch.zeros(master.shape, dtype=torch.bool)
        for start, stop in decay:
            mask[start:stop] = True
        grad.add_(torch.where(mask, master, 0.0), alpha=train.weight_decay)
    sgd([master], [grad], [momentum], foreach=False, fused=None, grad_scale=None,
        found_inf=None, weight_decay=0.0, momentum=train.beta1 if momentum is not None else 0.0,
        lr=lr, dampening=0.0, nesterov=False, maximize=False)


def cpu_step_(train: TrainConfig, master: torch.Tensor, grad: torch.Tensor,
              states: tuple[torch.Tensor, ...], updates: int, lr: float,
              decay: list[tuple[int, int]], fused: bool = False) -> None:
    """The host update of `train.optimizer` over one slice, its `state_kinds` in `states`."""
    if train.optimizer == "sgd":
        cpu_sgd_(master, grad, states[0] if states else None, lr, train, decay)
    else:
        cpu_adamw_(master, grad, *states, updates, lr, train, decay, fused)


def chunked_step_(train: TrainConfig, master: torch.Tensor, grad: torch.Tensor,
                  states: tuple[torch.Tensor, ...], updates: int, lr: float,
                  decay: list[tuple[int, int]], fused: bool = False) -> None:
    """`cpu_step_` over whole host tensors, CHUNK_ELEMENTS at a time (the cpu tier's step)."""
    numel = master.numel()
    for start in range(0, numel, CHUNK_ELEMENTS):
        stop = min(start + CHUNK_ELEMENTS, numel)
        cpu_step_(train, master[start:stop], grad[start:stop],
                  tuple(t[start:stop] for t in states), updates, lr,
                  ranges_within(decay, start, stop), fused)


def chunked_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, updates: int, lr: float, train: TrainConfig,
                   decay: list[tuple[int, int]], fused: bool = False) -> None:
    """`cpu_adamw_` over whole host tensors, CHUNK_ELEMENTS at a time (the cpu tier's step)."""
    numel = master.numel()
    for start in range(0, numel, CHUNK_ELEMENTS):
        stop = min(start + CHUNK_ELEMENTS, numel)
        cpu_adamw_(master[start:stop], grad[start:stop], exp_avg[start:stop],
                   exp_avg_sq[start:stop], updates, lr, train, ranges_within(decay, start, stop),
                   fused)


class HostUnit:
    """One offloaded unit's host state: master, gradient buffer, decay mask and (tier cpu)
    the optimizer's per-element `states` (`state_kinds`); `target` is the device tensor the
    master is published to."""

    def __init__(self, name: str, master: torch.Tensor, decay: torch.Tensor,
                 target: torch.Tensor, tier: str, kinds: int = 2):
        pin = target.device.type == "cuda"
        self.name, self.target = name, target

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            return out.copy_(t)

        self.master = torch.nn.Parameter(host(master.detach().float()))
        self.grad = host(torch.zeros_like(master, dtype=torch.float32))
        self.decay = decay_ranges(decay)
        self.states: tuple[torch.Tensor, ...] = ()
        if tier == "cpu":
            self.states = tuple(torch.zeros_like(self.grad) for _ in range(kinds))

    def host_bytes(self) -> int:
        return self.master.nbytes + self.grad.nbytes + sum(t.nbytes for t in self.states)


class HostOptimizer:
    """AdamW (or SGD) over the offloaded units, on the CPU, one background update per unit.

    `submit(lr)` queues every unit's update in forward order (and, with nvme, the commit of
    the new version after them); `wait(i)` blocks until unit i's update has been published
    to its device target; `wait_all()` until everything queued is done."""

    def __init__(self, units: list[HostUnit], train: TrainConfig, offload: Offload):
        self.units, self.train = units, train
        self.fused = offload.kernel == "fused"
        self.kinds = state_kinds(train)
        self.updates = 0  # updates applied so far (every unit steps together)
        self.store = None
        if offload.tier == "nvme" and self.kinds:
            directory = Path(offload.path) / f"rank{offload.rank}"
            self.store = NvmeStore(directory, [(u.name, u.master.numel()) for u in units],
                                   moments=len(self.kinds))
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-adam")
        self.futures: dict[int, Future] = {}
        self.tail: Future | None = None  # the last queued job (nvme: the commit)
        self._handed_out: list[dict[str, torch.Tensor]] = []  # the last `states()`

    def host_bytes(self) -> int:
        return sum(u.host_bytes() for u in self.units)

    def disk_bytes(self) -> int:
        return self.store.disk_bytes() if self.store else 0

    def submit(self, lr: float) -> None:
        """Queue this step's update of every unit, in forward order."""
        self.wait_all()
        updates = self.updates
        for i, unit in enumerate(self.units):
            self.futures[i] = self.worker.submit(self._update, unit, updates, lr)
        self.updates = updates + 1
        self.tail = (self.worker.submit(self.store.commit, updates + 1) if self.store
                     else self.futures.get(len(self.units) - 1))

    @torch.no_grad()
    def _update(self, unit: HostUnit, updates: int, lr: float) -> None:
        if self.store is None:
            chunked_step_(self.train, unit.master.data, unit.grad, unit.states, updates, lr,
                          unit.decay, self.fused)
        else:
            def chunk(start, stop, *states):
                cpu_step_(self.train, unit.master.data[start:stop], unit.grad[start:stop],
                          states, updates, lr, ranges_within(unit.decay, start, stop),
                          self.fused)
            self.store.update_unit(unit.name, chunk)
        unit.target.copy_(unit.master.data)

    def wait(self, i: int) -> None:
        """Unit i's queued update is done and published (re-raises its error)."""
        future = self.futures.pop(i, None)
        if future is not None:
            future.result()

    def wait_all(self) -> None:
        for i in list(self.futures):
            self.wait(i)
        if self.tail is not None:
            self.tail.result()
            self.tail = None

    # ------------------------------------------------------------------ checkpoints

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Per unit, the optimizer's state as torch keeps it (AdamW: {step, exp_avg,
        exp_avg_sq}; SGD: {momentum_buffer} or nothing): with cpu the live host tensors, with
        nvme the committed version read from disk, which a checkpoint load fills and
        `after_load` writes back."""
        self.wait_all()
        out = []
        for unit in self.units:
            states = unit.states if self.store is None else self.store.read_unit(unit.name)
            state = dict(zip(self.kinds, states))
            if self.train.optimizer != "sgd":
                state["step"] = torch.tensor(float(self.updates))
            out.append(state)
        self._handed_out = out
        return out

    def after_load(self) -> None:
        """A checkpoint has filled the tensors of the last `states()`: take its step count
        and, with nvme, write its moments as a new committed version (nothing if no
        `states()` was handed out since the last load)."""
        loaded, self._handed_out = self._handed_out, []
        if not loaded:
            return
        steps = {int(state["step"].item()) for state in loaded if "step" in state}
        if len(steps) > 1:
            raise ValueError(f"offloaded units hold different step counts {sorted(steps)}")
        self.updates = steps.pop() if steps else self.updates  # SGD keeps no step count
        if self.store is not None:
            for unit, state in zip(self.units, loaded):
                self.store.write_unit(unit.name, *(state[kind] for kind in self.kinds))
            self.store.commit(self.updates)
