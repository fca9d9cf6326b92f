"""Checkpoints on the experts' grid read as whole experts, and whole experts cut for a rank.

On the experts' grid (fivefold.expert_grid: ep, etp, or tp > 1 with an MoE model, which the
experts fold into) rank (ep r, etp t) holds rows [r L, (r+1) L), L = experts / ep, of every MoE
layer's stacked expert matrices (w1, w3, w2 of shape (X, ., .)) and, within them, etp rank t's
columns of each expert's MLP (w1 and w3 its inner features [t F/etp, (t+1) F/etp), w2 the
matching input columns; fivefold.parallel.expert_tensor `expert_slice`). The data-parallel
engine keeps them in a flat unit of their own, "layers.i.experts{r}of{ep}" or, with etp > 1,
"layers.i.experts{r}of{ep}x{t}of{etp}" (fivefold.parallel.flat_unit `expert_unit_tag`),
sharded over the expert-data-parallel ranks. A checkpoint stores each of them under that name,
next to the block's dense unit "layers.i". The experts are not split by tp (an MoE layer runs
whole on its tp rank's tokens), so an expert unit's edp shards sit under whichever tp rank's
key tag (".tp{t}of{T}") the edp rank holding each one has: the reader takes them from any.

The exchange format of a resume under another layout (fivefold.train.reshard) and of
`fivefold convert` is the whole model by parameter name, so here:

- `saved_grid` reads the grid a checkpoint was written with from its unit names;
- `rank_units` lists one (pp, tp, ep, etp) rank's units the way the engine built them, which
  the reader (fivefold.train.checkpoint_export) cuts the flat buffers by;
- `join_expert_parts` puts the grid's parts back together: etp columns side by side, then the
  ep ranks' rows stacked, into the logical (X, ., .) tensor;
- `expert_part` is the inverse, a grid rank's part of a whole tensor (taken before the tp cut,
  which leaves expert matrices whole);
- the routing biases of auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437,
  Sec. 2.1.2) are buffers, not parameters: fivefold.train.checkpoint_export
  `read_expert_biases` reads them (`BIAS_KEYS`: either checkpoint form) and
  `place_expert_biases` sets them, whole on every rank.

Every move is a copy of rows and columns, so weights and AdamW moments come back bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.models.hf import CheckpointError
from fivefold.parallel.expert import apply_expert_parallel, is_expert_param
from fivefold.parallel.expert_tensor import INNER_DIM, expert_slice
from fivefold.parallel.flat_unit import expert_unit_tag, split_expert_units, split_units
from fivefold.parallel.mesh import ExpertAxes
from fivefold.train.moe_stats import moe_layers

# an expert unit's name, alone or in a checkpoint key ("master.{unit}.shard0of2")
EXPERT_UNIT = re.compile(r"\.experts(\d+)of(\d+)(?:x(\d+)of(\d+))?(?=\.shard|$)")
BIAS_KEYS = (re.compile(r"expert_bias\.(layers\.\d+)"),  # the engine's
             re.compile(r"model\.(layers\.\d+)\.mlp\.expert_bias"))  # one plain rank's


class ExpertGrid(NamedTuple):
    """How a checkpoint's experts are split: ep and etp degrees, and whether they are units
    of their own at all (`apart`: any experts' grid, ep = etp = 1 included when tp > 1)."""

    ep: int = 1
    etp: int = 1
    apart: bool = False

    def ranks(self) -> list[tuple[int, int]]:
        """Every (ep rank, etp rank) of the grid, in order."""
        return [(e, t) for e in range(self.ep) for t in range(self.etp)]


def is_expert_name(name: str) -> bool:
    """Whether a whole-model parameter name is a stacked expert matrix ("layers.i.mlp.w1")."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == "layers" and is_expert_param(parts[2])


def is_expert_unit(unit: str) -> bool:
    """Whether a flat unit's name is an expert unit's ("layers.i.experts0of2x1of2")."""
    return EXPERT_UNIT.search(unit) is not None


def saved_grid(keys, step: Path) -> ExpertGrid:
    """The experts' grid that a checkpoint's keys name (".experts{r}of{ep}[x{t}of{etp}]");
    ExpertGrid() where the experts sit in their blocks' units."""
    sizes = {(int(m.group(2)), int(m.group(4) or 1)) for key in keys
             if (m := EXPERT_UNIT.search(key))}
    if len(sizes) > 1:
        raise CheckpointError(str(step), f"its expert units name (ep, etp) degrees "
                                         f"{sorted(sizes)}; a checkpoint is written by one "
                                         "layout")
    return ExpertGrid(*sizes.pop(), True) if sizes else ExpertGrid()


def rank_units(model: nn.Module, grid: ExpertGrid, ep_rank: int = 0, etp_rank: int = 0
               ) -> list[tuple[str, list, bool]]:
    """(unit name, named parameters, holds experts) of one rank's `model` (on the meta
    device), as the engine built them: without a grid as `split_units`; on one with the
    rank's expert part kept and its experts in units of their own, the dense units on grid
    rank (0, 0) only (every grid rank holds the same ones)."""
    if not grid.apart:
        return [(name, params, False) for name, params, _ in split_units(model)]
    axes = ExpertAxes(Axis("ep", None, grid.ep, ep_rank, None), Axis("edp", None, 1, 0, None),
                      Axis("etp", None, grid.etp, etp_rank, None))
    apply_expert_parallel(model, axes)  # shapes only: no collective runs
    tag = expert_unit_tag(ep_rank, grid.ep, etp_rank, grid.etp)
    return [(name, params, expert) for name, params, _, expert
            in split_expert_units(split_units(model), tag)
            if expert or ep_rank == etp_rank == 0]


def join_expert_parts(name: str, parts: dict[tuple[int, int], torch.Tensor],
                      grid: ExpertGrid, step: Path) -> torch.Tensor:
    """The whole expert matrix `name` from every grid rank's part: each ep rank's etp column
    slices side by side (their inner dim), then the ep ranks' rows stacked."""
    if sorted(parts) != grid.ranks():
        raise CheckpointError(str(step), f"{name} is held by (ep, etp) ranks {sorted(parts)} "
                                         f"of {grid.ep} x {grid.etp}")
    dim = INNER_DIM[name.rsplit(".", 1)[1]]
    return torch.cat([torch.cat([parts[e, t] for t in range(grid.etp)], dim)
                      for e in range(grid.ep)])


def expert_part(name: str, full: torch.Tensor, ep: int, ep_rank: int, etp: int = 1,
                etp_rank: int = 0) -> torch.Tensor:
    """Grid rank (ep_rank, etp_rank)'s part of whole tensor `name` (expert matrices: its ep
    rank's rows, its etp rank's columns of them), else the tensor."""
    if not is_expert_name(name):
        return full
    rows = full.shape[0] // ep
    return expert_slice(name.rsplit(".", 1)[1], full[ep_rank * rows:(ep_rank + 1) * rows],
                        etp, etp_rank)


@torch.no_grad()
def place_expert_biases(model: nn.Module, biases: dict[str, torch.Tensor], step: Path) -> None:
    """Set the routing bias of every MoE layer of `model` that balances with one."""
    for block, moe in moe_layers(model):
        if not moe.balance_bias:
            continue
        if block not in biases:
            raise CheckpointError(str(step), f"holds no routing bias for {block} (this run "
                                             "sets moe.bias_update_rate > 0)")
        moe.expert_bias.copy_(biases[block])
