"""Expert parallelism: each MoE layer's experts placed on the `ep` ranks, tokens moved to
them and back by all-to-all with variable split sizes (GShard, arXiv 2006.16668, Sec. 3;
Megatron-Core's all-to-all token dispatcher).

Placement. The experts have a grid of their own over a stage's dp x cp x tp ranks
(Megatron-Core's parallel folding, fivefold.expert_grid; fivefold.parallel.mesh
`expert_axes`): ep rank r holds experts [r L, (r+1) L), L = experts / ep, as the slices of
the stacked (X, ., .) weights, and within them its etp rank's columns of each expert's MLP
(fivefold.parallel.expert_tensor, which runs step 3 below over the etp ranks). Every other
parameter stays whole (or as tensor/pipeline parallelism splits it), and each expert shard
is data-parallel over the ranks of its "edp" group: the data-parallel engine reduces (and
with ZeRO shards) the expert units over edp, the dense ones over the data ranks
(fivefold.parallel.data_parallel).

One MoE layer's forward on a rank (the `MoE.expert_compute` seam, tokens already routed and
sorted by expert on the rank that owns them, fivefold.models.moe):

  1. counts: an all-to-all of the per-expert assignment counts (int64, X per rank), so each
     rank learns how many rows every source sends to each of its experts;
  2. dispatch: all-to-all of the rows, split by destination rank (`moe_dispatch`);
  3. the rank's L experts on the received rows, regrouped expert-major (a grouped matmul,
     fivefold.models.expert_matmul; an expert that receives no row runs on zero rows);
  4. combine: the outputs back to their sources in the order they came (`moe_combine`).

The row all-to-alls are autograd functions whose backward is the reverse all-to-all (purposes
`moe_dispatch_backward`, `moe_combine_backward`). Every byte goes through
fivefold.comm.collectives, so the ledger's all-to-all bytes are exactly sum(splits) x hidden
x dtype bytes of the routing done. Capacity dropping happens before dispatch on the source
rank, over its micro-batch, so it drops what the one-process run drops. The `[comm]` section
applies to the ep axis like any other: `comm.algorithm = {all_to_all = "hierarchical"}` runs
the dispatch as the two-step all-to-all inside each node, then across
(fivefold.comm.algorithms.alltoall2d), recorded as its point-to-point messages.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.expert_grid import STAGE_AXES
from fivefold.models.moe import MoE
from fivefold.parallel.expert_rows import AllToAll, expert_major
from fivefold.parallel.expert_tensor import INNER_DIM, etp_swiglu, expert_slice
from fivefold.parallel.mesh import ExpertAxes, Mesh
from fivefold.parallel.tensor import counted_masks
from fivefold.parallel.tensor_comm import gather_stacked

EXPERT_NAMES = ("mlp.w1", "mlp.w3", "mlp.w2")  # fivefold.models.description MOE_PLACEMENTS


def is_expert_param(name_in_block: str) -> bool:
    """Whether a block's parameter (named inside the block) is a stacked expert matrix."""
    return name_in_block in EXPERT_NAMES


class ExpertDispatcher:
    """`MoE.expert_compute` on the experts' grid: rows sorted by global expert in, their
    expert outputs in the same order out (the module docstring's four steps; step 3 split
    over etp by fivefold.parallel.expert_tensor)."""

    def __init__(self, moe: MoE, axes: ExpertAxes):
        self.moe, self.axis, self.etp_axis = moe, axes.ep, axes.etp
        self.local = moe.experts // axes.ep.size

    def __call__(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, L = self.axis.size, self.local
        if ep == 1:
            return etp_swiglu(self.moe, x_MD, counts, self.etp_axis)
        send = [sum(counts[r * L:(r + 1) * L]) for r in range(ep)]
        recv_counts = torch.empty(ep * L, dtype=torch.int64)
        C.all_to_all(recv_counts, torch.tensor(counts, dtype=torch.int64), self.axis,
                     "moe_counts")
        by_source = recv_counts.view(ep, L).tolist()  # [source][local expert]
        recv = [sum(row) for row in by_source]
        x_recv = AllToAll.apply(x_MD, send, recv, self.axis, "moe_dispatch")
        order = expert_major(by_source)
        local_counts = [sum(row[e] for row in by_source) for e in range(L)]
        y = etp_swiglu(self.moe, x_recv[order], local_counts, self.etp_axis)
        y_recv = torch.empty_like(y).index_copy_(0, order, y) if len(order) else y
        return AllToAll.apply(y_recv, recv, send, self.axis, "moe_combine")


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, axes: ExpertAxes) -> None:
    """Keep this rank's share of every MoE layer's experts (its ep rank's experts, its etp
    rank's columns of them) and install the dispatcher."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        L = module.experts // axes.ep.size
        rows = slice(axes.ep.rank * L, (axes.ep.rank + 1) * L)
        for name in ("w1", "w3", "w2"):
            part = expert_slice(name, getattr(module, name)[rows], axes.etp.size,
                                axes.etp.rank)
            setattr(module, name, nn.Parameter(part.clone()))
        module.expert_compute = ExpertDispatcher(module, axes)


@torch.no_grad()
def gather_experts(state: dict[str, torch.Tensor], axes: ExpertAxes) -> dict[str, torch.Tensor]:
    """Full parameters by name from this rank's: the expert slices all-gathered over the etp
    axis (their inner dim) and then the ep axis (a collective: every rank of the grid calls
    it), the rest as they are."""
    out = {}
    for name, tensor in state.items():
        matrix = name.split(".", 2)[2] if name.startswith("layers.") else ""
        if not is_expert_param(matrix):
            out[name] = tensor
            continue
        if axes.etp.size > 1:
            dim = INNER_DIM[matrix.removeprefix("mlp.")]
            tensor = torch.cat(gather_stacked(tensor, axes.etp, "state_dict").unbind(0), dim)
        if axes.ep.size > 1:
            tensor = torch.cat(gather_stacked(tensor, axes.ep, "state_dict").unbind(0), 0)
        out[name] = tensor
    return out


def grid_counted_masks(engine, mesh: Mesh) -> list[torch.Tensor | None]:
    """Over each flat unit's shard, True where this rank adds the element to the gradient
    norm, which is then summed over all of a stage's ranks (`STAGE_AXES`, and pp;
    fivefold.parallel.grad_clip), so that every element of the plain model counts once:
    a dense unit on its first data-parallel copy (stage 0: data, cp rank 0; ZeRO: the
    dp_replicate rank 0 of the shard group), with tensor parallelism's rule within it
    (fivefold.parallel.tensor.counted_masks: replicated ones, the MoE router and shared
    experts included, on tp rank 0); an expert unit on its first copy over the axis its
    shard is replicated on (stage 0: edp; ZeRO: none, or hierarchical sharding's
    edp_replicate), on every ep and etp rank."""
    first = mesh.axis("dp_replicate").rank == 0
    if engine.stage == 0:
        first = first and mesh.axis("dp_shard").rank == 0 and mesh.axis("cp").rank == 0
    out = []
    for unit, expert, mask, replicate in zip(engine.units, engine.is_expert,
                                             counted_masks(engine.units, mesh.axis("tp").rank),
                                             engine.unit_replicate):
        counted = replicate.rank == 0 if expert else first
        out.append((None if expert else mask) if counted else
                   torch.zeros(unit.shard_numel, dtype=torch.bool, device=unit.device))
    return out
