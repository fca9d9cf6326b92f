"""Muon on every data layout: each matrix orthogonalized whole, on the rank that owns it.

Muon's momentum and its Nesterov update are element-wise, so they live on the data-parallel
engine's flat shards (fivefold.parallel.data_parallel) like AdamW's moments; its
Newton-Schulz orthogonalization (fivefold.muon) is not: it needs each weight matrix whole,
and ZeRO's shards (stages 1-3) and tensor parallelism's splits hold parts of it. The
engine's step for `train.optimizer = "muon"` under ZeRO or tp > 1 therefore runs, per flat
unit ("Muon is Scalable", arXiv 2502.16982, Sec. 2.3, "Distributed Muon": gather the update,
orthogonalize, keep one's part; here the owners are spread, fivefold.parallel.muon_owners):

  1. momentum    on this rank's shard, each matrix element: m <- mu m + (1 - mu) g and the
                 Nesterov update u = (1 - mu) g + mu m (torch.optim.Muon's form)
  2. gather      one all-gather of the unit's u over the unit's Muon axis: the ZeRO shard
                 ranks times the tp ranks ("muon_gather"); every rank then holds each tp
                 rank's whole flat layout of the unit
  3. owner       each matrix has one owner on that axis (balanced by Newton-Schulz FLOPs
                 over all the engine's units); the owner joins the tp ranks' parts along
                 the split dim (column-parallel: rows; row-parallel: columns), orthogonalizes
                 the whole matrix and writes each tp rank's part of the result into that
                 rank's row of a zero buffer
  4. scatter     one reduce-scatter of that buffer over the same axis ("muon_scatter"):
                 every element is non-zero on its owner only, so the sum is exact and each
                 rank receives its shard of the orthogonalized update
  5. update      decoupled weight decay and the RMS-matched step on the shard's matrix
                 elements; every other element (vectors, embedding, head) takes AdamW,
                 whose states cover only those elements

A mixture-of-experts layer's stacked experts (E, A, B) are E matrices, each an item of its
own; expert units gather over their own sharding axis (the expert-data-parallel ranks),
not over tp, since MoE layers run whole on every tp rank. A rank's optimizer state is 4
bytes per matrix element of its shard and 8 per other element, as with one rank. The
bytes moved are those of ZeRO's own parameter gather and gradient scatter, in fp32, for
every unit that holds a matrix; fivefold.planner.muon_cost predicts them and prices the
owners' Newton-Schulz FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.comm import collectives as C
from fivefold.config import TrainConfig
from fivefold.muon import momentum_update, orthogonalize, rms_matched_lr
from fivefold.optim import is_muon_matrix
from fivefold.parallel.flat_unit import FlatUnit
from fivefold.parallel.muon_owners import assign_owners
from fivefold.parallel.tensor import split_dim


@dataclass(frozen=True)
class Matrix:
    """One matrix to orthogonalize: where it sits in a tp rank's flat layout of its unit."""

    offset: int
    shape: tuple[int, int]  # this tp rank's part
    split: int | None  # the dim split over the unit's tp ranks; None: whole on each
    owner: int  # its rank on the unit's Muon axis


@dataclass(frozen=True)
class Piece:
    """A parameter's elements on this rank's shard, [lo, hi) of the shard."""

    name: str
    lo: int
    hi: int
    matrix: bool  # of a parameter with two or more dims
    rows: int = 0  # the whole matrix's shape (Muon pieces), for the RMS-matched lr
    cols: int = 0


def whole_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, int]:
    """(rows, cols) of one whole matrix of a Muon parameter whose tp rank holds `shape`."""
    split = split_dim(name) if tp > 1 else None
    return tuple(s * (tp if d == split else 1) for d, s in enumerate(shape))[-2:]


def shard_pieces(unit: FlatUnit, muon: bool, tp: int) -> list[Piece]:
    """The non-empty parts of the unit's Muon matrices (`muon`), or of its other
    parameters, on this rank's shard; `tp`: the tp ranks the unit's matrices are split over."""
    lo, hi = unit.shard_slice.start, unit.shard_slice.stop
    out = []
    for name, p, off, n in zip(unit.names, unit.params, unit.offsets, unit.numels):
        a, b = max(off, lo), min(off + n, hi)
        if a < b and is_muon_matrix(name, p) == muon:
            out.append(Piece(name, a - lo, b - lo, p.dim() >= 2,
                             *(whole_shape(name, tuple(p.shape), tp) if muon else (0, 0))))
    return out


