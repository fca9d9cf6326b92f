"""A collective as data: chunks moved between ranks in steps, checked, priced and stored.

Torch-free: the planner prices the very schedules the executor (fivefold.comm.executor) runs.

A `Schedule` over n ranks cuts the collective's data into chunks and lists, per step, the
transfers (src, dst, chunk, reduce). Every transfer of a step starts from the state at the
start of the step and lands at its end (the executor waits for the whole step), so a step is
one `batch_isend_irecv` on every rank; a rank may receive several reductions of one chunk in
a step (they add up), but a copied chunk at most once. `programs()` gives the same thing per rank: for each
step the (peer, chunk) pairs it sends and receives. What a chunk is depends on the collective:

- all_gather: `chunks_per_rank` = k parts of every rank's input, chunk c = part c mod k of
  rank c div k's input, at first held by that rank only; at the end every rank holds every
  chunk. Transfers copy.
- reduce_scatter: the input is n*k chunks (k parts of each rank's output shard, in rank
  order); every rank starts with its own addend of every chunk; a `reduce` transfer adds the
  sender's partial sum into the receiver's; at the end rank c div k holds the full sum of c.
- all_reduce: n*k chunks of the buffer; reduce transfers add partial sums, copy transfers
  overwrite with a full sum; at the end every rank holds every chunk's full sum.
- all_to_all: chunk c = src * n + dst is rank src's split for rank dst (k = 1), at first at
  src; at the end at dst. Transfers copy (relays allowed).

`check()` replays a schedule symbolically (which rank holds which addends of which chunk) and
raises `ConfigError` naming the first chunk or rank that is wrong: a send of a chunk the sender
does not hold, an addend counted twice, or a chunk that does not reach every rank it must.
`modeled_time_s(schedule, topology, nbytes)` is the alpha-beta price: per step and link,
latency plus the step's bytes on that link over its bandwidth; a step lasts as long as its
slowest link; steps add up.

File format (JSON), written by `to_json` and read by `load_schedule`:

    {"collective": "all_gather", "ranks": 8, "chunks_per_rank": 2, "name": "...",
     "steps": [[[src, dst, chunk, reduce], ...], ...]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.comm.topology import Topology
from fivefold.config import ConfigError

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    chunk: int
    reduce: bool = False


@dataclass(frozen=True)
class Schedule:
    collective: str
    ranks: int
    chunks_per_rank: int
    steps: tuple[tuple[Transfer, ...], ...]
    name: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def chunks(self) -> int:
        return self.ranks * (self.ranks if self.collective == "all_to_all" else
                             self.chunks_per_rank)

    def programs(self) -> list[list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]]:
        """Per rank, per step: ([(dst, chunk) sent], [(src, chunk) received])."""
        out = [[([], []) for _ in self.steps] for _ in range(self.ranks)]
        for t, step in enumerate(self.steps):
            for x in step:
                out[x.src][t][0].append((x.dst, x.chunk))
                out[x.dst][t][1].append((x.src, x.chunk))
        return out

    def owner(self, chunk: int) -> int:
        """The rank holding `chunk` first (all_gather, all_to_all) or owning its result
        (reduce_scatter)."""
        if self.collective == "all_to_all":
            return chunk // self.ranks
        return chunk // self.chunks_per_rank

    def check(self, key: str = "comm.schedule") -> "Schedule":
        """Replay the schedule; raise ConfigError at the first thing it gets wrong."""
        _check(self, key)
        return self

    def to_json(self) -> str:
        steps = [[[x.src, x.dst, x.chunk, int(x.reduce)] for x in step] for step in self.steps]
        return json.dumps({"collective": self.collective, "ranks": self.ranks,
                           "chunks_per_rank": self.chunks_per_rank, "name": self.name,
                           "meta": self.meta, "steps": steps})


def make(collective: str, ranks: int, chunks_per_rank: int, steps, name: str = "",
         meta: dict | None = None) -> Schedule:
    """A Schedule from lists of transfers (tuples or Transfers), dropping empty steps."""
    norm = tuple(tuple(x if isinstance(x, Transfer) else Transfer(*x) for x in step)
                 for step in steps)
    return Schedule(collective, ranks, chunks_per_rank, tuple(s for s in norm if s), name,
                    meta or {})


def _holders_at_start(s: Schedule) -> list[dict[int, frozenset[int]]]:
    """Per rank: chunk -> the set of ranks whose addend it holds (copy collectives: {owner})."""
    n = s.ranks
    state: list[dict[int, frozenset[int]]] = [dict() for _ in range(n)]
    for c in range(s.chunks):
        if s.collective in ("all_gather", "all_to_all"):
            state[s.owner(c)][c] = frozenset({s.owner(c)})
        else:
            for r in range(n):
                state[r][c] = frozenset({r})
    return state


def _check(s: Schedule, key: str) -> None:
    n, where = s.ranks, f"schedule {s.name or s.collective}"
    if s.collective not in COLLECTIVES:
        raise ConfigError(key, f"{where}: collective {s.collective!r} is not one of "
                               f"{', '.join(COLLECTIVES)}")
    if n < 1 or s.chunks_per_rank < 1:
        raise ConfigError(key, f"{where}: ranks and chunks_per_rank must be at least 1")
    state = _holders_at_start(s)
    full = frozenset(range(n))
    for t, step in enumerate(s.steps):
        updates: list[tuple[int, int, frozenset[int], bool]] = []
        seen = set()
        for x in step:
            if not (0 <= x.src < n and 0 <= x.dst < n) or x.src == x.dst:
                raise ConfigError(key, f"{where}, step {t}: transfer {x.src}->{x.dst} must "
                                       f"join two distinct ranks of 0..{n - 1}")
            if not 0 <= x.chunk < s.chunks:
                raise ConfigError(key, f"{where}, step {t}: chunk {x.chunk} is not one of the "
                                       f"{s.chunks} chunks")
            if (x.dst, x.chunk) in seen and not x.reduce:
                raise ConfigError(key, f"{where}, step {t}: rank {x.dst} receives chunk "
                                       f"{x.chunk} twice in one step")
            seen.add((x.dst, x.chunk))
            have = state[x.src].get(x.chunk)
            if not have:
                raise ConfigError(key, f"{where}, step {t}: rank {x.src} sends chunk {x.chunk}"
                                       " before it holds it")
            copy_op = s.collective in ("all_gather", "all_to_all")
            if x.reduce and copy_op:
                raise ConfigError(key, f"{where}, step {t}: {s.collective} moves copies; "
                                       "a reduce transfer has nothing to add")
            if copy_op and x.chunk in state[x.dst]:
                raise ConfigError(key, f"{where}, step {t}: rank {x.dst} receives chunk "
                                       f"{x.chunk} that it already holds")
            updates.append((x.dst, x.chunk, have, x.reduce))
        for dst, chunk, have, reduce in updates:
            if reduce:
                mine = state[dst].get(chunk, frozenset())
                if mine & have:
                    raise ConfigError(key, f"{where}, step {t}: rank {dst} would add the "
                                           f"addends of ranks {sorted(mine & have)} to chunk "
                                           f"{chunk} twice")
                state[dst][chunk] = mine | have
            else:
                state[dst][chunk] = have
    for c in range(s.chunks):
        if s.collective == "all_to_all":
            need = [c % n]
        elif s.collective == "reduce_scatter":
            need = [s.owner(c)]
        else:
            need = range(n)
        for r in need:
            got = state[r].get(c, frozenset())
            want = frozenset({s.owner(c)}) if s.collective in ("all_gather", "all_to_all") \
                else full
            if got != want:
                missing = sorted(want - got)
                raise ConfigError(key, f"{where} does not cover every chunk: rank {r} ends "
                                       f"without chunk {c}" + (
                                           f" (the addends of ranks {missing} are missing)"
                                           if s.collective in ("reduce_scatter", "all_reduce")
                                           else "") + "; fix or regenerate the schedule")


def load_schedule(path: str | Path, key: str = "comm.schedule") -> Schedule:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"schedule file {str(p)!r} does not exist; write one with "
                               "`python bench/collectives.py --write-schedule`")
    try:
        raw = json.loads(p.read_text())
        steps = [[Transfer(int(a), int(b), int(c), bool(r)) for a, b, c, r in step]
                 for step in raw["steps"]]
        s = make(raw["collective"], int(raw["ranks"]), int(raw.get("chunks_per_rank", 1)),
                 steps, raw.get("name", p.stem), raw.get("meta", {}))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(key, f"{p} is not a schedule file ({type(err).__name__}: {err}); it "
                               "needs collective, ranks, chunks_per_rank and steps = lists of "
                               "[src, dst, chunk, reduce]") from None
    return s.check(key)


# ---------------------------------------------------------------- building schedules

def reversed_as_reduce_scatter(all_gather: Schedule) -> Schedule:
    """The reduce-scatter dual of an all-gather: steps in reverse order, every transfer turned
    round and made a reduction. Each chunk's all-gather spreads along a tree from its owner;
    run backwards, the same tree sums every rank's addend into the owner."""
    assert all_gather.collective == "all_gather"
    steps = [[Transfer(x.dst, x.src, x.chunk, True) for x in step]
             for step in reversed(all_gather.steps)]
    return make("reduce_scatter", all_gather.ranks, all_gather.chunks_per_rank, steps,
                f"{all_gather.name}:reversed", all_gather.meta)


