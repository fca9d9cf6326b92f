"""A group of parameters stored as one flat buffer, the unit of data-parallel communication.

Every data-parallel engine (fivefold.parallel.data_parallel) groups the model's parameters
into units (one per transformer block, plus a root unit for embeddings, final norm and output
head), as FSDP does (arXiv 2304.11277, Sec. 3.2). A unit's parameters are laid end to end in
one flat buffer padded to a multiple of the shard degree n, so shard r is the contiguous
slice [r*S, (r+1)*S) with S = padded / n, and one collective moves the whole unit. The
module's parameters become views into the flat buffer; freeing the buffer's storage frees
all of them at once (ZeRO-3), and gathering into it restores them without touching autograd.

`split_units` and `split_expert_units` decide which parameters form each unit; `place_flat`
lays whole tensors out as a unit does (loading a checkpoint of another layout).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from fivefold.parallel.expert import is_expert_param


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

    def shard_parts(self, shard: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its elements in `shard`, a view) for each parameter with elements in
        this rank's shard (`shard`: a tensor laid out like the shard), in unit order; the
        padding left out. At stage 0, and on one rank, each part is a whole parameter."""
        lo, hi = self.shard_slice.start, self.shard_slice.stop
        return [(p, shard[max(off, lo) - lo:min(off + n, hi) - lo])
                for p, off, n in zip(self.params, self.offsets, self.numels)
                if off < hi and off + n > lo]

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
        """Copy the parameters' .grad into `out` (padded length), zeros in the padding and
        where a parameter has none (a pass that computed only some of the unit's)."""
        out[self.numel:].zero_()
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is None:
                out[off:off + n].zero_()
            else:
                out[off:off + n].copy_(p.grad.reshape(-1))
        return out

    # -- ZeRO-3: the full buffer exists only while the unit computes

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def allocate_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())


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


def expert_unit_tag(ep_rank: int, ep: int, etp_rank: int, etp: int) -> str:
    """What names one rank's expert units ("layers.i.experts{tag}"): its ep rank, and its
    etp rank where etp > 1 ("1of2x0of2"); a checkpoint's keys carry it
    (fivefold.train.expert_checkpoint)."""
    return f"{ep_rank}of{ep}" + (f"x{etp_rank}of{etp}" if etp > 1 else "")


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
def place_flat(unit: FlatUnit, target: torch.Tensor, whole: dict[str, torch.Tensor],
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
