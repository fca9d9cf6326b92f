"""Sharded Muon's collectives, optimizer state and step time, predicted from the config.

fivefold.parallel.muon_sharded runs Muon's step under ZeRO (stages 1-3) or tensor
parallelism: per flat unit that holds a weight matrix, one fp32 all-gather of the Nesterov
update and one fp32 reduce-scatter of the orthogonalized one, each of the unit's padded
size times the tp ranks, over the unit's Muon axis (the ZeRO shard axes with tp innermost;
a block's routed experts under ep > 1: their edp axis), and each matrix orthogonalized by
one owner rank (fivefold.parallel.muon_owners). Its optimizer state is exact per rank: 4
bytes per matrix element of the rank's shard (the momentum) and 8 per other element
(AdamW's moments), so this module lays each unit's parameters out as the runtime's flat
unit does (fivefold.parallel.flat_unit: in the model's parameter order, padded at the end)
and intersects them with the rank's shard. Torch-free, as the planner is.
"""

from __future__ import annotations

from fivefold.config import Config, ModelConfig
from fivefold.models.description import MOE_PARTS, Param, block_parameters
from fivefold.parallel.muon_owners import assign_owners
from fivefold.parallel.plan import MESH_AXES, ParallelPlan
from fivefold.planner.compute import newton_schulz_time
from fivefold.planner.memory import Unit
from fivefold.planner.params import local_shape


def sharded_muon(lay: ParallelPlan) -> bool:
    """Whether the engine steps Muon through fivefold.parallel.muon_sharded."""
    return (lay.optimizer == "muon" and lay.update == "engine"
            and (lay.zero_stage >= 1 or lay.tp > 1))


def muon_axis(lay: ParallelPlan, expert: bool) -> tuple[str, int]:
    """(ledger name, size) of a unit's Muon axis (fivefold.parallel.muon_sharded.muon_axes)."""
    shape = lay.mesh_shape
    if expert:
        return lay.expert_shard_axis if lay.zero_stage >= 1 else ("edp", 1)
    names = [a for a in (*(lay.shard_axes if lay.zero_stage else ()), "tp") if shape[a] > 1]
    size = 1
    for a in names:
        size *= shape[a]
    return "+".join(names), size


def _is_muon(p: Param) -> bool:
    return len(p.shape) in (2, 3)  # a block's matrices and its stacked experts


def block_unit_params(model: ModelConfig, lay: ParallelPlan, layer: int
                      ) -> list[list[tuple[int, bool]]]:
    """(elements on this rank, Muon's) of each parameter of block `layer`'s units, in the
    runtime's order: the dense unit, then (ep > 1) the routed experts' unit."""
    dense, experts = [], []
    for p in block_parameters(model, layer):
        shape = local_shape(model, p, 1 if p.part in MOE_PARTS else lay.tp, lay.ep)
        numel = 1
        for s in shape:
            numel *= s
        (experts if p.part == "experts" and lay.ep > 1 else dense).append((numel, _is_muon(p)))
    return [dense, experts] if experts else [dense]


