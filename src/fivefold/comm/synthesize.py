"""Collective synthesis: the all-gather schedule of a topology as a mixed-integer program
(TACCL, Shah et al., arXiv 2111.04867, Sec. 4-5: a communication sketch narrows the search,
a MILP routes and schedules chunks; here one MILP does both, in TACCL's step-synchronous
"rounds" form, solved by scipy.optimize.milp with HiGHS).

Sketch (TACCL Sec. 4): which links the algorithm may use (default all), the symmetry the
schedule must have (rank permutations; "node_rotation" maps device j of node i to device j of
node i+1, "device_rotation" device j to device j+1 in every node), the number of chunks each
rank's shard is cut into (k), the number of steps T, and the message size the schedule is
optimised for. A sketch file (TOML or JSON):

    chunks_per_rank = 2
    steps = 4
    symmetry = ["node_rotation", "device_rotation"]   # or lists of ranks: [[1, 0, 3, 2]]
    links = "all"               # or "intra" / "inter" to forbid one level, or [[src, dst], ...]
    size_MiB = 64
    time_limit_s = 50

Formulation. Chunk c (k per rank, c div k its owner), allowed link e = (u, v), step t = 1..T:

    x[c,e,t] in {0,1}   c crosses e in step t          h[c,v,t] in [0,1]  v holds c after t
    y[e,t]   in [0,1]   e is used in step t            tau[t] >= 0        length of step t
    h[c,v,0] = [v owns c];   x[c,(u,v),t] <= h[c,u,t-1];
    h[c,v,t] <= h[c,v,t-1] + sum_u x[c,(u,v),t];       h[c,v,T] = 1;
    y[e,t] >= x[c,e,t];      tau[t] >= alpha_e y[e,t] + (chunk bytes / B_e) sum_c x[c,e,t]
    minimise sum_t tau[t]

which is exactly `fivefold.comm.schedule.modeled_time_s` of the schedule read off x, so the
objective is the time the planner prices. Symmetry is imposed by giving every variable and
constraint of one orbit under the sketch's permutation group one column and one row (TACCL
Sec. 4.2), which divides the problem by the group's order. The solution is cleaned (a chunk
is kept only on its first arrival at a rank) and checked before it is returned.

The reduce-scatter is the dual of the all-gather on the topology with every link turned
round, reversed in time (fivefold.comm.schedule.reversed_as_reduce_scatter); the all-reduce
is the two in sequence. Bad input fails before the solver runs, naming the sketch key: links
that leave a rank unreachable, fewer steps than a chunk needs hops, a "symmetry" that is not
one of the topology.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from fivefold.comm.schedule import (Schedule, Transfer, all_reduce_of, make,
                                    reversed_as_reduce_scatter)
from fivefold.comm.topology import Link, Topology, read_table
from fivefold.config import ConfigError

KEY = "comm.sketch"


@dataclass(frozen=True)
class Sketch:
    chunks_per_rank: int = 1
    steps: int | None = None  # default: the hop diameter + chunks_per_rank
    symmetry: tuple = ()
    links: object = "all"
    size_MiB: float = 64.0
    time_limit_s: float = 50.0
    mip_rel_gap: float = 1e-3
    extra: dict = field(default_factory=dict, compare=False)


def load_sketch(path: str | Path) -> Sketch:
    raw = read_table(path, KEY)
    known = {f for f in Sketch.__dataclass_fields__ if f != "extra"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(KEY, f"unknown sketch key `{unknown[0]}`; known keys are "
                               f"{', '.join(sorted(known))}")
    for name in ("chunks_per_rank", "steps"):
        if name in raw and (not isinstance(raw[name], int) or raw[name] < 1):
            raise ConfigError(KEY, f"`{name}` must be a whole number >= 1, got {raw[name]!r}")
    sym = raw.get("symmetry", [])
    raw["symmetry"] = tuple(tuple(s) if isinstance(s, list) else s for s in sym)
    return Sketch(**raw)


def _allowed_links(topology: Topology, sketch: Sketch) -> list[Link]:
    spec = sketch.links
    if spec == "all":
        return list(topology.links)
    if spec in ("intra", "inter"):
        same = spec == "intra"
        return [l for l in topology.links
                if (topology.node_of(l.src) == topology.node_of(l.dst)) == same]
    if isinstance(spec, (list, tuple)):
        out = []
        for pair in spec:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise ConfigError(KEY, f"links entry {pair!r} must be [src, dst]")
            link = topology.link(*pair)
            if link is None:
                raise ConfigError(KEY, f"links entry {list(pair)} is not a link of the "
                                       "topology; allow only links it has")
            out.append(link)
        return out
    raise ConfigError(KEY, f"links = {spec!r}: use \"all\", \"intra\", \"inter\" or a list of "
                           "[src, dst] pairs")


def _permutations(topology: Topology, sketch: Sketch) -> list[list[int]]:
    n, g = topology.ranks, topology.per_node
    gens = []
    for item in sketch.symmetry:
        if item == "node_rotation":
            gens.append([(r + g) % n for r in range(n)])
        elif item == "device_rotation":
            gens.append([(r // g) * g + (r % g + 1) % g for r in range(n)])
        elif isinstance(item, (list, tuple)) and sorted(item) == list(range(n)):
            gens.append(list(item))
        else:
            raise ConfigError(KEY, f"symmetry {item!r} is neither \"node_rotation\", "
                                   f"\"device_rotation\" nor a permutation of 0..{n - 1}")
    group = {tuple(range(n))}
    frontier = list(group)
    while frontier:  # closure of the generators
        new = []
        for p in frontier:
            for q in gens:
                comp = tuple(q[p[r]] for r in range(n))
                if comp not in group:
                    group.add(comp)
                    new.append(comp)
        frontier = new
    return [list(p) for p in sorted(group)]


def _check_symmetry(links: list[Link], perms: list[list[int]]) -> None:
    by_pair = {(l.src, l.dst): l for l in links}
    for perm in perms:
        for l in links:
            img = by_pair.get((perm[l.src], perm[l.dst]))
            if img is None or (img.bandwidth_Bps, img.latency_s) != (l.bandwidth_Bps,
                                                                     l.latency_s):
                raise ConfigError(KEY, f"the symmetry {perm} is not one of the allowed links: "
                                       f"link {l.src}->{l.dst} ({l.bandwidth_Bps / 1e9:g} GB/s) "
                                       f"maps to {perm[l.src]}->{perm[l.dst]}, which "
                                       + ("is not allowed" if img is None else
                                          f"runs at {img.bandwidth_Bps / 1e9:g} GB/s")
                                       + "; drop that symmetry from the sketch")


def _hops(n: int, links: list[Link]) -> tuple[int, tuple[int, int] | None]:
    """The hop diameter of the allowed links, and an unreachable pair if any."""
    out: dict[int, list[int]] = {r: [] for r in range(n)}
    for l in links:
        out[l.src].append(l.dst)
    worst = 0
    for s in range(n):
        dist = {s: 0}
        queue = deque([s])
        while queue:
            v = queue.popleft()
            for w in out[v]:
                if w not in dist:
                    dist[w] = dist[v] + 1
                    queue.append(w)
        for d in range(n):
            if d not in dist:
                return worst, (s, d)
        worst = max(worst, max(dist.values()))
    return worst, None


def synthesize_all_gather(topology: Topology, sketch: Sketch = Sketch()) -> Schedule:
    """The all-gather schedule of least modeled time for the sketch (see the module doc)."""
    start = time.perf_counter()
    n, k = topology.ranks, sketch.chunks_per_rank
    links = _allowed_links(topology, sketch)
    diameter, cut = _hops(n, links)
    if cut:
        raise ConfigError(KEY, f"the sketch's links leave rank {cut[1]} unreachable from rank "
                               f"{cut[0]}: no all-gather exists; allow more links (links = "
                               "\"all\")")
    steps = sketch.steps or diameter + k
    if steps < diameter:
        raise ConfigError(KEY, f"steps = {steps} is too few: over the allowed links some chunk "
                               f"needs {diameter} hops to reach every rank; set steps >= "
                               f"{diameter} or allow more links")
    perms = _permutations(topology, sketch)
    _check_symmetry(links, perms)
    if n == 1:
        return make("all_gather", 1, k, [], "synthesized")
    C, E, T = n * k, len(links), steps
    eidx = {(l.src, l.dst): e for e, l in enumerate(links)}
    perm_c = [[p[c // k] * k + c % k for c in range(C)] for p in perms]
    perm_e = [[eidx[(p[l.src], p[l.dst])] for l in links] for p in perms]

    cols: dict[tuple, int] = {}

    def col(key: tuple) -> int:
        """One column per orbit: the key's least image under the group."""
        kind = key[0]
        if kind == "x":
            _, c, e, t = key
            rep = min((pc[c], pe[e]) for pc, pe in zip(perm_c, perm_e)) + (t,)
        elif kind == "h":
            _, c, v, t = key
            rep = min((pc[c], p[v]) for pc, p in zip(perm_c, perms)) + (t,)
        elif kind == "y":
            _, e, t = key
            rep = (min(pe[e] for pe in perm_e), t)
        else:
            rep = key[1:]
        full = (kind,) + rep
        if full not in cols:
            cols[full] = len(cols)
        return cols[full]

    rows: list[tuple[dict[int, float], float, float]] = []  # (coefficients, lower, upper)
    done: set[tuple] = set()

    def add(terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        coef: dict[int, float] = {}
        for j, v in terms:
            coef[j] = coef.get(j, 0.0) + v
        key = (tuple(sorted(coef.items())), lo, hi)
        if key not in done:
            done.add(key)
            rows.append((coef, lo, hi))

    size = sketch.size_MiB * 2 ** 20 / C
    into = {v: [e for e, l in enumerate(links) if l.dst == v] for v in range(n)}

    def held(c: int, v: int, t: int):
        """h[c,v,t] as a column, or the constant 0/1 at t = 0."""
        if t == 0:
            return 1.0 if c // k == v else 0.0
        return col(("h", c, v, t))

    def term(value, sign: float, terms: list, const: list) -> None:
        if isinstance(value, float):
            const[0] += sign * value
        else:
            terms.append((value, sign))

    rep_cv = {min((pc[c], p[v]) for pc, p in zip(perm_c, perms))
              for c in range(C) for v in range(n)}
    rep_ce = {min((pc[c], pe[e]) for pc, pe in zip(perm_c, perm_e))
              for c in range(C) for e in range(E)}
    rep_e = {min(pe[e] for pe in perm_e) for e in range(E)}
    for t in range(1, T + 1):
        for c, e in sorted(rep_ce):
            u = links[e].src
            x = col(("x", c, e, t))
            terms, const = [(x, 1.0)], [0.0]  # x - h[c,u,t-1] <= 0
            term(held(c, u, t - 1), -1.0, terms, const)
            add(terms, -np.inf, -const[0])
            add([(col(("y", e, t)), 1.0), (x, -1.0)], 0.0, np.inf)  # y >= x
        for c, v in sorted(rep_cv):
            if c // k == v:
                continue  # the owner holds its chunk throughout
            terms, const = [(col(("h", c, v, t)), 1.0)], [0.0]  # h_t - h_{t-1} - sum x <= 0
            term(held(c, v, t - 1), -1.0, terms, const)
            terms += [(col(("x", c, e, t)), -1.0) for e in into[v]]
            add(terms, -np.inf, -const[0])
        for e in sorted(rep_e):  # tau_t >= alpha y + beta * size * sum_c x
            l = links[e]
            terms = [(col(("tau", t)), 1.0), (col(("y", e, t)), -l.latency_s)]
            terms += [(col(("x", c, e, t)), -size / l.bandwidth_Bps) for c in range(C)]
            add(terms, 0.0, np.inf)
    for c, v in sorted(rep_cv):
        if c // k != v:
            add([(col(("h", c, v, T)), 1.0)], 1.0, 1.0)  # everything arrives
    m = len(cols)
    cost = np.zeros(m)
    integrality = np.zeros(m)
    lower, upper = np.zeros(m), np.ones(m)
    for key, j in cols.items():
        if key[0] == "tau":
            cost[j] = 1.0
            upper[j] = np.inf
        elif key[0] == "x":
            integrality[j] = 1
    r, cidx, vals = [], [], []
    lo, hi = [], []
    for i, (coef, a, b) in enumerate(rows):
        for j, v in coef.items():
            r.append(i), cidx.append(j), vals.append(v)
        lo.append(a), hi.append(b)
    A = coo_matrix((vals, (r, cidx)), shape=(len(rows), m)).tocsr()
    res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(lower, upper),
               options={"time_limit": sketch.time_limit_s, "mip_rel_gap": sketch.mip_rel_gap})
    if res.x is None:
        raise ConfigError(KEY, f"the synthesis found no schedule ({res.message.strip()}); "
                               "allow more steps or links, or a longer time_limit_s")
    schedule = _read_schedule(res.x, cols, perm_c, perm_e, links, n, k, T)
    schedule.meta.update(synthesis_s=time.perf_counter() - start, objective_s=float(res.fun),
                         mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0),
                         optimal=bool(res.status == 0), steps_allowed=T,
                         symmetry_order=len(perms), size_MiB=sketch.size_MiB,
                         variables=m, constraints=len(rows))
    return schedule


