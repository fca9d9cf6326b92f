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

Parameters live in flat units (fivefold.parallel.flat_unit); their gradients are
synchronized, and at stage 3 their parameters gathered and freed, by one strategy per stage
(fivefold.parallel.grad_sync), which also holds the gradient buffers. This engine composes
the two with the fp32 masters, the optimizer step, offload, and checkpoints
(fivefold.parallel.engine_checkpoint). Stages 0 and 1 accumulate micro-batch gradients
locally and communicate once per optimizer step; stages 2 and 3 reduce-scatter every
micro-batch. Under a pipeline (fivefold.parallel.pipeline.executor) the engine sits on a
PipelineStage and the executor calls `hold_root()` before the step's first action (ZeRO-3's
root unit, grad_sync.py).

Hierarchical sharding (MiCS, arXiv 2205.00119; FSDP's hybrid sharding): with
`parallel.zero_group = k` the shard axis has k ranks and dp/k groups replicate it; gradients
sync in two hops, reduce-scatter within the shard group then all-reduce of the shard across
replicas, and parameter all-gathers never leave the shard group.

ZeRO++ (arXiv 2306.10209; fivefold.comm.zeropp) adds three switches: qwZ quantizes the
stage-3 weight all-gathers over the shard group, hpZ keeps a node-local secondary weight shard so the
backward all-gather stays inside the node, qgZ reduce-scatters gradients as int8 through two
all-to-all hops. Quantized units are padded so every shard holds whole quantization blocks.

Muon (`train.optimizer = "muon"`): at stage 0 without tensor parallelism, where every rank
holds whole matrices, the optimizers of fivefold.optim step per-parameter views of the flat
master, Muon's momentum (4 bytes) on the blocks' matrices and AdamW's moments elsewhere;
under ZeRO or tp, fivefold.parallel.muon_sharded steps the shards, each matrix gathered
whole to the rank that orthogonalizes it.

SGD (`train.optimizer = "sgd"`, every stage): torch's SGD on the flat masters, its momentum
buffer (4 bytes per parameter, K = 4 or 8) sharded like AdamW's moments.

Expert parallelism (fivefold.parallel.expert): with `expert_axes` each MoE block's stacked
expert matrices form a unit of their own, reduced over the "edp" ranks that hold copies of
the same experts (all-reduced at stage 0, sharded over edp at stages 1-3) while the block's
dense parameters keep the data-parallel axes; a ZeRO-3 block gathers both its units. With
hierarchical sharding the expert units shard over the part of their edp group inside one
zero group and all-reduce their shard across the others (`Mesh.expert_zero_axes`), and
ZeRO++'s node groups are cut from that part.

Offload (`parallel.offload`, ZeRO-Offload / ZeRO-Infinity; fivefold.memory.offload and
fivefold.memory.nvme_store): the first units by `ParallelPlan.offloaded_units` keep their
fp32 master, gradient buffer and Adam moments (SGD: its momentum) in host memory (the
moments on disk with nvme) and are updated there on a background thread; the device keeps
their compute copy and its gradient, and no master or optimizer state for them; the rest
keep the device's torch AdamW (SGD). A forward pre-hook on each module waits for its units' updates and, at stages
1-2, all-gathers them then, on the calling thread, instead of in `step`. Each rank offloads
its own shards.

Every collective goes through fivefold.comm.collectives, so the ledger sees each byte; the
engine records its model-state bytes per rank there too ("host" and "disk": offload's).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm import zeropp
from fivefold.comm.ledger import Ledger
from fivefold.comm.quantize import BLOCK
from fivefold.config import TrainConfig
from fivefold.memory.offload import HostOptimizer, HostUnit, Offload, state_kinds
from fivefold.optim import optimizer_for, optimizer_state_bytes
from fivefold.parallel.engine_checkpoint import EngineCheckpoint
from fivefold.parallel.flat_unit import (FlatUnit, expert_unit_tag, split_expert_units,
                                         split_units)
from fivefold.parallel.grad_sync import ZeroPP, grad_sync_for
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.muon_sharded import ShardedMuon, muon_axes
from fivefold.parallel.plan import offloaded_unit_count

__all__ = ["DataParallelEngine", "ZeroPP", "split_units"]


class DataParallelEngine(EngineCheckpoint):
    """Owns the parameters, gradients and optimizer of a data-parallel model replica.

    Per optimizer step: `prepare_backward(last)` and `after_backward()` around each
    micro-batch's backward, then clipping of `masters`' gradients
    (fivefold.parallel.grad_clip), `step(lr)` and `zero_grad()`.
    """

    def __init__(self, model: nn.Module, stage: int, mesh: Mesh, train: TrainConfig,
                 device: torch.device, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None, zero_pp: ZeroPP = ZeroPP(),
                 shard_axes: tuple[str, ...] = ("dp_shard",),
                 expert_axes: tuple[C.Axis, C.Axis, C.Axis] | None = None,
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
            ep_axis, edp_axis, etp_axis = expert_axes
            tag = expert_unit_tag(ep_axis.rank, ep_axis.size, etp_axis.rank, etp_axis.size)
            split = split_expert_units(split_units(model), tag)
            none = C.Axis("none", None, 1, 0, mesh.ledger)
            expert_groups = mesh.expert_data_groups(ep_axis.size, etp_axis.size)
            unit_axes[True] = (none, edp_axis) if stage == 0 else (edp_axis, none)
            if stage >= 1 and mesh.shape["dp_replicate"] > 1:  # hierarchical: edp cut too
                shard, replicate, expert_groups = mesh.expert_zero_axes(ep_axis.size,
                                                                        etp_axis.size)
                unit_axes[True] = (shard, replicate)
        self.unit_shard = [unit_axes[expert][0] for *_, expert in split]
        self.unit_replicate = [unit_axes[expert][1] for *_, expert in split]
        self.is_expert = [expert for *_, expert in split]
        multiple = BLOCK if zero_pp.quantized else 1
        self.units = [FlatUnit(name, params, axis.size, axis.rank, param_dtype, device,
                               multiple)
                      for (name, params, *_), axis in zip(split, self.unit_shard)]
        unit_nodes = [None] * len(self.units)
        if zero_pp.hpz or zero_pp.qgz:  # ZeRO++'s node groups: experts' over the edp ranks
            nodes = {False: zeropp.split_by_node(self.shard_axis, zero_pp.ranks_per_node,
                                                 mesh.axis_groups(*shard_axes))}
            if expert_axes is not None:
                nodes[True] = zeropp.split_by_node(unit_axes[True][0],
                                                   zero_pp.expert_ranks_per_node, expert_groups)
            unit_nodes = [nodes[expert] for expert in self.is_expert]
        self.blocks = [module for _, _, module, _ in split]
        self.masters = [nn.Parameter(self._master_storage(u)) for u in self.units]
        if stage == 3:
            for unit, master in zip(self.units, self.masters):
                unit.shard = master.data if param_dtype == torch.float32 else master.data.to(
                    param_dtype)
                unit.free_full()
        self.sync = grad_sync_for(stage, self.units, self.unit_shard, self.unit_replicate,
                                  param_dtype, self.reduce_dtype, zero_pp, unit_nodes,
                                  model=model, blocks=self.blocks)
        self.sync.on_final = self._final_grad_ready
        self.decay_masks = [u.decay_mask() for u in self.units]
        self._unpublished: set[int] = set()  # offloaded units whose update is queued
        self._on_host: set[int] = set()  # offloaded units whose final gradient is copied
        self._last = True
        self.host = self._offload(offload) if offload else None
        self.offloaded = len(self.host.units) if self.host else 0
        self.views: list[tuple[str, torch.Tensor]] = []  # Muon: each parameter's master
        if train.optimizer == "muon" and stage == 0 and mesh.shape["tp"] == 1:  # whole matrices
            self.views = [(name, view) for unit, master in zip(self.units, self.masters)
                          for name, view in zip(unit.names, unit.views(master.detach()))]
            self.optimizer = optimizer_for(self.views, train, device)
        elif train.optimizer == "muon":  # matrices split over shards or tp ranks
            self.optimizer = ShardedMuon(self.units, self.masters, muon_axes(
                mesh, stage, shard_axes, self.unit_shard, self.is_expert), train)
        elif train.optimizer == "sgd" and self.offloaded < len(self.masters):  # L2 weight
            # decay added to the gradient by `step`; offloaded units step on the host
            self.optimizer = torch.optim.SGD(self.masters[self.offloaded:], lr=train.lr,
                                             momentum=train.beta1)
        elif self.offloaded < len(self.masters):  # units kept on the device (the first
            # `offloaded` step in the host optimizer); weight decay is applied by the engine
            self.optimizer = torch.optim.AdamW(self.masters[self.offloaded:], lr=train.lr,
                                               weight_decay=0.0, eps=train.eps,
                                               betas=(train.beta1, train.beta2))
        else:
            self.optimizer = None
        if stage == 3:  # an offloaded unit's shard is the host update's target
            self.sync.before_gather = self._await_update
            self.sync.install_hooks()
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
                                       target, offload.tier, len(state_kinds(self.train_cfg))))
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

    def record_model_state(self) -> None:
        """Bytes of parameters, gradients, optimizer states and master copies on this rank."""
        params = sum((u.shard if self.stage == 3 else u.full).nbytes for u in self.units)
        grads = self.sync.grad_bytes()
        device_masters = self.masters[self.offloaded:]  # offloaded ones live on the host
        master = (0 if self.param_dtype == torch.float32 else
                  sum(m.nbytes for m in device_masters))
        optimizer = optimizer_state_bytes(self._torch_optimizers())
        self.ledger.model_state_bytes = {"params": params, "grads": grads, "master": master,
                                         "optimizer": optimizer,
                                         "total": params + grads + master + optimizer,
                                         "host": self.host.host_bytes() if self.host else 0,
                                         "disk": self.host.disk_bytes() if self.host else 0}

    def hold_root(self) -> None:
        """Stage 3 under a pipeline: gather the root unit now and keep it gathered until
        `after_backward` or `release_root` (the first stage's tied-weight send reads it
        before any forward, and each micro-batch uses it again). No-op at stages 0-2, but
        for offload's pending updates, which the send must not overtake."""
        self.wait_updates()
        if self.stage == 3:
            self.sync.hold_root()

    def release_root(self) -> None:
        """Free the root unit held by `hold_root` (stage 3)."""
        if self.stage == 3:
            self.sync.release_root()

    # ------------------------------------------------------------------ gradients

    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's backward: `last` ends the accumulation of this step."""
        self.sync.prepare_backward(last)
        self._last = last

    def _final_grad_ready(self, i: int) -> None:
        """Unit i's reduced gradient is final before `after_backward`: an offloaded unit's
        goes to the host now, overlapping the rest of backward."""
        if i < self.offloaded:
            self._grad_to_host(i)

    def _grad_to_host(self, i: int) -> None:
        """Offloaded unit i's reduced gradient is final: copy it to its host buffer, which
        becomes the master's gradient (clipped and stepped on the host)."""
        self.host.wait(i)
        self.masters[i].grad = self.host.units[i].grad.copy_(self.sync.grad_shards[i])
        self._on_host.add(i)

    def after_backward(self) -> None:
        """Finish the micro-batch's collectives; after the last, set the master gradients."""
        self.sync.finish()
        if not self._last:
            return
        for i, master in enumerate(self.masters):
            grad = self.sync.final_grad(i)
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
        weight decay included, as fivefold.optim does for a plain model, or ShardedMuon
        steps the shards. SGD steps the
        master (its momentum sharded like it) after adding the matrices' L2 weight decay to
        the gradient, as torch's SGD does with `weight_decay`."""
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
        if wd and self.train_cfg.optimizer == "sgd":
            for m, mask in list(zip(self.masters, self.decay_masks))[self.offloaded:]:
                m.grad.add_(torch.where(mask, m, 0.0), alpha=wd)
        elif wd and self.train_cfg.optimizer != "muon":  # Muon decays in its own step
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
        self.sync.zero_grad()