def all_reduce_of(reduce_scatter: Schedule, all_gather: Schedule, name: str = "") -> Schedule:
    """All-reduce = a reduce-scatter then an all-gather on the same chunks (Rabenseifner)."""
    assert reduce_scatter.chunks_per_rank == all_gather.chunks_per_rank
    assert reduce_scatter.ranks == all_gather.ranks
    return make("all_reduce", all_gather.ranks, all_gather.chunks_per_rank,
                list(reduce_scatter.steps) + list(all_gather.steps),
                name or f"{reduce_scatter.name}+{all_gather.name}")


def merge_parallel(*parts: list[list[Transfer]]) -> list[list[Transfer]]:
    """Step-wise union of independent schedules (step t of each runs in step t)."""
    length = max((len(p) for p in parts), default=0)
    return [[x for p in parts if t < len(p) for x in p[t]] for t in range(length)]


# ---------------------------------------------------------------- pricing

def chunk_bytes(schedule: Schedule, nbytes: float) -> float:
    """Bytes of one chunk when the collective moves `nbytes` (the ledger's convention: the
    full output of an all-gather, the full input of a reduce-scatter, the buffer of an
    all-reduce, one rank's send buffer of an all-to-all)."""
    if schedule.collective == "all_to_all":
        return nbytes / schedule.ranks
    return nbytes / schedule.chunks