def _read_schedule(x: np.ndarray, cols: dict, perm_c, perm_e, links, n, k, T) -> Schedule:
    """Expand the orbit columns back to transfers; keep each chunk's first arrival only."""
    chosen = {key for key, j in cols.items() if key[0] == "x" and x[j] > 0.5}
    holds = {(c, c // k): 0 for c in range(n * k)}
    steps = []
    for t in range(1, T + 1):
        step = []
        for c in range(n * k):
            for e, l in enumerate(links):
                rep = min((pc[c], pe[e]) for pc, pe in zip(perm_c, perm_e)) + (t,)
                if ("x",) + rep not in chosen:
                    continue
                if holds.get((c, l.src), T + 1) < t and (c, l.dst) not in holds:
                    step.append(Transfer(l.src, l.dst, c))
                    holds[(c, l.dst)] = t
        steps.append(step)
    return make("all_gather", n, k, steps, "synthesized").check(KEY)


def transposed(topology: Topology) -> Topology:
    return Topology(topology.nodes, topology.per_node,
                    tuple(Link(l.dst, l.src, l.bandwidth_Bps, l.latency_s)
                          for l in topology.links), topology.name)


def _transposed_sketch(sketch: Sketch) -> Sketch:
    if isinstance(sketch.links, (list, tuple)):
        return Sketch(**{**sketch.__dict__, "links": [[d, s] for s, d in sketch.links]})
    return sketch


def synthesize(collective: str, topology: Topology, sketch: Sketch = Sketch()) -> Schedule:
    """A synthesized schedule of `collective` (all_gather, reduce_scatter or all_reduce)."""
    if collective == "all_gather":
        return synthesize_all_gather(topology, sketch)
    dual = synthesize_all_gather(transposed(topology), _transposed_sketch(sketch))
    rs = reversed_as_reduce_scatter(dual)
    rs = Schedule(rs.collective, rs.ranks, rs.chunks_per_rank, rs.steps, "synthesized",
                  dual.meta)
    if collective == "reduce_scatter":
        return rs.check(KEY)
    if collective == "all_reduce":
        return all_reduce_of(rs, synthesize_all_gather(topology, sketch), "synthesized").check(KEY)
    raise ConfigError("comm.algorithm", f"synthesis covers all_gather, reduce_scatter and "
                                        f"all_reduce, not {collective}; use \"builtin\" or "
                                        "\"hierarchical\" for it")
