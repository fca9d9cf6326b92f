"""Which algorithm each collective runs (the `[comm]` config section), and its price.

Torch-free: the runtime asks `CommAlgorithms.schedule(collective, ranks, per_node)` for the
schedule an axis runs (None: the builtin torch.distributed collective), and the planner asks
`two_level_time(...)` for the modeled time of that same schedule on its two-level cluster.

- "builtin": torch.distributed's own collective (NCCL / gloo choose the algorithm).
- "ring", "tree", "hierarchical": fivefold.comm.algorithms (all_to_all: "hierarchical" only).
- "synthesized": the schedule of `comm.schedule` if given (a file from
  `bench/collectives.py --write-schedule`), else synthesized from `comm.topology` and
  `comm.sketch` (fivefold.comm.synthesize). Synthesis is deterministic for a given problem
  (HiGHS runs serially), so every rank derives the same schedule; a schedule file avoids
  the solve on every rank and pins the schedule when the time limit could bind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.comm.schedule import Schedule, load_schedule, modeled_time_s
from fivefold.comm.topology import Topology, load_topology, two_level
from fivefold.config import ConfigError

ALGORITHMS = ("builtin", "ring", "tree", "hierarchical", "synthesized")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
ALL_TO_ALL_ALGORITHMS = ("builtin", "hierarchical")


def algorithm_table(value: str | dict, key: str = "comm.algorithm") -> dict[str, str]:
    """`comm.algorithm` as a full table collective -> algorithm (checked)."""
    if isinstance(value, str):
        table = {kind: value for kind in KINDS}
        if value in ("ring", "tree", "synthesized"):
            table["all_to_all"] = "builtin"  # one value for all: all-to-all keeps the builtin
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", f"not a collective; the table's keys are "
                                                     f"{', '.join(KINDS)}")
        table = {kind: value.get(kind, "builtin") for kind in KINDS}
    else:
        raise ConfigError(key, f"expected a name or a table by collective, got {value!r}; "
                               f"write e.g. {key} = \"ring\" or {key} = "
                               "{all_gather = \"synthesized\"}")
    for kind, name in table.items():
        where = key if isinstance(value, str) else f"{key}.{kind}"
        allowed = ALL_TO_ALL_ALGORITHMS if kind == "all_to_all" else ALGORITHMS
        if name not in allowed:
            raise ConfigError(where, f"{name!r} is not one of {', '.join(map(repr, allowed))}"
                                     f" for {kind}")
    return table


@dataclass
class CommAlgorithms:
    """The algorithm of every collective kind, and what synthesis needs."""

    table: dict[str, str]
    topology: Topology | None = None
    sketch: object = None  # fivefold.comm.synthesize.Sketch (scipy imported only to synthesize)
    schedule_file: Schedule | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg) -> "CommAlgorithms | None":
        """From `cfg.comm`; None when every collective is builtin (the runtime's default
        path is then exactly the builtin one)."""
        comm = cfg.comm
        table = algorithm_table(comm.algorithm)
        if all(v == "builtin" for v in table.values()):
            return None
        topology = load_topology(comm.topology) if comm.topology else None
        sketch = None
        if comm.sketch:
            from fivefold.comm.synthesize import load_sketch
            sketch = load_sketch(comm.sketch)
        schedule = load_schedule(comm.schedule) if comm.schedule else None
        if "synthesized" in table.values() and schedule is None and topology is None:
            raise ConfigError("comm.algorithm", "\"synthesized\" needs comm.topology (and "
                                                "optionally comm.sketch) or a comm.schedule "
                                                "file; set one, or choose \"hierarchical\"")
        return cls(table, topology, sketch, schedule)

    def algorithm(self, collective: str) -> str:
        return self.table.get(collective, "builtin")

    def schedule(self, collective: str, ranks: int, per_node: int = 1) -> Schedule | None:
        """The schedule `collective` runs over `ranks` ranks (per_node to a node), or None
        for the builtin collective."""
        name = self.algorithm(collective)
        if name == "builtin" or ranks <= 1:
            return None
        key = (collective, name, ranks, per_node)
        if key not in self._cache:
            self._cache[key] = self._build(collective, name, ranks, per_node)
        return self._cache[key]

    def _build(self, collective: str, name: str, ranks: int, per_node: int) -> Schedule:
        if name != "synthesized":
            from fivefold.comm.algorithms.registry import schedule_for
            return schedule_for(collective, name, ranks, per_node if ranks % per_node == 0
                                else 1)
        f = self.schedule_file
        if f is not None and f.collective == collective:
            if f.ranks != ranks:
                raise ConfigError("comm.schedule", f"the schedule is for {f.ranks} ranks but "
                                                   f"{collective} runs over {ranks}; write one "
                                                   f"for {ranks} ranks")
            return f
        if self.topology is None:
            raise ConfigError("comm.topology", f"{collective} is \"synthesized\" but "
                                               "comm.schedule holds another collective; give a "
                                               "comm.topology to synthesize from")
        if self.topology.ranks != ranks:
            raise ConfigError("comm.topology", f"the topology has {self.topology.ranks} ranks "
                                               f"but {collective} runs over {ranks}; describe "
                                               "the ranks of the group it runs on")
        from fivefold.comm.synthesize import Sketch, synthesize
        return synthesize(collective, self.topology, self.sketch or Sketch())


# ---------------------------------------------------------------- the planner's price

@lru_cache(maxsize=256)
def _priced_schedule(collective: str, algorithm: str, ranks: int, per_node: int,
                     topology: Topology) -> Schedule:
    return CommAlgorithms({collective: algorithm}, topology).schedule(collective, ranks,
                                                                      per_node)


def two_level_time(collective: str, algorithm: str, nbytes: float, ranks: int, per_node: int,
                   intra_Bps: float, inter_Bps: float, latency_intra_s: float,
                   latency_inter_s: float) -> float:
    """Modeled seconds of `algorithm`'s schedule for `collective` (ledger bytes `nbytes`) on
    nodes of `per_node` ranks: every pair in a node linked at intra_Bps, rail links across
    nodes at inter_Bps (fivefold.comm.topology.two_level, every rail pair of nodes linked, so
    recursive doubling finds its partners). The same schedule the runtime
    would run; "synthesized" synthesizes for this topology with the default sketch."""
    per_node = per_node if ranks % per_node == 0 else 1
    topo = two_level(ranks // per_node, per_node, intra_Bps / 1e9, inter_Bps / 1e9,
                     latency_intra_s * 1e6, latency_inter_s * 1e6, inter="rail_all")
    return modeled_time_s(_priced_schedule(collective, algorithm, ranks, per_node, topo), topo,
                          nbytes)


def ranks_per_node(members: list[int], gpus_per_node: int) -> int:
    """Ranks per node of a group whose global ranks in axis order are `members` (node =
    rank div gpus_per_node), when the group fills whole nodes in blocks of equal size;
    otherwise 1 (the hierarchical algorithms then treat every rank as its own node)."""
    nodes = [m // gpus_per_node for m in members]
    per_node = nodes.count(nodes[0])
    if len(nodes) % per_node:
        return 1
    blocks = [nodes[i:i + per_node] for i in range(0, len(nodes), per_node)]
    if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        return 1
    return per_node