def step_times_s(schedule: Schedule, topology: Topology, nbytes: float) -> list[float]:
    """Seconds of each step: max over links of latency + bytes on it / its bandwidth."""
    if topology.ranks != schedule.ranks:
        raise ConfigError("comm.topology", f"schedule {schedule.name} is for "
                                           f"{schedule.ranks} ranks, the topology has "
                                           f"{topology.ranks}")
    size = chunk_bytes(schedule, nbytes)
    out = []
    for t, step in enumerate(schedule.steps):
        load: dict[tuple[int, int], int] = {}
        for x in step:
            load[(x.src, x.dst)] = load.get((x.src, x.dst), 0) + 1
        worst = 0.0
        for (s, d), count in load.items():
            link = topology.link(s, d)
            if link is None:
                raise ConfigError("comm.topology", f"schedule {schedule.name}, step {t}, sends "
                                                   f"{s}->{d} but the topology has no such "
                                                   "link; use a schedule made for it")
            worst = max(worst, link.latency_s + count * size / link.bandwidth_Bps)
        out.append(worst)
    return out


def modeled_time_s(schedule: Schedule, topology: Topology, nbytes: float) -> float:
    """The schedule's alpha-beta time on `topology` for a collective of `nbytes`."""
    return sum(step_times_s(schedule, topology, nbytes))


def send_bytes(schedule: Schedule, rank: int, nbytes: float) -> float:
    """Bytes `rank` puts on the wire in the schedule (what its ledger's "send" records sum to,
    for even chunk sizes)."""
    return chunk_bytes(schedule, nbytes) * sum(1 for step in schedule.steps for x in step
                                               if x.src == rank)
