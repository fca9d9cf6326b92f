"""The row all-to-all of expert parallelism and the regrouping of received rows.

`AllToAll` moves rows of a (rows, width) tensor over an axis by per-rank counts, its
backward the reverse all-to-all (GShard, arXiv 2006.16668, Sec. 3; fivefold.parallel.expert
dispatches and combines tokens with it, fivefold.parallel.expert_tensor gathers and
scatters them over the etp ranks). `expert_major` reorders rows received source by source
into expert-major order for the grouped matmul.
"""

from __future__ import annotations

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis


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
