"""Which rank orthogonalizes which matrix under sharded Muon, and what that costs.

Sharded Muon (fivefold.parallel.muon_sharded) gathers every matrix whole to one owner rank,
which runs its Newton-Schulz iteration; the owners are spread so that the iterations divide
over the ranks (the Distributed Muon of "Muon is Scalable", arXiv 2502.16982, Sec. 2.3,
orthogonalizes redundantly on every data-parallel rank; spreading it is the owner-based
variant). The assignment is the longest-processing-time rule: matrices by
falling cost, each to the least loaded rank (the lowest on a tie). Torch-free, so that the
planner (fivefold.planner.muon_cost) assigns exactly as the runtime does.
"""

from __future__ import annotations

from fivefold.muon_flops import newton_schulz_flops

__all__ = ["assign_owners", "newton_schulz_flops"]


def assign_owners(shapes: list[tuple[int, int]], ranks: int,
                  load: list[float] | None = None) -> list[int]:
    """The owner rank of each (rows, cols) matrix among `ranks`; `load` (per rank, updated in
    place) carries the work already assigned by earlier calls, so that several units
    balance together."""
    load = load if load is not None else [0.0] * ranks
    owners = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda k: -newton_schulz_flops(*shapes[k]))
    for k in order:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[k] = rank
        load[rank] += newton_schulz_flops(*shapes[k])
    return owners
