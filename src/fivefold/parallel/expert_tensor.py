"""Expert tensor parallelism: each routed expert's SwiGLU split over the `etp` ranks, as
Megatron-LM splits a dense MLP (arXiv 1909.08053, Sec. 3): w1 and w3 column-parallel (etp
rank r keeps the expert's inner features [rF/etp, (r+1)F/etp)), w2 row-parallel (the
matching input columns), so a rank's partial output is w2_r(silu(w1_r x) * w3_r x) and the
etp partial outputs sum to the expert's (MoE Parallel Folding, arXiv 2504.14960, Sec. 3.2).

In the folded grid (fivefold.expert_grid) the etp ranks of a group hold different tokens:
each rank arrives with the rows its ep dispatch gave its local experts (or, with ep = 1, its
own routed rows). So one expert MLP on the etp group is:

  1. counts: an all-gather of each rank's rows per local expert (int64, L per rank,
     purpose "moe_etp_counts");
  2. gather: every rank's rows to every etp rank, an all-to-all of variable splits (each
     rank sends its n rows to each peer; "moe_etp_gather"), regrouped expert-major;
  3. this rank's slice of every local expert on all of them (one grouped matmul per weight,
     fivefold.models.expert_matmul);
  4. reduce-scatter: each peer's rows' partial outputs back to it (an all-to-all,
     "moe_etp_scatter") and the etp partials summed, in etp rank order.

Backward runs the two row all-to-alls in reverse ("_backward" purposes): the gather's is the
input gradient's reduce-scatter, the scatter's the output gradient's all-gather. Every
rank's FLOPs on the experts are its rows' share of the etp group's times F / etp.
"""

from __future__ import annotations

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.models.expert_matmul import expert_swiglu
from fivefold.models.moe import MoE
from fivefold.parallel.expert_rows import AllToAll, expert_major

INNER_DIM = {"w1": 1, "w3": 1, "w2": 2}  # the stacked (X, out, in) weights' F dim


def expert_slice(name: str, full: torch.Tensor, etp: int, rank: int) -> torch.Tensor:
    """etp rank `rank`'s columns of stacked expert matrix `name` ("w1", "w3" or "w2")."""
    dim = INNER_DIM[name]
    size = full.shape[dim] // etp
    return full.narrow(dim, rank * size, size)


def etp_swiglu(moe: MoE, x_MD: torch.Tensor, counts: list[int], axis: Axis) -> torch.Tensor:
    """The local experts' outputs for rows `x_MD` sorted by local expert (`counts` each),
    computed with this rank's slices over the etp `axis` (module docstring's four steps)."""
    if axis.size == 1:
        return expert_swiglu(x_MD, counts, moe.w1, moe.w3, moe.w2, moe.matmul, moe.expert_mm)
    etp, L, n = axis.size, len(counts), x_MD.shape[0]
    mine = torch.tensor(counts, dtype=torch.int64)
    every = torch.empty(etp * L, dtype=torch.int64)
    C.all_gather(every, mine, axis, "moe_etp_counts")
    by_rank = every.view(etp, L).tolist()  # [etp rank][local expert]
    rows = [sum(row) for row in by_rank]
    x_all = AllToAll.apply(x_MD.repeat(etp, 1), [n] * etp, rows, axis, "moe_etp_gather")
    order = expert_major(by_rank)
    local_counts = [sum(row[e] for row in by_rank) for e in range(L)]
    y = expert_swiglu(x_all[order], local_counts, moe.w1, moe.w3, moe.w2, moe.matmul,
                      moe.expert_mm)
    y_all = torch.empty_like(y).index_copy_(0, order, y) if len(order) else y
    partial = AllToAll.apply(y_all, rows, [n] * etp, axis, "moe_etp_scatter")
    return partial.view(etp, n, x_MD.shape[1]).sum(0)
