"""GaLore on the data-parallel engine (fivefold.memory.galore_units): its collectives and
optimizer-state bytes on one rank, for `predict_ledger` (fivefold.planner.ledger_model).

Per step, on a unit with block matrices: at ZeRO-1/2/3 (n shard ranks) one fp32 all-gather
of the unit's gradient shards over the shard axis ("galore_grads", 4 bytes per padded
element) and one of every rank's chunk of Adam's normalized steps ("galore_steps", 4 n r
ceil(b / n) bytes per matrix, b the T rows on this tp rank); with tp, one fp32 all-reduce
over tp of the partial projections of the matrices whose split cuts T's columns
("galore_project", 4 r ceil(b / n) bytes each). A refresh step (every
`train.galore_update_gap` steps, from the first) adds one fp32 all-gather over tp per split
matrix ("galore_refresh", the whole matrix). State: each matrix's projection (4 a r) and
moments (8 r ceil(b / n)), and AdamW's moments (8 bytes) on the elements of this rank's
shard that are not block matrices (n = 1 at ZeRO-0).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import Config
from fivefold.models.description import MOE_PARTS, block_parameters
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.memory import Unit
from fivefold.planner.params import local_numel, local_shape


@dataclass(frozen=True)
class _Matrix:
    whole: tuple[int, int]  # W's shape in the plain model
    local: tuple[int, int]  # this tp rank's block
    split: int | None  # the dim split over tp

    @property
    def left(self) -> bool:
        return self.whole[0] <= self.whole[1]

    @property
    def r(self) -> int:
        return max(1, min(self.whole) // 4)

    @property
    def rows(self) -> int:
        """T's rows this rank holds (T = W^T when left)."""
        return self.local[1] if self.left else self.local[0]

    @property
    def across(self) -> bool:
        """The split cuts T's columns: the projection is summed over tp."""
        return self.split is not None and self.split != (1 if self.left else 0)


def _layout(cfg: Config, lay: ParallelPlan, layer: int) -> list[tuple[int, _Matrix | None]]:
    """(elements on this tp rank, the matrix or None for the rest) of block `layer`'s
    parameters in registration order (the unit's flat order); an MoE layer's are whole on
    every tp rank."""
    out = []
    for p in block_parameters(cfg.model, layer):
        tp = 1 if p.part in MOE_PARTS else lay.tp
        local = local_shape(cfg.model, p, tp)
        matrix = None
        if len(p.shape) == 2:
            split = p.placement.tp_dim if tp > 1 else None
            matrix = _Matrix(tuple(p.shape), tuple(local), split)
        out.append((local_numel(cfg.model, p, tp), matrix))
    return out


def _units(units: list[Unit], layers: list[int], has_root: bool):
    """(unit, its layer or None for the root) in the engine's order."""
    return zip(units, ([None] if has_root else []) + list(layers))


def _chunk(m: _Matrix, n: int) -> int:
    """T rows of each of the n ZeRO ranks' chunks (the last padded)."""
    return -(-m.rows // n)


def galore_engine_records(ledger, cfg: Config, lay: ParallelPlan, units: list[Unit],
                          layers: list[int], has_root: bool, refresh: bool) -> None:
    """Record GaLore's collectives of one step (a refresh step with `refresh`)."""
    shard_dim = "+".join(lay.shard_axes)
    for unit, layer in _units(units, layers, has_root):
        if layer is None:
            continue
        matrices = [m for _, m in _layout(cfg, lay, layer) if m is not None]
        n = unit.shard if lay.zero_stage >= 1 else 1
        if n > 1:
            ledger.record("all_gather", shard_dim, n, "float32", 4 * unit.padded,
                          "galore_grads")
            ledger.record("all_gather", shard_dim, n, "float32",
                          sum(4 * n * _chunk(m, n) * m.r for m in matrices), "galore_steps")
        if lay.tp == 1:
            continue
        if refresh:
            for m in matrices:
                if m.split is not None:
                    ledger.record("all_gather", "tp", lay.tp, "float32",
                                  4 * m.whole[0] * m.whole[1], "galore_refresh")
        project = sum(4 * _chunk(m, n) * m.r for m in matrices if m.across)
        if project:
            ledger.record("all_reduce", "tp", lay.tp, "float32", project, "galore_project")


def galore_engine_optimizer_bytes(cfg: Config, lay: ParallelPlan, units: list[Unit],
                                  layers: list[int], has_root: bool, shard_rank: int) -> int:
    """The bytes GaLoreUnits holds on this rank (module docstring)."""
    total = 0
    for unit, layer in _units(units, layers, has_root):
        n = unit.shard if lay.zero_stage >= 1 else 1
        lo = 0 if lay.zero_stage == 0 else shard_rank * unit.shard_numel
        hi = unit.padded if lay.zero_stage == 0 else lo + unit.shard_numel
        if layer is None:  # the root: embedding, final norm and head, all AdamW's
            total += 8 * max(0, min(unit.numel, hi) - lo)
            continue
        start = 0
        for numel, m in _layout(cfg, lay, layer):
            if m is None:
                total += 8 * max(0, min(start + numel, hi) - max(start, lo))
            else:
                total += 4 * min(m.whole) * m.r + 8 * _chunk(m, n) * m.r
            start += numel
    return total


def galore_engine_ledger(ledger, cfg: Config, lay: ParallelPlan, units: list[Unit],
                         layers: list[int], rank: int, refresh: bool) -> None:
    """Add GaLore's collectives to the engine's predicted `ledger` of global rank `rank`,
    and put its optimizer bytes in place of AdamW's."""
    has_root = lay.pp == 1 or lay.pp_rank_of(rank) in (0, lay.pp - 1)
    galore_engine_records(ledger, cfg, lay, units, layers, has_root, refresh)
    shard_rank = (rank // lay.tp) % lay.dp  # mesh order: pp, dp, tp (no cp, no zero_group)
    state = ledger.model_state_bytes
    state["total"] -= state["optimizer"]
    state["optimizer"] = galore_engine_optimizer_bytes(cfg, lay, units, layers, has_root,
                                                       shard_rank)
    state["total"] += state["optimizer"]
