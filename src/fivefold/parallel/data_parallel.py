"""Data parallelism: DDP and ZeRO stages 1, 2 and 3, flat or hierarchical (MiCS / HSDP).

One engine, four stages, each keeping exactly the memory its paper promises (ZeRO, arXiv
1910.02054, Sec. 5; Fig. 1), with Ψ parameters, n the sharding degree, p/g the bytes of the
compute and reduce dtypes and fp32 master weights plus Adam moments (K = 12 bytes per
parameter under mixed precision, 8 when the compute copy is itself fp32):

  stage 0 (DDP)   params pΨ      grads gΨ      optimizer KΨ      all-reduce grads      2Ψ
  stage 1         params pΨ      grads gΨ      optimizer KΨ/n    reduce-scatter grads,
                                                                 all-gather params     2Ψ
  stage 2         params pΨ      grads gΨ/n    optimizer KΨ/n    the same              2Ψ
  stage 3         params pΨ/n    grads gΨ/n    optimizer KΨ/n    all-gather params in
                                                                 forward and backward,
                                                                 reduce-scatter grads  3Ψ

Mixed precision as in the paper: compute copies in bf16/fp16, fp32 master weights and Adam
moments; stages 2-3 reduce-scatter in `reduce_dtype`, stages 0-1 reduce their gradient
buffer in place, in the compute dtype (the parameters' .grad are views of it).

Parameters live in flat units (fivefold.parallel.flat_unit). Gradient communication is
bucketed by unit and overlapped with backward: a unit's collective starts from a
post-accumulate-grad hook as soon as its last gradient exists, and the step waits for all of
them at the end (PyTorch DDP's design, arXiv 2006.15704). Stages 0 and 1 accumulate
micro-batch gradients locally and communicate once per optimizer step; stages 2 and 3
reduce-scatter every micro-batch so that no full gradient outlives its unit's backward.
Stage 3 gathers a block's parameters just before its forward and again before its backward
(prefetching the next block's), and frees them after (FSDP's resharding). The root unit
(embeddings, final norm, output head) stays gathered through a micro-batch's forward and
backward, as FSDP's root does.

Under a pipeline (fivefold.parallel.pipeline.executor) the engine sits on a PipelineStage:
the executor calls `hold_root()` before the step's first action, because the first stage's
tied-weight send reads the embedding before any forward, and the root then stays gathered
through every micro-batch's forward and backward until `after_backward()` at the end of the
step (evaluation: until `release_root()`). Blocks keep gather-before / free-after per use:
each forward or backward action runs all of one virtual stage's blocks in order, and the
one-block prefetch takes the rank's next (previous) block, under interleaving possibly the
next chunk's first, which stays gathered until its use. A zero-bubble I pass gathers blocks
and leaves them gathered; its W pass frees them once their gradients are complete, and may
run on blocks that an F in between freed: the weight gradients need saved inputs and output
gradients only (fivefold.parallel.pipeline.executor). Each unit's gradient is
reduce-scattered once per micro-batch, as without a pipeline.

Hierarchical sharding (MiCS, arXiv 2205.00119; FSDP's hybrid sharding): with
`parallel.zero_group = k` the shard axis has k ranks and dp/k groups replicate it; gradients
sync in two hops, reduce-scatter within the shard group then all-reduce of the shard across
replicas, and parameter all-gathers never leave the shard group.

ZeRO++ (arXiv 2306.10209; fivefold.comm.zeropp) adds three switches: qwZ quantizes the
stage-3 weight all-gathers over the shard group, hpZ keeps a node-local secondary weight shard so the
backward all-gather stays inside the node, qgZ reduce-scatters gradients as int8 through two
all-to-all hops. Quantized units are padded so every shard holds whole quantization blocks.

Muon (`train.optimizer = "muon"`, stage 0 without tensor parallelism, where every rank holds
whole matrices): the optimizers of fivefold.optim step per-parameter views of the flat
master, Muon's momentum (4 bytes) on the blocks' matrices and AdamW's moments elsewhere.

Expert parallelism (fivefold.parallel.expert): with `expert_axes` each MoE block's stacked
expert matrices form a unit of their own, reduced over the "edp" ranks that hold copies of
the same experts (all-reduced at stage 0, sharded over edp at stages 1-3) while the block's
dense parameters keep the data-parallel axes; a ZeRO-3 block gathers both its units.

Offload (`parallel.offload`, ZeRO-Offload / ZeRO-Infinity; fivefold.memory.offload and
fivefold.memory.nvme_store): the first units by `ParallelPlan.offloaded_units` keep their
fp32 master, gradient buffer and Adam moments in host memory (the moments on disk with
nvme) and are updated there on a background thread; the device keeps their compute copy
and its gradient, and no master or optimizer state for them; the rest keep the device's
torch AdamW. A forward pre-hook on each module waits for its units' updates and, at stages
1-2, all-gathers them then, on the calling thread, instead of in `step`. Each rank offloads
its own shards.

Every collective goes through fivefold.comm.collectives, so the ledger sees each byte; the
engine records its model-state bytes per rank there too ("host" and "disk": offload's).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dataclasses import dataclass

from fivefold.comm import collectives as C
from fivefold.comm import zeropp
from fivefold.comm.ledger import Ledger
from fivefold.comm.quantize import BLOCK
from fivefold.config import TrainConfig
from fivefold.memory.offload import HostOptimizer, HostUnit, Offload
from fivefold.optim import optimizer_for, optimizer_state_bytes
from fivefold.parallel.expert import is_expert_param
from fivefold.parallel.flat_unit import FlatUnit
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.plan import offloaded_unit_count


def split_units(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]], nn.Module | None]]:
    """(name, named params, module) per unit: the root unit first, then each block in order.

    Blocks are named by their key in `model.layers`, so a pipeline stage, whose `layers` holds
    blocks by their index in the whole model, keeps the plain model's names."""
    block_ids = {id(p) for p in model.layers.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in block_ids]
    units = [("root", root, None)]
    for i, block in model.layers.named_children():
        units.append((f"layers.{i}", [(f"layers.{i}.{n}", p) for n, p in block.named_parameters()],
                      block))
    return units


