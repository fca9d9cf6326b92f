"""Expert-parallel checkpoints read as whole experts, and whole experts cut for an ep rank.

Under expert parallelism (fivefold.parallel.expert) ep rank r of `ep` holds rows
[r L, (r+1) L), L = experts / ep, of every MoE layer's stacked expert matrices (w1, w3, w2 of
shape (X, ., .)), and the data-parallel engine keeps them in a flat unit of their own,
"layers.i.experts{r}of{ep}", sharded over the expert-data-parallel ranks
(fivefold.parallel.flat_unit `split_expert_units`). A checkpoint therefore stores each ep
rank's experts under that unit's name, next to the block's dense unit "layers.i".

The exchange format of a resume under another layout (fivefold.train.reshard) and of
`fivefold convert` is the whole model by parameter name, so here:

- `expert_degree` reads the ep degree a checkpoint was written with from its unit names;
- `rank_units` lists one (pp, tp, ep) rank's units the way the engine built them, which the
  reader (fivefold.train.checkpoint_export) cuts the flat buffers by;
- `join_expert_rows` stacks the ep ranks' rows back into the logical (X, ., .) tensor, after
  each ep rank's tensor-parallel parts were joined (so a split of the experts over tp ranks,
  undone by `unshard_tensor`, composes with it);
- `ep_rows` is the inverse, an ep rank's rows of a whole tensor, taken before the tp cut;
- the routing biases of auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437,
  Sec. 2.1.2) are buffers, not parameters: fivefold.train.checkpoint_export
  `read_expert_biases` reads them (`BIAS_KEYS`: either checkpoint form) and
  `place_expert_biases` sets them, whole on every rank.

Every move is a copy of rows, so weights and AdamW moments come back bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.models.hf import CheckpointError
from fivefold.parallel.expert import apply_expert_parallel, is_expert_param
from fivefold.parallel.flat_unit import split_expert_units, split_units
from fivefold.parallel.mesh import ExpertAxes
from fivefold.train.moe_stats import moe_layers

EXPERT_UNIT = re.compile(r"\.experts(\d+)of(\d+)\.shard")
BIAS_KEYS = (re.compile(r"expert_bias\.(layers\.\d+)"),  # the engine's
             re.compile(r"model\.(layers\.\d+)\.mlp\.expert_bias"))  # one plain rank's


def is_expert_name(name: str) -> bool:
    """Whether a whole-model parameter name is a stacked expert matrix ("layers.i.mlp.w1")."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == "layers" and is_expert_param(parts[2])


def expert_degree(keys, step: Path) -> int:
    """The ep degree that the checkpoint's expert unit names (".experts{r}of{ep}") name, else 1."""
    sizes = {int(m.group(2)) for key in keys if (m := EXPERT_UNIT.search(key))}
    if len(sizes) > 1:
        raise CheckpointError(str(step), f"its expert units name ep degrees {sorted(sizes)}; a "
                                         "checkpoint is written by one layout")
    return sizes.pop() if sizes else 1


def rank_units(model: nn.Module, ep: int, ep_rank: int) -> list[tuple[str, list]]:
    """(unit name, named parameters) of one rank's `model` (on the meta device), as the engine
    built them: ep = 1 as `split_units`; ep > 1 with the rank's expert rows kept and its
    experts in units of their own, the dense units on ep rank 0 only (every ep rank holds
    the same ones)."""
    if ep == 1:
        return [(name, params) for name, params, _ in split_units(model)]
    one = [Axis(name, None, 1, 0, None) for name in ("edp", "etp")]
    apply_expert_parallel(model, ExpertAxes(Axis("ep", None, ep, ep_rank, None), *one))  # shapes
    return [(name, params) for name, params, _, expert
            in split_expert_units(split_units(model), f"{ep_rank}of{ep}")
            if expert or ep_rank == 0]


def join_expert_rows(name: str, by_rank: dict[int, torch.Tensor], ep: int,
                     step: Path) -> torch.Tensor:
    """The whole tensor of `name` from each ep rank's part: expert matrices stacked along the
    expert dim in ep rank order, anything else as ep rank 0 holds it."""
    if not is_expert_name(name) or ep == 1:
        return by_rank[0]
    if sorted(by_rank) != list(range(ep)):
        raise CheckpointError(str(step), f"{name} is held by ep ranks {sorted(by_rank)} of {ep}")
    return torch.cat([by_rank[r] for r in range(ep)])


def ep_rows(name: str, full: torch.Tensor, ep: int, ep_rank: int) -> torch.Tensor:
    """Ep rank `ep_rank`'s rows of whole tensor `name` (expert matrices), else the tensor."""
    if not is_expert_name(name) or ep == 1:
        return full
    rows = full.shape[0] // ep
    return full[ep_rank * rows:(ep_rank + 1) * rows]


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