def block_matrices(model: ModelConfig, lay: ParallelPlan, layer: int
                   ) -> list[list[tuple[int, int]]]:
    """The whole (rows, cols) matrices block `layer`'s units orthogonalize on this rank's
    stage: each 2-D weight, each local expert of a stacked (E, A, B) one."""
    dense, experts = [], []
    for p in block_parameters(model, layer):
        if len(p.shape) == 2:
            dense.append(tuple(p.shape))
        elif len(p.shape) == 3:
            rows = [tuple(p.shape[1:])] * (p.shape[0] // lay.ep)
            (experts if lay.ep > 1 else dense).extend(rows)
    return [dense, experts] if experts else [dense]


def muon_records(cfg: Config, lay: ParallelPlan, units: list[Unit], layers: list[int]
                 ) -> list[tuple]:
    """(op, dim, size, dtype, bytes, purpose) of every sharded-Muon collective of one step
    over the stage's `units` (the root, if held, first: it has no matrix)."""
    out = []
    for u in units[len(units) - _block_unit_count(cfg.model, lay, layers):]:
        dim, size = muon_axis(lay, u.expert)
        if size > 1:
            nbytes = size * u.shard_numel * 4
            out += [("all_gather", dim, size, "float32", nbytes, "muon_gather"),
                    ("reduce_scatter", dim, size, "float32", nbytes, "muon_scatter")]
    return out


def _block_unit_count(model: ModelConfig, lay: ParallelPlan, layers: list[int]) -> int:
    return sum(len(block_unit_params(model, lay, i)) for i in layers)


def _coordinates(lay: ParallelPlan, rank: int) -> dict[str, int]:
    shape, out = lay.mesh_shape, {}
    for axis in reversed(MESH_AXES):
        out[axis] = rank % shape[axis]
        rank //= shape[axis]
    return out


def _flat_index(coords: dict[str, int], shape: dict[str, int], axes) -> int:
    index = 0
    for a in axes:
        index = index * shape[a] + coords[a]
    return index


def with_muon_state(state: dict[str, int], cfg: Config, lay: ParallelPlan, units: list[Unit],
                    layers: list[int], rank: int) -> dict[str, int]:
    """The model-state bytes `state` with sharded Muon's exact optimizer state."""
    optimizer = muon_optimizer_bytes(cfg, lay, units, layers, rank)
    return {**state, "optimizer": optimizer,
            "total": state["total"] - state["optimizer"] + optimizer}


def muon_optimizer_bytes(cfg: Config, lay: ParallelPlan, units: list[Unit], layers: list[int],
                         rank: int) -> int:
    """Sharded Muon's optimizer state on global rank `rank` (module docstring)."""
    coords, shape = _coordinates(lay, rank), lay.mesh_shape
    dense_rank = _flat_index(coords, shape, lay.shard_axes) if lay.zero_stage else 0
    expert_rank = (_flat_index(coords, shape, ("dp_replicate", "dp_shard", "cp")) // lay.ep
                   if lay.zero_stage else 0)
    block_units = [params for i in layers for params in block_unit_params(cfg.model, lay, i)]
    root_units = units[:len(units) - len(block_units)]
    total = 0
    for u in root_units:  # embedding, final norm, head: AdamW
        total += 8 * max(0, min(u.shard_numel, u.numel - dense_rank * u.shard_numel))
    for u, params in zip(units[len(root_units):], block_units):
        lo = (expert_rank if u.expert else dense_rank) * u.shard_numel
        hi, offset = lo + u.shard_numel, 0
        for numel, muon in params:
            inside = max(0, min(offset + numel, hi) - max(offset, lo))
            total += (4 if muon else 8) * inside
            offset += numel
    return total


def muon_step_s(sim, rank: int) -> float:
    """Muon's part of pipeline rank `rank`'s optimizer step on the simulator `sim`
    (fivefold.planner.step.LayoutStep): the Newton-Schulz iterations of the busiest owner and,
    sharded, each unit's gather and scatter over its Muon axis."""
    lay, model = sim.lay, sim.model
    units = [block_matrices(model, lay, i) for i in sim.rank_layers(rank)]
    if not sharded_muon(lay):  # every rank orthogonalizes every matrix it holds
        return newton_schulz_time([m for unit in units for ms in unit for m in ms], sim.prof)
    owned: dict[tuple[bool, int], list[tuple[int, int]]] = {}
    loads: dict[bool, list[float]] = {}
    for block in units:
        for k, matrices in enumerate(block):
            expert = k == 1
            size = muon_axis(lay, expert)[1]
            owners = assign_owners(matrices, size, loads.setdefault(expert, [0.0] * size))
            for m, owner in zip(matrices, owners):
                owned.setdefault((expert, owner), []).append(m)
    busiest = max((newton_schulz_time(ms, sim.prof) for ms in owned.values()), default=0.0)
    comm = 0.0
    for u in sim.rank_units(rank):
        size = muon_axis(lay, u.expert)[1]
        if (u.matrices or u.expert) and size > 1:
            group = sim.expert_shard_group if u.expert else type(sim.tp_group).strided(
                size, 1, sim.cfg.cluster.gpus_per_node)
            nbytes = size * u.shard_numel * 4
            comm += (sim._coll("all_gather", nbytes, group)
                     + sim._coll("reduce_scatter", nbytes, group))
    return busiest + comm