def split_expert_units(split: list, tag: str) -> list[tuple[str, list, nn.Module | None, bool]]:
    """`split_units`' units with each block's stacked expert matrices apart, in a unit
    "layers.i.experts{tag}" after its block's (expert parallelism: `tag` names the ep rank,
    whose experts differ from its peers'); (name, params, module, holds experts)."""
    out = []
    for name, params, module in split:
        apart = [module is not None and is_expert_param(n.split(".", 2)[2]) for n, _ in params]
        experts = [named for named, expert in zip(params, apart) if expert]
        dense = [named for named, expert in zip(params, apart) if not expert]
        out.append((name, dense, module, False))
        if experts:
            out.append((f"{name}.experts{tag}", experts, module, True))
    return out


@torch.no_grad()
def _place_flat(unit: FlatUnit, target: torch.Tensor, whole: dict[str, torch.Tensor],
                local: Callable[[str, torch.Tensor], torch.Tensor], stage: int) -> None:
    """Lay this rank's parts `local(name, whole[name])` of the unit's parameters out flat and
    padded, as the unit lays out its parameters, and copy this rank's shard of that buffer
    (the whole buffer at stage 0) into `target`."""
    flat = torch.zeros(unit.padded, dtype=target.dtype, device=target.device)
    for name, view in zip(unit.names, unit.views(flat)):
        part = local(name, whole[name])
        if part.shape != view.shape:
            raise ValueError(f"{name}: this rank's part has shape {tuple(part.shape)}, its "
                             f"unit {tuple(view.shape)}")
        view.copy_(part)
    target.copy_(flat if stage == 0 else flat[unit.shard_slice])


@dataclass(frozen=True)
class ZeroPP:
    """ZeRO++ switches and the number of shard-group ranks that share a node."""

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    ranks_per_node: int = 1

    @property
    def quantized(self) -> bool:
        return self.qwz or self.qgz


# Stages 2-3: reduce-scatters in flight at once; each holds its unit's full flat gradient, so
# this bounds the transient gradient memory to about two units while keeping the overlap.
MAX_INFLIGHT_REDUCE_SCATTERS = 2


