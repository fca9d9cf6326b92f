"""A group of parameters stored as one flat buffer, the unit of data-parallel communication.

Every data-parallel engine (fivefold.parallel.data_parallel) groups the model's parameters
into units (one per transformer block, plus a root unit for embeddings, final norm and output
head), as FSDP does (arXiv 2304.11277, Sec. 3.2). A unit's parameters are laid end to end in
one flat buffer padded to a multiple of the shard degree n, so shard r is the contiguous
slice [r*S, (r+1)*S) with S = padded / n, and one collective moves the whole unit. The
module's parameters become views into the flat buffer; freeing the buffer's storage frees
all of them at once (ZeRO-3), and gathering into it restores them without touching autograd.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FlatUnit:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], shard_degree: int,
                 shard_rank: int, dtype: torch.dtype, device: torch.device,
                 shard_multiple: int = 1):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.numel = sum(self.numels)
        unit = shard_degree * shard_multiple  # each shard a multiple of `shard_multiple`
        self.padded = math.ceil(self.numel / unit) * unit
        self.shard_numel = self.padded // shard_degree
        self.shard_rank = shard_rank
        self.shard_slice = slice(shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel)
        self.dtype, self.device = dtype, device
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off, n in zip(self.params, self.offsets, self.numels):
                self.full[off:off + n].copy_(p.detach().reshape(-1))
        self.point_params_at(self.full)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat` (a whole-unit buffer), in its shape, sharing
        storage; in parameter order."""
        return [flat[off:off + n].view(shape)
                for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make each parameter a view of its slice of `flat` (same storage)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def decay_mask(self) -> torch.Tensor:
        """Bool over this rank's shard: True where weight decay applies (matrices)."""
        mask = torch.zeros(self.padded, dtype=torch.bool, device=self.device)
        for off, n, shape in zip(self.offsets, self.numels, self.shapes):
            mask[off:off + n] = len(shape) >= 2
        return mask[self.shard_slice]

    def flatten_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the parameters' .grad into `out` (padded length), zeros in the padding."""
        out[self.numel:].zero_()
        for p, off, n in zip(self.params, self.offsets, self.numels):
            out[off:off + n].copy_(p.grad.reshape(-1))
        return out

    # -- ZeRO-3: the full buffer exists only while the unit computes

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def allocate_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
