"""The flat bucket data-parallel GaLore communicates: each rank's rows of every matrix.

fivefold.memory.galore_dp shards each block matrix by rows (of T, the matrix with GaLore's
projected side as its columns) over the n data-parallel ranks, and the full-rank parameters
(embedding, norms, head) as one flat vector. A `RowBucket` is the layout of one such flat
buffer of n equal segments, so that a reduce-scatter leaves rank k its segment and an
all-gather gives every rank all of them (fivefold.comm.collectives): segment k holds rows
[k c, (k + 1) c) of each matrix (b rows padded to n c), then the k-th of n equal shares of
the full-rank parameters' vector (padded). The width of a matrix's rows is its own: A for
gradients, r for the projected gradient and Adam's normalized step. Padding rows and
elements are zeros.
"""

from __future__ import annotations

import math

import torch


class RowBucket:
    """A flat bucket of n segments, one per rank: segment k holds rows [k c, (k + 1) c) of
    each matrix's (b x width) tensor (b padded to n c), then the k-th share of the
    full-rank parameters' flat vector (padded to n shares)."""

    def __init__(self, n: int, shapes: list[tuple[int, int]], rest_numel: int):
        self.n, self.rest_numel = n, rest_numel
        self.chunks = [math.ceil(b / n) for b, _ in shapes]  # rows per rank, c
        self.shapes, self.offsets, offset = shapes, [], 0
        for (_, width), c in zip(shapes, self.chunks):
            self.offsets.append(offset)
            offset += c * width
        self.rest_chunk = math.ceil(rest_numel / n)
        self.rest_offset = offset
        self.seg = offset + self.rest_chunk

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.n * self.seg, device=device)

    def _columns(self, i: int) -> slice:
        c, width = self.chunks[i], self.shapes[i][1]
        return slice(self.offsets[i], self.offsets[i] + c * width)

    def pack(self, out: torch.Tensor, matrices: list[torch.Tensor],
             rest: list[torch.Tensor]) -> torch.Tensor:
        """Lay the (b x width) `matrices` and the flattened `rest` into bucket `out`."""
        segments = out.view(self.n, self.seg)
        for i, t in enumerate(matrices):
            padded = torch.zeros(self.n * self.chunks[i], t.shape[1], device=out.device)
            padded[:t.shape[0]].copy_(t)
            segments[:, self._columns(i)].copy_(padded.view(self.n, -1))
        flat = torch.zeros(self.n * self.rest_chunk, device=out.device)
        if rest:
            torch.cat([t.reshape(-1) for t in rest], out=flat[:self.rest_numel])
        segments[:, self.rest_offset:].copy_(flat.view(self.n, -1))
        return out

    def mine(self, segment: torch.Tensor, i: int) -> torch.Tensor:
        """Matrix i's rows (c x width) in one rank's `segment` (seg elements), a view."""
        return segment[self._columns(i)].view(self.chunks[i], self.shapes[i][1])

    def whole(self, bucket: torch.Tensor, i: int) -> torch.Tensor:
        """Matrix i (b x width) from a whole bucket (n x seg elements)."""
        rows = bucket.view(self.n, self.seg)[:, self._columns(i)]
        return rows.reshape(self.n * self.chunks[i], -1)[:self.shapes[i][0]]

    def rest_of(self, segment: torch.Tensor) -> torch.Tensor:
        """The full-rank parameters' share in one rank's `segment`, a view."""
        return segment[self.rest_offset:]

    def rest_whole(self, bucket: torch.Tensor) -> torch.Tensor:
        """The full-rank parameters' flat vector from a whole bucket."""
        return bucket.view(self.n, self.seg)[:, self.rest_offset:].reshape(-1)[:self.rest_numel]
