"""Model-state bytes per rank: parameters, gradients, fp32 master copies, optimizer states.

The runtime keeps each data-parallel unit (root, then one per block) as one flat buffer padded
to a multiple of the shard degree n (fivefold.parallel.flat_unit); these formulas pad the
same way, so for the layouts the runtime executes they equal its ledger exactly. ZeRO
(arXiv 1910.02054, Sec. 5.1) decides what is divided by n:

  stage   params        grads              master + optimizer
  0       p * padded    p * padded         (4 + K) * padded     (master only if p < 4)
  1       p * padded    p * padded         (4 + K) * padded / n
  2       p * padded    g * padded / n     (4 + K) * padded / n
  3       p * padded/n  g * padded / n     (4 + K) * padded / n

p bytes of the compute dtype, g of the gradient-reduction dtype, K the optimizer's state bytes
per parameter: AdamW 8 (two fp32 moments), SGD with momentum 4, Muon 4 (one fp32 momentum)
on the blocks' matrices and AdamW's 8 on every other parameter, LOMO 0 (it fuses the update
into backward, LOMO arXiv 2306.09782, and keeps no full gradient either), GaLore on each
block matrix (A x B, A the smaller side) the fp32 moments of its rank-r projection, 8 r B,
and the projection, 4 A r, with r = A / 4 (arXiv 2403.03507, Sec. 4; fivefold.memory.galore),
and AdamW's 8 elsewhere. Expert parameters of MoE layers are
split over ep ranks and sharded over the remaining data-parallel ranks.

fp8 weights (`linear_bytes`): a stack that keeps the blocks' linear weights as fp8 tensors
(fivefold.planner.stack `fp8_weight_bytes`: Megatron's fp8_param_gather) holds their working
copy, sharded or not, at those bytes per element (Unit.linear: the linear layers' weights,
routed experts included; norms, biases, the router, embeddings and head stay at p); the
fp32 master, the gradients and the optimizer states are unchanged. Without it (fivefold's
runtime, every bf16 run) p holds for every parameter.

Offload (`parallel.offload`, ZeRO-Offload arXiv 2101.06840, ZeRO-Infinity arXiv 2104.07857;
fivefold.memory.offload) moves the fp32 master and the optimizer state of a prefix of the
rank's units (ParallelPlan.offloaded_units: the shortest prefix whose shard elements reach
offload_fraction of the rank's) off the device. Per element of an offloaded unit's shard:

  tier  device                          host                           disk
  cpu   no master, no optimizer state   master, 2 moments, fp32 grad   -
                                        (16 B)
  nvme  no master, no optimizer state   master, fp32 grad (8 B)        2 moments, 2 versions
                                                                       (16 B)

With SGD the optimizer state is its momentum, 4 B (none without momentum, train.beta1 = 0,
which the plan does not know: predictions take the default momentum): host 12 B with cpu,
8 B with nvme, and 8 B on disk (`offload_bytes`).

The disk keeps two versions of the moments, the committed one and the one a step writes
(crash consistency, fivefold.memory.nvme_store). Parameters and gradients stay on the
device as without offload; the chunk buffers the streaming keeps in flight are bounded and
not model state.

PipeDream-2BW (fivefold.parallel.pipeline.pipedream_2bw) holds two weight versions, and three
copies with weight prediction (two predicted versions and the optimizer's masters); one
step's gradients at a time, since a stage's first backward of step t+1 follows its update of
step t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.config import ModelConfig
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner.params import (block_linear_params, block_matrix_shapes, block_params,
                                     block_vector_params, root_params, total_params)

OPTIMIZER_STATE_BYTES = {"adamw": 8, "muon": 4, "sgd": 4, "lomo": 0}  # per element; GaLore: Unit


def offload_bytes(tier: str, state: float) -> tuple[float, float]:
    """Bytes per offloaded shard element on (host, disk) (module docstring), for an
    optimizer with `state` fp32 bytes per element (AdamW 8, SGD with momentum 4): the
    master and the gradient on the host, the state there too with "cpu", two versions of it
    on disk with "nvme"."""
    if tier == "none":
        return 0, 0
    return (8 + state, 0) if tier == "cpu" else (8, 2 * state)


@dataclass(frozen=True)
class Unit:
    """One flat unit on one rank: its element count and the degree it is sharded over."""

    numel: int
    shard: int
    multiple: int = 1  # each shard a multiple of this many elements (ZeRO++ quantization)
    matrices: int = 0  # elements in the blocks' weight matrices (Muon's and GaLore's share)
    low_rank_bytes: int = 0  # GaLore's state for those matrices (moments and projections)
    expert: bool = False  # a block's routed experts (ep > 1): synced over the edp ranks
    linear: int = 0  # elements in the blocks' linear weights (module docstring, fp8 weights)

    def state_bytes(self, optimizer: str) -> float:
        """Optimizer state bytes per element: Muon's or GaLore's on the matrices, AdamW's
        elsewhere."""
        if optimizer not in ("muon", "galore"):
            return OPTIMIZER_STATE_BYTES[optimizer]
        matrices = (OPTIMIZER_STATE_BYTES["muon"] * self.matrices if optimizer == "muon"
                    else self.low_rank_bytes)
        return (matrices + OPTIMIZER_STATE_BYTES["adamw"] * (self.numel - self.matrices)
                ) / self.numel

    @property
    def padded(self) -> int:
        step = self.shard * self.multiple
        return math.ceil(self.numel / step) * step

    @property
    def shard_numel(self) -> int:
        return self.padded // self.shard


def galore_state_bytes(model: ModelConfig, layer: int, tp: int = 1) -> int:
    """GaLore's fp32 moments (8 r B) and projection (4 A r) over block `layer`'s matrices."""
    total = 0
    for shape in block_matrix_shapes(model, layer, tp):
        a, b = sorted(shape)
        r = max(1, a // 4)
        total += 8 * r * b + 4 * a * r
    return total


def galore_dp_segment(model: ModelConfig, n: int) -> tuple[int, int, int]:
    """Elements of one rank's segment of data-parallel GaLore's two buckets over n shards
    (fivefold.memory.galore_dp): the gradients' (each block matrix's longer side B padded to
    a multiple of n, A columns), the all-gathered steps' (the same rows, r columns), and of
    the full-rank parameters' share in each (flat, padded)."""
    shapes = [sorted(s) for i in range(model.layers) for s in block_matrix_shapes(model, i)]
    rest = math.ceil((total_params(model) - sum(a * b for a, b in shapes)) / n)
    grads = sum(math.ceil(b / n) * a for a, b in shapes) + rest
    steps = sum(math.ceil(b / n) * max(1, a // 4) for a, b in shapes) + rest
    return grads, steps, rest


def galore_dp_state_bytes(model: ModelConfig, lay: ParallelPlan, projected: bool = False
                          ) -> dict[str, int]:
    """{params, grads, master, optimizer, host, disk (0), total} of data-parallel GaLore on one rank, as
    fivefold.memory.galore_dp records them: the whole fp32 model; the gradient bucket
    (stages 0-1) or its 1/n segment (stage 2), of the projected gradient with `projected`
    (train.galore_reduce); the fp32 shard of the full-rank parameters AdamW steps (stages
    1-2); the projections (whole, 4 A r), this rank's rows of the projected moments (8 r
    ceil(B / n)) and AdamW's moments of its shard."""
    n = lay.dp if lay.zero_stage >= 1 else 1
    grads_seg, steps_seg, rest_chunk = galore_dp_segment(model, n)
    seg = steps_seg if projected else grads_seg  # what is reduced and kept
    shapes = [sorted(s) for i in range(model.layers) for s in block_matrix_shapes(model, i)]
    low_rank = sum(4 * a * max(1, a // 4) + 8 * math.ceil(b / n) * max(1, a // 4)
                   for a, b in shapes)
    params = 4 * total_params(model)
    grads = 4 * seg * (n if lay.zero_stage <= 1 else 1)
    master = 4 * rest_chunk if n > 1 else 0  # stage 0: the parameters are the master
    optimizer = low_rank + 8 * rest_chunk
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer,
            "host": 0, "disk": 0, "total": params + grads + master + optimizer}


def stage_units(model: ModelConfig, lay: ParallelPlan, layers: list[int], first: bool, last: bool,
                multiple: int = 1, etp: int | None = None) -> list[Unit]:
    """The units of one pipeline stage on one rank: root (if any), then each block's dense
    and expert parts. The shard degree is the ZeRO group (times cp, whose ranks also replicate
    the model) for stages >= 1, and 1 for plain data parallelism. `etp`: fivefold's experts'
    grid (fivefold.expert_grid: the experts a unit of their own wherever the grid splits a
    stage, sharded over its edp ranks; planner.params.block_params); None: an external
    stack's MoE layer, split over tp, its experts apart under ep > 1 only."""
    shard = lay.zero_group * lay.cp if lay.zero_stage >= 1 else 1
    if etp is None:
        apart = lay.ep > 1
        expert_shard = max(1, shard // lay.ep) if lay.zero_stage >= 1 else 1
    else:
        apart = lay.expert_grid
        expert_shard = lay.expert_shard_axis[1] if lay.zero_stage >= 1 else 1
    units = []
    root = root_params(model, lay.tp, first, last)
    if root:
        units.append(Unit(root, shard, multiple))
    for i in layers:
        dense, expert = block_params(model, i, lay.tp, lay.ep, etp)
        linear = block_linear_params(model, i, lay.tp, lay.ep, etp)[0]
        matrices = dense - block_vector_params(model, lay.tp)  # expert weights are 3-D
        muon_experts = expert if lay.optimizer == "muon" else 0  # Muon: E matrices each
        if not apart:  # the experts live in the block's unit, as every other parameter
            dense, expert, matrices = dense + expert, 0, matrices + muon_experts
            linear = sum(block_linear_params(model, i, lay.tp, lay.ep, etp))
        units.append(Unit(dense, shard, multiple, matrices,
                          galore_state_bytes(model, i, lay.tp) if lay.optimizer == "galore"
                          else 0, linear=linear))
        if expert:
            units.append(Unit(expert, expert_shard, multiple, muon_experts, expert=True,
                              linear=expert))
    return units


def model_state_bytes(units: list[Unit], lay: ParallelPlan,
                      linear_bytes: int | None = None) -> dict[str, int]:
    """{params, grads, master, optimizer, total} resident on one rank's device, and {host,
    disk}: the offloaded units' state (module docstring), as the runtime records them;
    `linear_bytes`: the bytes per element of the blocks' linear weights where the stack
    keeps them in fp8 (module docstring; None: p, as the runtime holds them)."""
    p = PRECISION_BYTES[lay.precision]
    stage = lay.zero_stage
    g = lay.grad_bytes if stage >= 2 else p
    params = weight_copies(lay) * sum((u.shard_numel if stage == 3 else u.padded) * p
                                      for u in units)
    if linear_bytes is not None and linear_bytes != p:  # the held share of each unit's linears
        params -= weight_copies(lay) * round(sum(
            (p - linear_bytes) * u.linear * (u.shard_numel / u.padded if stage == 3 else 1)
            for u in units if u.linear))
    grads = sum((u.shard_numel if stage >= 2 else u.padded) * g for u in units)
    if lay.optimizer == "lomo":
        grads = max((u.padded for u in units), default=0) * g  # one unit's gradient at a time
    local = [(u.shard_numel if stage >= 1 else u.padded) for u in units]
    off = lay.offloaded_units(local)
    kept = list(zip(local, units))[off:]  # the units whose step stays on the device
    master = 0 if p == 4 else sum(n for n, _ in kept) * 4
    optimizer = round(sum(n * u.state_bytes(lay.optimizer) for n, u in kept))
    host, disk = ((sum(local[:off]) * b
                   for b in offload_bytes(lay.offload, OPTIMIZER_STATE_BYTES[lay.optimizer]))
                  if off else (0, 0))  # offload: AdamW's and SGD's states only
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer,
            "total": params + grads + master + optimizer, "host": host, "disk": disk}


def weight_copies(lay: ParallelPlan) -> int:
    """Copies of its weights a rank holds: PipeDream-2BW's versions (module docstring)."""
    if lay.schedule != "pipedream-2bw" or lay.pp == 1:
        return 1
    return 3 if lay.weight_prediction else 2
