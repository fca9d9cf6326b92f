"""Gradient synchronization of the data-parallel engine's flat units, one strategy per ZeRO
stage (ZeRO, arXiv 1910.02054, Sec. 5):

  stage 0  `AllReduceSync`      each unit's gradient buffer all-reduced once per step
  stage 1  `ReduceScatterSync`  the same buffer reduce-scattered in place once per step
  stage 2  `ShardedSync`        each micro-batch's unit gradient reduce-scattered into a
                                persistent shard; no full gradient outlives its unit's backward
  stage 3  `GatherAndFree`      stage 2's gradients, and each unit's parameters all-gathered
                                just before its forward and backward and freed after

Communication is bucketed by unit and overlapped with backward: a unit's collective starts
from a post-accumulate-grad hook as soon as its last gradient exists, and `finish` waits for
all of them at the end of the micro-batch (PyTorch DDP's design, arXiv 2006.15704). Stages
0-1 reduce their buffer in the compute dtype (the parameters' .grad are views of it), stages
2-3 reduce-scatter in `reduce_dtype`.

Stage 3 gathers a block's parameters just before its forward and again before its backward
(prefetching the next block's), and frees them after (FSDP's resharding). The root unit
(embeddings, final norm, output head) stays gathered through a micro-batch's forward and
backward, as FSDP's root does. Under a pipeline (fivefold.parallel.pipeline.executor) the
executor calls `hold_root()` before the step's first action, because the first stage's
tied-weight send reads the embedding before any forward, and the root then stays gathered
through every micro-batch's forward and backward until the end of the step (evaluation:
until `release_root()`). Blocks keep gather-before / free-after per use: each forward or
backward action runs all of one virtual stage's blocks in order, and the one-block prefetch
takes the rank's next (previous) block, under interleaving possibly the next chunk's first,
which stays gathered until its use. A zero-bubble I pass gathers blocks and leaves them
gathered; its W pass frees them once their gradients are complete, and may run on blocks
that an F in between freed: the weight gradients need saved inputs and output gradients only.

Hierarchical sharding (MiCS, arXiv 2205.00119; FSDP's hybrid sharding): at stages 1-3 a
unit's shard is all-reduced across its replicas in `final_grad`, the second hop after the
reduce-scatter within the shard group. ZeRO++ (arXiv 2306.10209; fivefold.comm.zeropp): qgZ
reduce-scatters gradients as int8 through two all-to-all hops, qwZ quantizes the stage-3
weight all-gathers, hpZ keeps a node-local secondary weight shard from forward to backward so
that the backward all-gather stays inside the node. The secondary shard is cut at the first
forward gather of a step that finds none and dropped at the unit's reduce in the step's last
backward pass (`last`): a pipeline schedule's interleaved forwards and backwards of other
micro-batches then all find it (the weights do not change within a step), so every backward
all-gather runs inside the node.

Gradients outside the flat units (LOMO's per parameter, GaLore-dp's bucket, PipeDream-2BW's
stage gradients, sequence parallelism's partial sums) are reduced by
fivefold.parallel.grad_reduce; no other module writes a gradient collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm import zeropp
from fivefold.parallel.flat_unit import FlatUnit

# Stages 2-3: reduce-scatters in flight at once; each holds its unit's full flat gradient, so
# this bounds the transient gradient memory to about two units while keeping the overlap.
MAX_INFLIGHT_REDUCE_SCATTERS = 2


@dataclass(frozen=True)
class ZeroPP:
    """ZeRO++ switches and the number of shard-group ranks that share a node."""

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    ranks_per_node: int = 1
    expert_ranks_per_node: int = 1  # of an edp group (ParallelPlan.expert_ranks_per_node)

    @property
    def quantized(self) -> bool:
        return self.qwz or self.qgz


class AllReduceSync:
    """Stage 0 (DDP): micro-batches accumulate into each unit's flat gradient buffer (the
    parameters' .grad are views of it), all-reduced over the unit's replicas on the last.

    `on_final(i)` runs once unit i's reduced gradient is final before `final_grad` (the
    engine copies an offloaded unit's to the host then, overlapping the rest of backward)."""

    def __init__(self, units: list[FlatUnit], unit_shard: list[C.Axis],
                 unit_replicate: list[C.Axis], dtype: torch.dtype, reduce_dtype: torch.dtype,
                 zero_pp: ZeroPP, unit_nodes: list):
        self.units, self.unit_shard, self.unit_replicate = units, unit_shard, unit_replicate
        # ZeRO++: each unit's shard group split by node (zeropp.NodeAxes; None without hpZ/qgZ)
        self.reduce_dtype, self.zero_pp, self.unit_nodes = reduce_dtype, zero_pp, unit_nodes
        self.grad_buffers = self._buffers(dtype)
        self.grad_shards = [self._shard(i) for i in range(len(units))]
        for unit, buf in zip(units, self.grad_buffers):
            if buf is not None:  # autograd accumulates straight into the communicated bucket
                for p, grad in zip(unit.params, unit.views(buf)):
                    p.grad = grad
        self.on_final: Callable[[int], None] = lambda i: None
        self._pending: list[tuple[int, object, torch.Tensor | None]] = []
        self._ready = [0] * len(units)
        self._last = True
        for i, unit in enumerate(units):
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    def _buffers(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        return [torch.zeros(u.padded, dtype=dtype, device=u.device) for u in self.units]

    def _shard(self, i: int) -> torch.Tensor:
        """Where unit i's reduced gradient lands: here the whole buffer."""
        return self.grad_buffers[i]

    # Stages 0 and 1 reduce a unit once a step, after its last accumulation: they count a
    # unit's parameters over the passes flagged `last` until all are in, so a unit whose
    # parameters two passes finish (a V schedule's first rank: the embedding in stage 0's
    # last backward, the final norm and head in the last stage's) is reduced after both.
    # Stage 2 reduces every pass, counting each pass on its own (ShardedSync).
    reduces_every_pass = False

    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's backward: `last` ends the accumulation of this step."""
        self._last = last
        if self.reduces_every_pass:
            self._ready = [0] * len(self.units)

    def _grad_ready(self, i: int) -> None:
        """All of unit i's gradients exist: start its collective (overlapping backward)."""
        if not (self._last or self.reduces_every_pass):
            return
        self._ready[i] += 1
        if self._ready[i] == len(self.units[i].params):
            self._ready[i] = 0
            self._reduce(i)

    def _reduce(self, i: int) -> None:
        if self._last:  # else accumulate locally; communicate once per optimizer step
            work = C.all_reduce(self.grad_buffers[i], self.unit_replicate[i], "grads",
                                async_op=True)
            self._pending.append((i, work, None))

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, i: int):
        """Unit i's gradient reduce-scatter over its shard group: async ring, or qgZ's two
        int8 hops."""
        if self.zero_pp.qgz:
            zeropp.quantized_reduce_scatter(out, full, self.unit_nodes[i], "grads")
            return None
        return C.reduce_scatter(out, full, self.unit_shard[i], "grads", async_op=True)

    def _finish_pending(self, k: int) -> None:
        """Wait for pending gradient collective k; add a reduce-scattered part to its shard."""
        i, work, part = self._pending.pop(k)
        C.wait(work)
        if part is not None:
            self.grad_shards[i] += part
        if self._last and self._final_after_reduce(i):
            self.on_final(i)

    def _final_after_reduce(self, i: int) -> bool:
        """Whether unit i's gradient is final once its collective is done."""
        return True

    def finish(self) -> None:
        """End of a micro-batch's backward: every gradient collective done."""
        while self._pending:
            self._finish_pending(0)
        if self._last:
            self._ready = [0] * len(self.units)

    def final_grad(self, i: int) -> torch.Tensor:
        """After the last micro-batch: unit i's reduced gradient (this rank's shard)."""
        return self.grad_shards[i]

    def zero_grad(self) -> None:
        for buf in self.grad_buffers:
            if buf is not None:
                buf.zero_()

    def grad_bytes(self) -> int:
        return sum(b.nbytes for b in self.grad_buffers if b is not None)


