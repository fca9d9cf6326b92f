"""Expert parallelism: each MoE layer's experts placed on the `ep` ranks, tokens moved to
them and back by all-to-all with variable split sizes (GShard, arXiv 2006.16668, Sec. 3;
Megatron-Core's all-to-all token dispatcher).

Placement. The ep ranks are neighbours among the data-parallel ranks (Megatron-Core's
parallel folding: ep folds onto dp x cp, fivefold.parallel.mesh `expert_axes`); ep rank r
holds experts [r L, (r+1) L), L = experts / ep, as the slices of the stacked (X, ., .)
weights. Every other parameter stays whole (or as tensor/pipeline parallelism splits it), and
each expert is data-parallel over the dp x cp / ep ranks of its "edp" group: the
data-parallel engine reduces (and with ZeRO shards) the expert units over edp, the dense ones
over all data ranks (fivefold.parallel.data_parallel).

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
from fivefold.comm.collectives import Axis
from fivefold.models.expert_matmul import expert_swiglu
from fivefold.models.moe import MoE

EXPERT_NAMES = ("mlp.w1", "mlp.w3", "mlp.w2")  # fivefold.models.description MOE_PLACEMENTS


def is_expert_param(name_in_block: str) -> bool:
    """Whether a block's parameter (named inside the block) is a stacked expert matrix."""
    return name_in_block in EXPERT_NAMES


class AllToAll(torch.autograd.Function):
    """Rows of `x` to the axis's ranks by `send` counts, `recv` rows back from each; backward
    sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, send: list[int], recv: list[int], axis: Axis,
                purpose: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.axis, ctx.purpose = send, recv, axis, purpose
        return _rows_all_to_all(x_MD, send, recv, axis, purpose)

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        return (_rows_all_to_all(grad_MD, ctx.recv, ctx.send, ctx.axis,
                                 ctx.purpose + "_backward"), None, None, None, None)


def _rows_all_to_all(x_MD: torch.Tensor, send: list[int], recv: list[int], axis: Axis,
                     purpose: str) -> torch.Tensor:
    """The all-to-all of rows, issued on the flat buffers with splits in elements, which the
    builtin collective and the scheduled algorithms (fivefold.comm.executor: `[comm]`, e.g.
    the hierarchical two-step all-to-all) both take."""
    D = x_MD.shape[1]
    out = x_MD.new_empty(sum(recv), D)
    C.all_to_all(out.view(-1), x_MD.contiguous().view(-1), axis, purpose,
                 [n * D for n in recv], [n * D for n in send])
    return out


class ExpertDispatcher:
    """`MoE.expert_compute` under expert parallelism: rows sorted by global expert in, their
    expert outputs in the same order out (the module docstring's four steps)."""

    def __init__(self, moe: MoE, axis: Axis):
        self.moe, self.axis = moe, axis
        self.local = moe.experts // axis.size

    def __call__(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, L = self.axis.size, self.local
        send = [sum(counts[r * L:(r + 1) * L]) for r in range(ep)]
        recv_counts = torch.empty(ep * L, dtype=torch.int64)
        C.all_to_all(recv_counts, torch.tensor(counts, dtype=torch.int64), self.axis,
                     "moe_counts")
        by_source = recv_counts.view(ep, L).tolist()  # [source][local expert]
        recv = [sum(row) for row in by_source]
        x_recv = AllToAll.apply(x_MD, send, recv, self.axis, "moe_dispatch")
        order = expert_major(by_source)
        local_counts = [sum(row[e] for row in by_source) for e in range(L)]
        m = self.moe
        y = expert_swiglu(x_recv[order], local_counts, m.w1, m.w3, m.w2, m.matmul,
                          m.expert_mm)
        y_recv = torch.empty_like(y).index_copy_(0, order, y) if len(order) else y
        return AllToAll.apply(y_recv, recv, send, self.axis, "moe_combine")


def expert_major(by_source: list[list[int]]) -> torch.Tensor:
    """The permutation of received rows (source-major, then local expert) into expert-major
    order (local expert, then source)."""
    starts, offset = [], 0
    for row in by_source:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    index = [torch.arange(starts[s][e], starts[s][e] + by_source[s][e])
             for e in range(len(by_source[0])) for s in range(len(by_source))]
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, axis: Axis) -> None:
    """Keep this ep rank's experts of every MoE layer and install the dispatcher."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        L = module.experts // axis.size
        rows = slice(axis.rank * L, (axis.rank + 1) * L)
        for name in ("w1", "w3", "w2"):
            setattr(module, name, nn.Parameter(getattr(module, name)[rows].clone()))
        module.expert_compute = ExpertDispatcher(module, axis)


@torch.no_grad()
def gather_experts(state: dict[str, torch.Tensor], axis: Axis) -> dict[str, torch.Tensor]:
    """Full parameters by name from this rank's: the expert slices all-gathered over the ep
    axis (a collective: every ep rank calls it), the rest as they are."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("layers.") and is_expert_param(name.split(".", 2)[2]) \
                and axis.size > 1:
            full = tensor.new_empty(axis.size * tensor.numel())
            C.all_gather(full, tensor.contiguous().view(-1), axis, "state_dict")
            out[name] = full.view(axis.size * tensor.shape[0], *tensor.shape[1:])
        else:
            out[name] = tensor
    return out


def expert_counted_masks(engine, ep_rank: int) -> list[torch.Tensor | None]:
    """Stage 0 under expert parallelism: over each flat unit, True where this rank adds the
    element to the gradient norm summed over the ep axis (fivefold.parallel.grad_clip):
    expert units on every ep rank (each holds other experts), dense ones on ep rank 0 only
    (every ep rank holds the same all-reduced dense gradients)."""
    return [None if expert or ep_rank == 0 else
            torch.zeros(unit.padded, dtype=torch.bool, device=unit.device)
            for unit, expert in zip(engine.units, engine.is_expert)]
