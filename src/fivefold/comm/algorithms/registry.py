"""The fixed collective algorithms by name, each a function that returns a `Schedule`.

`schedule_for(collective, algorithm, ranks, per_node)` picks one by the config's name:
"ring" (ring.py), "tree" (recursive doubling / halving, recursive.py), "hierarchical"
(two-level, hierarchical.py; for all_to_all Tutel's 2D all-to-all, alltoall2d.py).
Synthesized schedules come from fivefold.comm.synthesize.
"""

from __future__ import annotations

from fivefold.comm.algorithms.alltoall2d import hierarchical_all_to_all
from fivefold.comm.algorithms.hierarchical import (hierarchical_all_gather,
                                                   hierarchical_all_reduce,
                                                   hierarchical_reduce_scatter)
from fivefold.comm.algorithms.recursive import (recursive_all_reduce,
                                                recursive_doubling_all_gather,
                                                recursive_halving_reduce_scatter)
from fivefold.comm.algorithms.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from fivefold.comm.schedule import Schedule

# algorithm -> collective -> builder(ranks, per_node)
BUILDERS = {
    "ring": {"all_gather": ring_all_gather, "reduce_scatter": ring_reduce_scatter,
             "all_reduce": ring_all_reduce},
    "tree": {"all_gather": lambda n, g: recursive_doubling_all_gather(n),
             "reduce_scatter": lambda n, g: recursive_halving_reduce_scatter(n),
             "all_reduce": lambda n, g: recursive_all_reduce(n)},
    "hierarchical": {"all_gather": hierarchical_all_gather,
                     "reduce_scatter": hierarchical_reduce_scatter,
                     "all_reduce": hierarchical_all_reduce,
                     "all_to_all": hierarchical_all_to_all},
}


def schedule_for(collective: str, algorithm: str, ranks: int, per_node: int = 1) -> Schedule:
    """The named algorithm's schedule of `collective` over `ranks` (per_node to a node)."""
    try:
        build = BUILDERS[algorithm][collective]
    except KeyError:
        raise ValueError(f"no {algorithm!r} algorithm for {collective}") from None
    return build(ranks, per_node)


def supported(collective: str) -> list[str]:
    return [name for name, table in BUILDERS.items() if collective in table]