class ReduceScatterSync(AllReduceSync):
    """Stage 1: stage 0's buffers, reduce-scattered in place once per step (this rank's
    slice is its shard), then all-reduced across replicas (hierarchical sharding)."""

    def _shard(self, i: int) -> torch.Tensor:
        return self.grad_buffers[i][self.units[i].shard_slice]

    def _reduce(self, i: int) -> None:
        if self._last:
            work = self._reduce_scatter(self.grad_shards[i], self.grad_buffers[i], i)
            self._pending.append((i, work, None))

    def _final_after_reduce(self, i: int) -> bool:
        return self.unit_replicate[i].size == 1  # else a second hop across replicas follows

    def final_grad(self, i: int) -> torch.Tensor:
        C.all_reduce(self.grad_shards[i], self.unit_replicate[i], "grads")
        return self.grad_shards[i]


class ShardedSync(ReduceScatterSync):
    """Stage 2: each micro-batch's unit gradient is flattened, reduce-scattered and added to
    a persistent shard in `reduce_dtype`; at most MAX_INFLIGHT_REDUCE_SCATTERS at once.

    A unit whose parameters two passes finish (a V schedule's first rank's root unit: the
    final norm and head in the last stage's backward, the embedding in stage 0's; a
    zero-bubble MoE block: the MoE layer's weights in I, the rest in W) is reduce-scattered
    after each of them, for what that pass added (zeros for the others), when the next
    gradient pass or the step's end finds it partly done: reduce-scatters add up, so the
    shard is the same sum, in two collectives instead of one."""

    reduces_every_pass = True

    def prepare_backward(self, last: bool) -> None:
        self._reduce_partial()
        super().prepare_backward(last)

    def finish(self) -> None:
        self._reduce_partial()
        super().finish()

    def _reduce_partial(self) -> None:
        for i, ready in enumerate(self._ready):
            if ready:
                self._ready[i] = 0
                self._reduce(i)

    def _buffers(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        return [None] * len(self.units)

    def _shard(self, i: int) -> torch.Tensor:
        unit = self.units[i]
        return torch.zeros(unit.shard_numel, dtype=self.reduce_dtype, device=unit.device)

    def _reduce(self, i: int) -> None:
        unit = self.units[i]
        flat = unit.flatten_grads(torch.empty(unit.padded, dtype=self.reduce_dtype,
                                              device=unit.device))
        for p in unit.params:
            p.grad = None
        part = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=unit.device)
        self._pending.append((i, self._reduce_scatter(part, flat, i), part))
        while len(self._pending) > MAX_INFLIGHT_REDUCE_SCATTERS:  # free finished flat buffers
            self._finish_pending(0)

    def zero_grad(self) -> None:
        for g in self.grad_shards:
            g.zero_()

    def grad_bytes(self) -> int:
        return sum(g.nbytes for g in self.grad_shards)


