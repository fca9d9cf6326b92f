"""GaLore on the data-parallel engine's flat units: tensor, pipeline and ZeRO-3 layouts.

GaLore (arXiv 2403.03507, Sec. 4, Algorithm 2; fivefold.memory.galore) projects each block
matrix's gradient onto the top-r singular vectors of the whole matrix's gradient. Where
fivefold.memory.galore_dp cannot run (tensor or pipeline parallelism, ZeRO-3), the
data-parallel engine (fivefold.parallel.data_parallel) owns parameters, gradient sync and
masters as for AdamW, and `GaLoreUnits` is its optimizer: the engine decays the matrices
(decoupled, GaLoreAdamW's order) and calls `step()`, which updates every master, and then
publishes them (all-gathers at ZeRO-1/2, the shard at ZeRO-3) as after AdamW.

Each unit's reduced gradient is first made whole on the rank: at ZeRO-1/2/3 the master's
shard gradients are all-gathered over the unit's shard axis (purpose "galore_grads", 4 bytes
per padded unit element, every step: ZeRO-3 gathers the gradient per unit as it gathers the
parameters for forward). The projected moments are divided by rows, as
fivefold.memory.galore_dp divides them: the projected gradient T_G P, Adam's moments and its
normalized step N are row for row, so ZeRO rank k of n projects only its chunk of T's rows
(ceil(B / n), the last padded with zeros) and keeps its moments; the chunks of N are
all-gathered, one bucket per unit (purpose "galore_steps", 4 r bytes per row: r / A of the
gradient gather's), and every rank applies the whole update N P^T of its unit and subtracts
its own shard of it (the back-projection is repeated on every ZeRO rank, the price of
gathering r columns instead of A). At ZeRO-0 every rank holds all rows. The full-rank
parameters' AdamW moments are this rank's shard only (torch's AdamW over views of the
master: the runs of the shard that are not block matrices).

Tensor parallelism. A column- or row-parallel weight W (m x n) holds one block of its split
dim on each of the t ranks. GaLore takes its subspace from the whole W's gradient: W is seen
as T (b x a), T = W^T when m <= n (left singular vectors, a = m) and T = W otherwise, a the
projected side, P (a x r), r = galore_rank(m x n) of the whole shape. On a refresh step each
split matrix's gradient is all-gathered over tp (purpose "galore_refresh", the whole matrix,
4 m n bytes) and every rank takes the SVD of the same gathered matrix itself, so every tp
(and dp) rank holds the same P without a broadcast (bit-identical inputs, the same kernel;
the SVD work is repeated on each rank instead of divided, as galore_dp divides it). Between
refreshes the projection of the rank's block follows from which side the split cuts:

  split cuts T's rows (w1, w3, w2, wo of a Llama block)   T_loc (b/t x a) P: rows of the
      whole projection, no communication; the tp rank's moments are of its b/t rows
  split cuts T's columns (wq, wk, wv)                      T_loc (b x a/t) P[a/t rows]: a
      partial sum, all-reduced over tp (purpose "galore_project", 4 r bytes per row of the
      ZeRO rank's chunk, one all-reduce per unit); moments the same on every tp rank

and the update N P^T, or N P[a/t rows]^T, is exactly the rank's block of the one-process
update. Replicated matrices (an MoE layer's router) are whole on every rank.

Pipeline parallelism: each stage's engine holds its own blocks' units and so their GaLore
states; the randomized refresh's seed (fivefold.memory.galore.refresh_seed) takes each
matrix's place among the whole model's block matrices, so every layout draws the one-process
run's test matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.comm import collectives as C
from fivefold.config import ModelConfig, TrainConfig
from fivefold.memory.galore import adam_direction, galore_rank, refresh_seed, subspace
from fivefold.models.description import block_parameters
from fivefold.optim import is_block_matrix
from fivefold.parallel.flat_unit import FlatUnit
from fivefold.parallel.tensor import split_dim


@dataclass
class UnitMatrix:
    """One block matrix of a unit: its slice of the flat buffer, this rank's block of the
    whole W (m x n), and how the tp split meets T (b x a)."""

    name: str
    offset: int
    shape: torch.Size  # this rank's block of W
    index: int  # place among the whole model's block matrices
    split: int | None  # the dim of W split over tp; None: whole on every tp rank
    left: bool  # whole m <= n: T = W^T
    r: int
    across: bool  # the split cuts T's columns: the projection is a sum over tp
    rows: int  # T's rows on this tp rank
    chunk: int  # of them, each ZeRO shard rank's (the last padded)

    def t_view(self, w: torch.Tensor) -> torch.Tensor:
        return w.T if self.left else w


def block_matrix_indices(model: ModelConfig, layers: list[int]) -> dict[int, int]:
    """{layer: the index of its first block matrix among the whole model's}, for `layers`
    (the plain model enumerates block matrices layer by layer, in registration order)."""
    starts, count = {}, 0
    for layer in range(max(layers, default=-1) + 1):
        starts[layer] = count
        count += sum(len(p.shape) == 2 for p in block_parameters(model, layer))
    return starts


def rest_runs(unit: FlatUnit, lo: int, hi: int) -> list[tuple[int, int]]:
    """[start, end) runs of the unit's flat positions in [lo, hi) that hold parameters other
    than block matrices (adjacent runs merged), relative to lo."""
    runs: list[tuple[int, int]] = []
    for name, param, off, n in zip(unit.names, unit.params, unit.offsets, unit.numels):
        a, b = max(off, lo), min(off + n, hi)
        if a >= b or is_block_matrix(name, param):
            continue
        if runs and runs[-1][1] == a - lo:
            runs[-1] = (runs[-1][0], b - lo)
        else:
            runs.append((a - lo, b - lo))
    return runs


class GaLoreUnits:
    """The data-parallel engine's optimizer under `train.optimizer = "galore"` (module
    docstring): low-rank Adam on every unit's block matrices, AdamW on the rest."""

    def __init__(self, engine, train: TrainConfig, tp_axis: C.Axis):
        self.engine, self.cfg, self.tp = engine, train, tp_axis
        self.param_groups = [{"lr": train.lr}]  # the engine sets the step's lr here
        # the ranks that divide the projected moments by rows: ZeRO's shard axis
        self.shard = engine.shard_axis if engine.stage >= 1 else None
        n = self.shard.size if self.shard else 1
        model_cfg: ModelConfig = engine.model.cfg
        layers = sorted({int(name.split(".")[1]) for unit in engine.units
                         for name in unit.names if name.startswith("layers.")})
        starts = block_matrix_indices(model_cfg, layers)
        self.matrices: list[list[UnitMatrix]] = []
        self.state: dict[str, dict[str, torch.Tensor]] = {}  # per matrix (byte counts read it)
        device = engine.masters[0].device
        for unit in engine.units:
            mats, seen = [], {}
            for name, param, off, shape in zip(unit.names, unit.params, unit.offsets,
                                               unit.shapes):
                if not is_block_matrix(name, param):
                    continue
                layer = int(name.split(".")[1])
                index = starts[layer] + seen.setdefault(layer, 0)
                seen[layer] += 1
                split = split_dim(name) if tp_axis.size > 1 else None
                whole = list(shape)
                if split is not None:
                    whole[split] *= tp_axis.size
                left = whole[0] <= whole[1]
                rows = shape[1] if left else shape[0]
                w = UnitMatrix(name, off, shape, index, split, left, galore_rank(whole),
                               split is not None and split != (1 if left else 0), rows,
                               -(-rows // n))
                zeros = lambda *s: torch.zeros(s, dtype=torch.float32, device=device)
                self.state[name] = {"proj": zeros(min(whole), w.r),
                                    "exp_avg": zeros(w.chunk, w.r),
                                    "exp_avg_sq": zeros(w.chunk, w.r)}
                mats.append(w)
            self.matrices.append(mats)
        self.step_count = torch.zeros(())  # GaLore's step, the same for every matrix
        # the full-rank parameters: views of this rank's master, stepped by torch's AdamW
        self.rest: list[tuple[int, int, int, nn.Parameter]] = []
        for u, (unit, master) in enumerate(zip(engine.units, engine.masters)):
            lo = 0 if engine.stage == 0 else unit.shard_slice.start
            for a, b in rest_runs(unit, lo, lo + master.numel()):
                self.rest.append((u, a, b, nn.Parameter(master.data[a:b])))
        self.adamw = torch.optim.AdamW([p for *_, p in self.rest], lr=train.lr,
                                       weight_decay=0.0, betas=(train.beta1, train.beta2),
                                       eps=train.eps)
        for *_, p in self.rest:  # created now, so a checkpoint load fills them
            self.adamw.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                       exp_avg_sq=torch.zeros_like(p))
        self.optimizers = [self, self.adamw]  # what the engine counts state bytes of

    def _whole_grad(self, u: int) -> torch.Tensor:
        """Unit u's whole reduced gradient (padded): the master's own at stage 0, else its
        shards all-gathered over the unit's shard axis."""
        grad = self.engine.masters[u].grad
        if self.engine.stage == 0:
            return grad
        unit = self.engine.units[u]
        whole = torch.empty(unit.padded, dtype=grad.dtype, device=grad.device)
        C.all_gather(whole, grad, self.engine.unit_shard[u], "galore_grads")
        return whole

    def _whole_matrix(self, w: UnitMatrix, grad: torch.Tensor) -> torch.Tensor:
        """The whole W's gradient from this rank's block `grad`: gathered over tp if split."""
        if w.split is None:
            return grad
        out = torch.empty(self.tp.size * grad.numel(), dtype=grad.dtype, device=grad.device)
        C.all_gather(out, grad.contiguous().view(-1), self.tp, "galore_refresh")
        return torch.cat(out.view(self.tp.size, *grad.shape).unbind(0), dim=w.split)

    def _proj_of_block(self, w: UnitMatrix) -> torch.Tensor:
        """The rows of P this rank's block multiplies: all of them, or its a/t rows."""
        proj = self.state[w.name]["proj"]
        if not w.across:
            return proj
        part = w.shape[w.split]
        return proj[self.tp.rank * part:(self.tp.rank + 1) * part]

    def _my_rows(self, w: UnitMatrix, grad: torch.Tensor) -> torch.Tensor:
        """This ZeRO rank's chunk of T's rows of `grad` (this tp rank's block), zero-padded."""
        if self.shard is None:
            return w.t_view(grad)
        start = self.shard.rank * w.chunk
        mine = w.t_view(grad)[start:start + w.chunk]
        return F.pad(mine, (0, 0, 0, w.chunk - mine.shape[0]))

    def _all_rows(self, mats: list[UnitMatrix], steps: list[torch.Tensor]
                  ) -> list[torch.Tensor]:
        """Every ZeRO rank's chunks of Adam's normalized steps, all-gathered (one bucket per
        unit), as each matrix's T rows on this tp rank."""
        if self.shard is None:
            return steps
        send = torch.cat([s.reshape(-1) for s in steps])
        gathered = torch.empty(self.shard.size * send.numel(), dtype=send.dtype,
                               device=send.device)
        C.all_gather(gathered, send, self.shard, "galore_steps")
        parts = gathered.view(self.shard.size, -1).split([s.numel() for s in steps], dim=1)
        return [part.reshape(-1, w.r)[:w.rows] for w, part in zip(mats, parts)]

    @torch.no_grad()
    def step(self) -> None:
        """GaLore's step of every block matrix, subtracted from this rank's master (already
        decayed by the engine), then AdamW on the rest's views."""
        t, lr = self.cfg, self.param_groups[0]["lr"]
        k = int(self.step_count)
        refresh = k % t.galore_update_gap == 0
        for u, (unit, master) in enumerate(zip(self.engine.units, self.engine.masters)):
            mats = self.matrices[u]
            if not mats:
                continue
            grad = self._whole_grad(u).float()
            blocks = [grad[w.offset:w.offset + w.shape.numel()].view(w.shape) for w in mats]
            if refresh:
                for w, g in zip(mats, blocks):
                    self.state[w.name]["proj"].copy_(subspace(
                        self._whole_matrix(w, g), w.r, w.left, refresh_seed(w.index, k),
                        t.galore_svd))
            lows = [self._my_rows(w, g) @ self._proj_of_block(w) for w, g in zip(mats, blocks)]
            summed = [low for w, low in zip(mats, lows) if w.across]
            if summed and self.tp.size > 1:  # the partial projections of T's column blocks
                flat = torch.cat([low.reshape(-1) for low in summed])
                C.all_reduce(flat, self.tp, "galore_project")
                for low, part in zip(summed, flat.split([low.numel() for low in summed])):
                    low.copy_(part.view_as(low))
            steps = self._all_rows(mats, [adam_direction(
                self.state[w.name]["exp_avg"], self.state[w.name]["exp_avg_sq"], low, k + 1,
                t.beta1, t.beta2, t.eps) for w, low in zip(mats, lows)])
            update = torch.zeros(unit.padded, dtype=master.dtype, device=master.device)
            for w, normalized in zip(mats, steps):
                block = update[w.offset:w.offset + w.shape.numel()].view(w.shape)
                w.t_view(block).copy_(normalized @ self._proj_of_block(w).T)
            mine = update if self.engine.stage == 0 else update[unit.shard_slice]
            master.data.add_(mine, alpha=-lr * t.galore_scale)
        self.step_count.fill_(k + 1)
        for u, a, b, p in self.rest:
            p.grad = self.engine.masters[u].grad[a:b]
        self.adamw.param_groups[0]["lr"] = lr
        self.adamw.step()
        for *_, p in self.rest:
            p.grad = None

    def checkpoint_state(self, tag: str) -> dict[str, torch.Tensor]:
        """GaLore's step, each matrix's projection and moments (this rank's block), and the
        rest's AdamW states (this rank's runs, `tag` naming the shard)."""
        out = {"galore.step": self.step_count}
        for name, s in self.state.items():
            out[f"galore.proj.{name}"] = s["proj"]  # the same on every ZeRO rank
            out.update({f"galore.{kind}.{name}.{tag}": s[kind]
                        for kind in ("exp_avg", "exp_avg_sq")})
        for j, (u, a, b, p) in enumerate(self.rest):
            run = f"{self.engine.units[u].name}.{tag}.run{j}"
            out.update({f"rest.{kind}.{run}": v for kind, v in self.adamw.state[p].items()})
        return out