class ShardedMuon:
    """Muon's step over the engine's flat master shards (module docstring); duck-types the
    optimizer the engine steps: `param_groups` (their "lr" set by the engine), `step()`,
    `state` and `optimizers` (for the optimizer-state bytes)."""

    def __init__(self, units: list[FlatUnit], masters: list[torch.Tensor],
                 axes: list[tuple[C.Axis, int]], train: TrainConfig):
        """`axes[i]`: unit i's Muon axis and the tp ranks in it (innermost: the axis rank
        is shard rank * tp + tp rank)."""
        self.units, self.masters, self.axes = units, masters, axes
        self.momentum, self.weight_decay = train.muon_momentum, train.weight_decay
        self.group = {"lr": train.lr}
        self.matrices = self._assign(units, axes)
        self.pieces = [shard_pieces(u, True, tp) for u, (_, tp) in zip(units, axes)]
        self.state = {(i, p.name): {"momentum_buffer": torch.zeros(p.hi - p.lo, device=u.device)}
                      for i, u in enumerate(units) for p in self.pieces[i]}
        self.rest = [(i, p) for i, u in enumerate(units) for p in shard_pieces(u, False, 1)]
        self.rest_views = [masters[i].detach()[p.lo:p.hi] for i, p in self.rest]
        decays = [p.matrix for _, p in self.rest]  # AdamW's decay: embedding and head
        groups = [{"params": [v for v, d in zip(self.rest_views, decays) if d],
                   "weight_decay": self.weight_decay},
                  {"params": [v for v, d in zip(self.rest_views, decays) if not d],
                   "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.adamw = (torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2),
                                        eps=train.eps) if groups else None)
        self.optimizers = [self] + ([self.adamw] if self.adamw else [])

    @staticmethod
    def _assign(units: list[FlatUnit], axes: list[tuple[C.Axis, int]]) -> list[list[Matrix]]:
        """Each unit's matrices with their owners, balanced over all units on one axis."""
        loads: dict[str, list[float]] = {}
        out = []
        for unit, (axis, tp) in zip(units, axes):
            items, whole = [], []
            for name, p, off, shape in zip(unit.names, unit.params, unit.offsets, unit.shapes):
                if not is_muon_matrix(name, p):
                    continue
                split = split_dim(name) if tp > 1 else None
                rows, cols = shape[-2:]
                for e in range(shape[0] if len(shape) == 3 else 1):  # stacked experts
                    items.append((off + e * rows * cols, (rows, cols), split))
                    whole.append(whole_shape(name, tuple(shape), tp))
            owners = assign_owners(whole, axis.size, loads.setdefault(axis.name,
                                                                      [0.0] * axis.size))
            out.append([Matrix(off, shape, split, owner)
                        for (off, shape, split), owner in zip(items, owners)])
        return out

    @property
    def param_groups(self) -> list[dict]:
        return [self.group] + (self.adamw.param_groups if self.adamw else [])

    @torch.no_grad()
    def step(self) -> None:
        lr = self.group["lr"]
        for view, (i, p) in zip(self.rest_views, self.rest):
            view.grad = self.masters[i].grad[p.lo:p.hi]
        for i, (unit, master) in enumerate(zip(self.units, self.masters)):
            if not self.matrices[i]:
                continue
            update = torch.zeros(unit.shard_numel, device=master.device)
            for p in self.pieces[i]:
                update[p.lo:p.hi] = momentum_update(self.state[i, p.name]["momentum_buffer"],
                                                    master.grad[p.lo:p.hi], self.momentum)
            ortho = self._orthogonalized(i, update)
            for p in self.pieces[i]:
                part = master.detach()[p.lo:p.hi]
                part.mul_(1 - lr * self.weight_decay)
                part.add_(ortho[p.lo:p.hi], alpha=-rms_matched_lr(lr, p.rows, p.cols))
        if self.adamw:
            self.adamw.step()
        for view in self.rest_views:
            view.grad = None

    def _orthogonalized(self, i: int, update: torch.Tensor) -> torch.Tensor:
        """Steps 2-4 of the module docstring for unit i: this rank's shard of the unit's
        orthogonalized update."""
        axis, tp = self.axes[i]
        shard = update.numel()
        gathered = update
        if axis.size > 1:
            gathered = update.new_empty(axis.size * shard)
            C.all_gather(gathered, update, axis, "muon_gather")
        n = axis.size // tp
        layouts = gathered.view(n, tp, shard).transpose(0, 1).reshape(tp, n * shard)
        out = torch.zeros_like(layouts)
        for m in self.matrices[i]:
            if m.owner != axis.rank:
                continue
            numel = m.shape[0] * m.shape[1]
            parts = [layouts[t, m.offset:m.offset + numel].view(m.shape) for t in range(tp)]
            whole = parts[0] if m.split is None else torch.cat(parts, m.split)
            ortho = orthogonalize(whole).float()
            for t in range(tp):
                part = ortho if m.split is None else ortho.narrow(
                    m.split, t * m.shape[m.split], m.shape[m.split])
                out[t, m.offset:m.offset + numel].view(m.shape).copy_(part)
        if axis.size == 1:
            return out[0]
        mine = update.new_empty(shard)
        C.reduce_scatter(mine, out.view(tp, n, shard).transpose(0, 1).contiguous().view(-1),
                         axis, "muon_scatter")
        return mine

    def checkpoint_state(self, tags: list[str]) -> dict[str, torch.Tensor]:
        """This rank's Muon momenta and AdamW states, keyed by kind, parameter name and its
        unit's shard tag `tags[i]`; AdamW's created empty where no step has run yet, so that
        a checkpoint load can fill them in place."""
        out = {f"momentum_buffer.{name}.{tags[i]}": state["momentum_buffer"]
               for (i, name), state in self.state.items()}
        for view, (i, p) in zip(self.rest_views, self.rest):
            state = self.adamw.state[view]
            if not state:
                state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(view),
                             exp_avg_sq=torch.zeros_like(view))
            out.update({f"{kind}.{p.name}.{tags[i]}": tensor for kind, tensor in state.items()})
        return out


def muon_axes(mesh, stage: int, shard_axes: tuple[str, ...], unit_shard: list[C.Axis],
              is_expert: list[bool]) -> list[tuple[C.Axis, int]]:
    """Each unit's Muon axis and its tp factor: a dense unit's ZeRO shard axes (none at
    stage 0) with tp innermost; an expert unit's own shard axis (MoE layers are whole on
    every tp rank). Axes of one rank are left out, so the ledger names what is crossed."""
    names = [a for a in (*(shard_axes if stage else ()), "tp") if mesh.shape[a] > 1]
    dense = mesh.joint_axis(*names), mesh.shape["tp"]
    return [(axis, 1) if expert else dense for axis, expert in zip(unit_shard, is_expert)]