class DataParallelEngine:
    """Owns the parameters, gradients and optimizer of a data-parallel model replica.

    Per optimizer step: `prepare_backward(last)` and `after_backward()` around each
    micro-batch's backward, then clipping of `masters`' gradients
    (fivefold.parallel.grad_clip), `step(lr)` and `zero_grad()`.
    """

    def __init__(self, model: nn.Module, stage: int, mesh: Mesh, train: TrainConfig,
                 device: torch.device, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None, zero_pp: ZeroPP = ZeroPP(),
                 shard_axes: tuple[str, ...] = ("dp_shard",),
                 expert_axes: tuple[C.Axis, C.Axis] | None = None,
                 offload: Offload | None = None):
        self.model, self.stage, self.train_cfg, self.zero_pp = model, stage, train, zero_pp
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype or param_dtype
        self.ledger: Ledger = mesh.ledger
        # `shard_axes` (ParallelPlan.shard_axes): dp_shard, and cp whose ranks also hold the
        # whole model and see other tokens
        if stage == 0:  # plain data parallel: one all-reduce over every data-parallel rank
            self.shard_axis = C.Axis("dp_shard", None, 1, 0, mesh.ledger)
            self.replicate_axis = mesh.joint_axis("dp_replicate", *shard_axes)
        else:
            self.shard_axis = mesh.joint_axis(*shard_axes)
            self.replicate_axis = mesh.axis("dp_replicate")
        model.to(device=device, dtype=param_dtype)
        # expert parallelism (fivefold.parallel.expert): the expert units' own axes, over the
        # edp ranks that hold copies of the same experts
        split = [(*unit, False) for unit in split_units(model)]
        unit_axes = {False: (self.shard_axis, self.replicate_axis)}
        if expert_axes is not None:
            ep_axis, edp_axis = expert_axes
            split = split_expert_units(split_units(model), f"{ep_axis.rank}of{ep_axis.size}")
            none = C.Axis("none", None, 1, 0, mesh.ledger)
            unit_axes[True] = (none, edp_axis) if stage == 0 else (edp_axis, none)
        self.unit_shard = [unit_axes[expert][0] for *_, expert in split]
        self.unit_replicate = [unit_axes[expert][1] for *_, expert in split]
        self.is_expert = [expert for *_, expert in split]
        multiple = BLOCK if zero_pp.quantized else 1
        self.units = [FlatUnit(name, params, axis.size, axis.rank, param_dtype, device,
                               multiple)
                      for (name, params, *_), axis in zip(split, self.unit_shard)]
        self.nodes = (zeropp.split_by_node(self.shard_axis, zero_pp.ranks_per_node)
                      if zero_pp.hpz or zero_pp.qgz else None)
        self.secondary: dict[int, torch.Tensor] = {}  # hpZ: node-local shards, forward->backward
        self.blocks = [module for _, _, module, _ in split]
        self.masters = [nn.Parameter(self._master_storage(u)) for u in self.units]
        self.grad_buffers = [torch.zeros(u.padded, dtype=param_dtype, device=device)
                             if stage <= 1 else None for u in self.units]
        self.grad_shards = [self._grad_shard_storage(i) for i in range(len(self.units))]
        if stage == 3:
            for unit, master in zip(self.units, self.masters):
                unit.shard = master.data if param_dtype == torch.float32 else master.data.to(
                    param_dtype)
                unit.free_full()
        self._attach_grad_views()
        self.decay_masks = [u.decay_mask() for u in self.units]
        self._unpublished: set[int] = set()  # offloaded units whose update is queued
        self._on_host: set[int] = set()  # offloaded units whose final gradient is copied
        self.host = self._offload(offload) if offload else None
        self.offloaded = len(self.host.units) if self.host else 0
        self.views: list[tuple[str, torch.Tensor]] = []  # Muon: each parameter's master
        if train.optimizer == "muon":  # stage 0 only (config validation): whole matrices
            self.views = [(name, view) for unit, master in zip(self.units, self.masters)
                          for name, view in zip(unit.names, unit.views(master.detach()))]
            self.optimizer = optimizer_for(self.views, train, device)
        elif self.offloaded < len(self.masters):  # units kept on the device (the first
            # `offloaded` step in the host optimizer); weight decay is applied by the engine
            self.optimizer = torch.optim.AdamW(self.masters[self.offloaded:], lr=train.lr,
                                               weight_decay=0.0, eps=train.eps,
                                               betas=(train.beta1, train.beta2))
        else:
            self.optimizer = None
        self._pending: list[tuple[int, object, torch.Tensor | None]] = []
        self._ready = [0] * len(self.units)
        self._last = True
        self._prefetch: dict[int, object] = {}
        self._root_held = False  # stage 3 under a pipeline: the root outlives each forward
        for i, unit in enumerate(self.units):
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        if stage == 3:
            self._install_zero3_hooks()
        self.record_model_state()

    # ------------------------------------------------------------------ storage

    def _offload(self, offload: Offload) -> HostOptimizer:
        """Move the first units (ParallelPlan.offloaded_units' rule) to the host tier: their
        masters become host tensors, updated by a HostOptimizer that publishes each to the
        unit's compute copy or shard; the pre-hooks wait for it (`_await_update`)."""
        count = offloaded_unit_count([u.shard_numel for u in self.units], offload.fraction)
        host_units = []
        for i, unit in enumerate(self.units[:count]):
            target = (unit.full if self.stage == 0 else unit.shard if self.stage == 3
                      else unit.full[unit.shard_slice])
            host_units.append(HostUnit(unit.name, self.masters[i], self.decay_masks[i],
                                       target, offload.tier))
            self.masters[i] = host_units[-1].master
        modules: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, module in enumerate(self.blocks[:count]):
            module = module or self.model  # the root unit: before the whole forward
            modules.setdefault(id(module), (module, []))[1].append(i)
        def before(indices):
            def hook(module, args):
                for i in indices:
                    self._await_update(i)
            return hook

        for module, indices in modules.values():
            module.register_forward_pre_hook(before(indices))
        return HostOptimizer(host_units, self.train_cfg, offload)

    def _await_update(self, i: int) -> None:
        """Before offloaded unit i computes: its update is published; stages 1-2 then
        all-gather its shards (deferred from `step`, on this thread)."""
        if i not in self._unpublished:
            return
        self._unpublished.discard(i)
        self.host.wait(i)
        if self.stage in (1, 2):
            unit = self.units[i]
            C.all_gather(unit.full, unit.full[unit.shard_slice], self.unit_shard[i], "params")

    def wait_updates(self) -> None:
        """Every queued offloaded update done and published (before checkpoints, gathers of
        the whole state, pipelines' tied-weight sends)."""
        if self.host:
            for i in sorted(self._unpublished):
                self._await_update(i)
            self.host.wait_all()

    def _master_storage(self, unit: FlatUnit) -> torch.Tensor:
        """fp32 master: the compute buffer itself when that is fp32 (and not freed), else a copy."""
        source = unit.full if self.stage == 0 else unit.full[unit.shard_slice]
        if self.param_dtype == torch.float32 and self.stage < 3:
            return source
        return source.detach().float().clone()

    def _grad_shard_storage(self, i: int) -> torch.Tensor:
        """Where the reduced gradient of unit i lands: the whole buffer (stage 0), this rank's
        slice of it (stage 1, reduce-scattered in place), or a persistent shard (stages 2-3)."""
        unit = self.units[i]
        if self.stage == 0:
            return self.grad_buffers[i]
        if self.stage == 1:
            return self.grad_buffers[i][unit.shard_slice]
        return torch.zeros(unit.shard_numel, dtype=self.reduce_dtype, device=unit.device)

    def _attach_grad_views(self) -> None:
        """Stages 0-1: each parameter's .grad is a view of its unit's flat buffer, so autograd
        accumulates micro-batches straight into the bucket that is communicated."""
        for unit, buf in zip(self.units, self.grad_buffers):
            if buf is None:
                continue
            for p, grad in zip(unit.params, unit.views(buf)):
                p.grad = grad

    def record_model_state(self) -> None:
        """Bytes of parameters, gradients, optimizer states and master copies on this rank."""
        params = sum((u.shard if self.stage == 3 else u.full).nbytes for u in self.units)
        grads = sum(b.nbytes for b in self.grad_buffers if b is not None)
        if self.stage >= 2:
            grads = sum(g.nbytes for g in self.grad_shards)
        device_masters = self.masters[self.offloaded:]  # offloaded ones live on the host
        master = (0 if self.param_dtype == torch.float32 else
                  sum(m.nbytes for m in device_masters))
        optimizer = optimizer_state_bytes(self._torch_optimizers())
        self.ledger.model_state_bytes = {"params": params, "grads": grads, "master": master,
                                         "optimizer": optimizer,
                                         "total": params + grads + master + optimizer,
                                         "host": self.host.host_bytes() if self.host else 0,
                                         "disk": self.host.disk_bytes() if self.host else 0}

    # ------------------------------------------------------------------ ZeRO-3 gathering

    def _gather(self, i: int, prefetch: bool = False, backward: bool = False) -> None:
        """All-gather unit i's weights: plain, qwZ-quantized, or (hpZ, backward) in the node."""
        if i < self.offloaded:  # its shard is the host update's target
            self._await_update(i)
        unit = self.units[i]
        if i in self._prefetch or unit.is_gathered() or unit.numel == 0:
            return  # a middle pipeline stage's root holds nothing
        unit.allocate_full()
        if backward and i in self.secondary:
            work = C.all_gather(unit.full, self.secondary[i], self.nodes.intra, "params",
                                async_op=prefetch)
        elif self.zero_pp.qwz:
            work = zeropp.quantized_all_gather(unit.full, unit.shard, self.shard_axis, "params")
        else:
            work = C.all_gather(unit.full, unit.shard, self.unit_shard[i], "params",
                                async_op=prefetch)
        if prefetch:
            self._prefetch[i] = work

    def _ensure_gathered(self, i: int, backward: bool = False) -> None:
        if i in self._prefetch:
            C.wait(self._prefetch.pop(i))
        else:
            self._gather(i, backward=backward)

    def _install_zero3_hooks(self) -> None:
        last = len(self.units) - 1

        def before_model(module, args):
            self._ensure_gathered(0)

        def after_model(module, args, output):
            if not output.requires_grad and not self._root_held:  # evaluation
                self.units[0].free_full()

        def before_block(i):
            def hook(module, args):
                self._ensure_gathered(i)
                if self.zero_pp.hpz and torch.is_grad_enabled():  # kept until i's backward
                    g = self.nodes.intra
                    self.secondary[i] = self.units[i].full.view(g.size, -1)[g.rank].clone()
                if i < last:
                    self._gather(i + 1, prefetch=True)
            return hook

        def after_block(i):
            def hook(module, args, output):
                self.units[i].free_full()
                if output.requires_grad:
                    output.register_hook(lambda grad: self._before_block_backward(i))
            return hook

        self.model.register_forward_pre_hook(before_model)
        self.model.register_forward_hook(after_model)
        for i in range(1, last + 1):
            self.blocks[i].register_forward_pre_hook(before_block(i))
            self.blocks[i].register_forward_hook(after_block(i))

    def _before_block_backward(self, i: int) -> None:
        self._ensure_gathered(i, backward=True)
        if i > 1:
            self._gather(i - 1, prefetch=True, backward=True)

    def hold_root(self) -> None:
        """Stage 3 under a pipeline: gather the root unit now and keep it gathered until
        `after_backward` or `release_root` (the first stage's tied-weight send reads it
        before any forward, and each micro-batch uses it again). No-op at stages 0-2, but
        for offload's pending updates, which the send must not overtake."""
        self.wait_updates()
        if self.stage == 3:
            self._ensure_gathered(0)
            self._root_held = True

    def release_root(self) -> None:
        """Free the root unit held by `hold_root` (stage 3)."""
        if self.stage == 3:
            self._root_held = False
            self.units[0].free_full()

    # ------------------------------------------------------------------ gradients

    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's backward: `last` ends the accumulation of this step."""
        self._last = last
        self._ready = [0] * len(self.units)

    def _grad_ready(self, i: int) -> None:
        """All of unit i's gradients exist: start its collective (overlapping backward)."""
        self._ready[i] += 1
        if self._ready[i] < len(self.units[i].params):
            return
        unit = self.units[i]
        if self.stage <= 1:
            if not self._last:
                return  # accumulate locally; communicate once per optimizer step
            buf = self.grad_buffers[i]
            if self.stage == 0:
                work = C.all_reduce(buf, self.unit_replicate[i], "grads", async_op=True)
            else:
                work = self._reduce_scatter(self.grad_shards[i], buf, i)
            self._pending.append((i, work, None))
            return
        flat = unit.flatten_grads(torch.empty(unit.padded, dtype=self.reduce_dtype,
                                              device=unit.device))
        for p in unit.params:
            p.grad = None
        part = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=unit.device)
        self._pending.append((i, self._reduce_scatter(part, flat, i), part))
        while len(self._pending) > MAX_INFLIGHT_REDUCE_SCATTERS:  # free finished flat buffers
            self._finish_pending(0)
        if self.stage == 3 and i > 0:
            unit.free_full()
            self.secondary.pop(i, None)

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, i: int):
        """Unit i's gradient reduce-scatter over its shard group: async ring, or qgZ's two
        int8 hops."""
        if self.zero_pp.qgz:
            zeropp.quantized_reduce_scatter(out, full, self.nodes, "grads")
            return None
        return C.reduce_scatter(out, full, self.unit_shard[i], "grads", async_op=True)

    def _finish_pending(self, k: int) -> None:
        """Wait for pending gradient collective k; add a reduce-scattered part to its shard."""
        i, work, part = self._pending.pop(k)
        C.wait(work)
        if part is not None:
            self.grad_shards[i] += part
        if (self._last and i < self.offloaded
                and (self.stage == 0 or self.unit_replicate[i].size == 1)):
            self._grad_to_host(i)  # final now: no second hop across replicas follows

    def _grad_to_host(self, i: int) -> None:
        """Offloaded unit i's reduced gradient is final: copy it to its host buffer, which
        becomes the master's gradient (clipped and stepped on the host)."""
        self.host.wait(i)
        self.masters[i].grad = self.host.units[i].grad.copy_(self.grad_shards[i])
        self._on_host.add(i)

    def after_backward(self) -> None:
        """Finish the micro-batch's collectives; after the last, set the master gradients."""
        while self._pending:
            self._finish_pending(0)
        if self.stage == 3:
            self.release_root()
        if not self._last:
            return
        for i, (master, grad, replicate) in enumerate(zip(self.masters, self.grad_shards,
                                                          self.unit_replicate)):
            if self.stage >= 1:  # hierarchical sharding: second hop across replicas
                C.all_reduce(grad, replicate, "grads")
            if i < self.offloaded:  # streamed when its collective finished, or now
                if i not in self._on_host:
                    self._grad_to_host(i)
            else:
                master.grad = grad if grad.dtype == torch.float32 else grad.float()
        self._on_host.clear()

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Decoupled weight decay on matrices, AdamW on the master, then re-publish params.
        With Muon its optimizers step per-parameter views of the (whole, stage 0) master,
        weight decay included, as fivefold.optim does for a plain model."""
        wd = self.train_cfg.weight_decay
        if self.host:  # the offloaded units, in forward order, on the host's thread
            self.wait_updates()
            self.host.submit(lr)
            self._unpublished = set(range(self.offloaded))
        for group in self.optimizer.param_groups if self.optimizer else []:
            group["lr"] = lr
        if self.views:  # the same slicing of the master gradient
            grads = [g for unit, master in zip(self.units, self.masters)
                     for g in unit.views(master.grad)]
            for (_, view), grad in zip(self.views, grads):
                view.grad = grad
        if wd and not self.views:
            factor = 1.0 - lr * wd
            for m, mask in list(zip(self.masters, self.decay_masks))[self.offloaded:]:
                m.mul_(torch.where(mask, factor, 1.0))
        if self.optimizer:
            self.optimizer.step()
        for _, view in self.views:
            view.grad = None
        for unit, master, axis in list(zip(self.units, self.masters,
                                           self.unit_shard))[self.offloaded:]:
            if self.stage == 0:
                if master.data_ptr() != unit.full.data_ptr():
                    unit.full.copy_(master)
            elif self.stage in (1, 2):
                shard = unit.full[unit.shard_slice]
                if master.data_ptr() != shard.data_ptr():
                    shard.copy_(master)
                C.all_gather(unit.full, shard, axis, "params")
            elif unit.shard.data_ptr() != master.data_ptr():
                unit.shard.copy_(master)
        self.record_model_state()

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        if self.optimizer is None:
            return []
        return list(getattr(self.optimizer, "optimizers", [self.optimizer]))

    def zero_grad(self) -> None:
        for m in self.masters:
            m.grad = None
        for buf in self.grad_buffers:
            if buf is not None:
                buf.zero_()
        if self.stage >= 2:
            for g in self.grad_shards:
                g.zero_()

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Tensors to save or load in place: master weights and Adam moments of this rank.

        Keys name the shard (`.shard{r}of{n}`), so DCP stores every shard once (replicas
        hold identical ones); loading them in place needs the same data-parallel layout,
        another layout takes them through `load_whole_state`. With Muon the
        states are per parameter: Muon's momentum, or AdamW's moments and step.
        """
        n, r = self.shard_axis.size, self.shard_axis.rank  # Muon: stage 0, no experts apart
        if self.views:
            return {**{f"master.{unit.name}.shard{r}of{n}": master.data
                       for unit, master in zip(self.units, self.masters)},
                    **{f"{key}.{name}.shard{r}of{n}": value
                       for name, state in self._view_states() for key, value in state.items()}}
        out = {}
        for unit, master, state, axis in zip(self.units, self.masters, self._adam_states(),
                                             self.unit_shard):
            tag = f"{unit.name}.shard{axis.rank}of{axis.size}"
            out[f"master.{tag}"] = master.data
            out[f"exp_avg.{tag}"] = state["exp_avg"]
            out[f"exp_avg_sq.{tag}"] = state["exp_avg_sq"]
            out[f"step.{tag}"] = state["step"]
        return out

    def _adam_states(self) -> list[dict[str, torch.Tensor]]:
        """AdamW's state of each master, created empty where no step has run yet, so that a
        checkpoint load can fill it; the offloaded units' from the host tier (nvme: the
        committed version, which `after_checkpoint_load` writes back once loaded)."""
        self.wait_updates()
        offloaded = self.host.states() if self.host else []
        for master in self.masters[self.offloaded:]:
            state = self.optimizer.state[master]
            if not state:
                state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
        return offloaded + [self.optimizer.state[master]
                            for master in self.masters[self.offloaded:]]

    @torch.no_grad()
    def load_whole_state(self, weights: dict[str, torch.Tensor],
                         states: dict[str, dict[str, torch.Tensor]], step: torch.Tensor,
                         local: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Set this rank's master weights and optimizer state from whole-model tensors by
        parameter name, `weights[name]` and `states[name][kind]`, a checkpoint written under
        another layout (fivefold.train.reshard). `local(name, tensor)` is this rank's part of
        a whole parameter (its tensor-parallel shard); each unit is then laid out flat and
        padded as at construction (fivefold.parallel.flat_unit) and this rank keeps its shard
        of the buffer, AdamW's moments exactly like the weights they belong to, and every
        unit's step count is `step`. With Muon (stage 0, no tp: whole matrices) each
        parameter's state is copied whole."""
        adam = None if self.views else self._adam_states()
        for i, (unit, master) in enumerate(zip(self.units, self.masters)):
            _place_flat(unit, master.data, weights, local, self.stage)
            if adam:
                for kind in ("exp_avg", "exp_avg_sq"):
                    _place_flat(unit, adam[i][kind], {n: states[n][kind] for n in unit.names},
                                local, self.stage)
                adam[i]["step"].copy_(step)
        for name, state in self._view_states() if self.views else []:
            if state.keys() != states[name].keys():
                raise ValueError(f"{name}: the checkpoint holds {sorted(states[name])}, this "
                                 f"optimizer keeps {sorted(state)}")
            for kind, tensor in state.items():
                tensor.copy_(states[name][kind])
        self.after_checkpoint_load()

    def _view_states(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """(name, optimizer state) of every Muon-path view, created empty where no step has
        run yet, so that a checkpoint load can fill them."""
        out, names = [], {id(view): name for name, view in self.views}
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                for view in group["params"]:
                    state = opt.state[view]
                    if not state and isinstance(opt, torch.optim.Muon):
                        state["momentum_buffer"] = torch.zeros_like(view)
                    elif not state:  # fused AdamW keeps its step counter on the device
                        step_device = view.device if group.get("fused") else "cpu"
                        state.update(step=torch.zeros((), device=step_device),
                                     exp_avg=torch.zeros_like(view),
                                     exp_avg_sq=torch.zeros_like(view))
                    out.append((names[id(view)], state))
        return out

    @torch.no_grad()
    def after_checkpoint_load(self) -> None:
        """Re-publish the loaded master weights to the compute parameters (offload: and let
        the host tier take the loaded step count and moments)."""
        if self.host:
            self.host.after_load()
        for unit, master, axis in zip(self.units, self.masters, self.unit_shard):
            if self.stage == 3:
                unit.shard.copy_(master)
            elif self.stage == 0:
                unit.full.copy_(master)
            else:
                unit.full[unit.shard_slice].copy_(master)
                C.all_gather(unit.full, unit.full[unit.shard_slice], axis, "params")

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value by its model name, gathered on every rank."""
        self.wait_updates()
        out = {}
        for unit, master, axis in zip(self.units, self.masters, self.unit_shard):
            if self.stage == 0:
                flat = master.detach()
            else:
                flat = torch.empty(unit.padded, dtype=torch.float32, device=unit.device)
                C.all_gather(flat, master.detach().to(unit.device), axis, "state_dict")
            for name, view in zip(unit.names, unit.views(flat)):
                out[name] = view.clone()
        return out