class GatherAndFree(ShardedSync):
    """Stage 3: stage 2's gradients, and each unit's parameters gathered only while it
    computes (module docstring). `before_gather(i)` runs before unit i's all-gather (the
    engine waits there for an offloaded unit's update, whose target is the shard)."""

    def __init__(self, *args, model: nn.Module, blocks: list[nn.Module | None]):
        super().__init__(*args)
        self.model, self.blocks = model, blocks
        self.before_gather: Callable[[int], None] = lambda i: None
        self.secondary: dict[int, torch.Tensor] = {}  # hpZ: node-local shards, step-long
        self._prefetch: dict[int, object] = {}
        self._root_held = False  # under a pipeline: the root outlives each forward

    def _reduce(self, i: int) -> None:
        super()._reduce(i)
        if i > 0:
            self.units[i].free_full()
            if self._last:  # the step's last backward of unit i: its weights change next
                self.secondary.pop(i, None)

    def finish(self) -> None:
        super().finish()
        self.release_root()

    def _gather(self, i: int, prefetch: bool = False, backward: bool = False) -> None:
        """All-gather unit i's weights: plain, qwZ-quantized, or (hpZ, backward) in the node."""
        self.before_gather(i)
        unit = self.units[i]
        if i in self._prefetch or unit.is_gathered() or unit.numel == 0:
            return  # a middle pipeline stage's root holds nothing
        unit.allocate_full()
        if backward and i in self.secondary:
            work = C.all_gather(unit.full, self.secondary[i], self.unit_nodes[i].intra, "params",
                                async_op=prefetch)
        elif self.zero_pp.qwz:
            work = zeropp.quantized_all_gather(unit.full, unit.shard, self.unit_shard[i],
                                               "params")
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

    def install_hooks(self) -> None:
        """Forward hooks that gather each unit before it computes and free it after."""
        last = len(self.units) - 1

        def before_model(module, args):
            self._ensure_gathered(0)

        def after_model(module, args, output):
            if not output.requires_grad and not self._root_held:  # evaluation
                self.units[0].free_full()

        def before_block(i):
            def hook(module, args):
                self._ensure_gathered(i)
                if (self.zero_pp.hpz and torch.is_grad_enabled()
                        and i not in self.secondary):  # kept until i's last backward
                    g = self.unit_nodes[i].intra
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
        self._ensure_gathered(0)
        self._root_held = True

    def release_root(self) -> None:
        self._root_held = False
        self.units[0].free_full()


def grad_sync_for(stage: int, *args, **stage3) -> AllReduceSync:
    """The strategy of ZeRO stage `stage`; `stage3` (model, blocks) for stage 3."""
    if stage == 3:
        return GatherAndFree(*args, **stage3)
    return (AllReduceSync, ReduceScatterSync, ShardedSync)[stage](*args)
