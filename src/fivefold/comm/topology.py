"""A topology as data: ranks, and the directed links between them with bandwidth and latency.

Torch-free (the planner prices schedules on it). Rank r of an n-rank topology is device
`r mod per_node` of node `r div per_node`. Every link is directed and independent: a link
carries its own bytes at its own bandwidth, whatever else is in flight (an alpha-beta model
per link). `two_level` builds the usual cluster: every pair inside a node joined (NVLink /
NVSwitch, one link per ordered pair), and across nodes one link per device to the device of
the same index on the next node ("rail" links; with two nodes that is one link each way),
which gives each device one NIC's worth of egress and ingress.

A topology file (TOML or JSON) holds the same description:

    nodes = 2
    devices_per_node = 4
    [intra]                   # links inside a node: "all" pairs (default), "ring" or "none"
    bandwidth_GBps = 50.0
    latency_us = 1.0
    [inter]                   # across nodes: "rail_ring" (default), "rail_all" or "none"
    bandwidth_GBps = 12.5
    latency_us = 5.0
    [[links]]                 # optional: set (or add, or with bandwidth_GBps = 0 remove) one
    src = 1                   # directed link; here a slow inter-node link
    dst = 3
    bandwidth_GBps = 4.0

Any user error (a missing key, a link to a rank that does not exist, links that leave some
rank unreachable) raises `ConfigError` naming the file and the fix.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import ConfigError


@dataclass(frozen=True)
class Link:
    src: int
    dst: int
    bandwidth_Bps: float
    latency_s: float


@dataclass(frozen=True)
class Topology:
    """`ranks` = nodes x per_node ranks and the directed links between them."""

    nodes: int
    per_node: int
    links: tuple[Link, ...]
    name: str = ""

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    def link(self, src: int, dst: int) -> Link | None:
        return self._by_pair().get((src, dst))

    def _by_pair(self) -> dict[tuple[int, int], Link]:
        cache = self.__dict__.get("_pairs")
        if cache is None:
            cache = {(l.src, l.dst): l for l in self.links}
            object.__setattr__(self, "_pairs", cache)
        return cache

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def unreachable(self, allowed: set[tuple[int, int]] | None = None) -> tuple[int, int] | None:
        """A pair (src, dst) with no directed path from src to dst over the links (only those
        in `allowed`, if given), or None when every rank reaches every other."""
        pairs = [p for p in self._by_pair() if allowed is None or p in allowed]
        out: dict[int, list[int]] = {r: [] for r in range(self.ranks)}
        for s, d in pairs:
            out[s].append(d)
        for src in range(self.ranks):
            seen, stack = {src}, [src]
            while stack:
                for nxt in out[stack.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            missing = [d for d in range(self.ranks) if d not in seen]
            if missing:
                return src, missing[0]
        return None

    def check_connected(self, key: str = "comm.topology") -> None:
        bad = self.unreachable()
        if bad:
            raise ConfigError(key, f"the links of topology {self.name or '(unnamed)'} do not "
                                   f"connect all {self.ranks} ranks: rank {bad[1]} cannot be "
                                   f"reached from rank {bad[0]}; add links (e.g. [inter] links "
                                   "= \"rail_ring\") so every rank reaches every other")

    def permuted(self, perm: list[int]) -> "Topology":
        """The topology with rank r renamed perm[r] (to check a symmetry)."""
        return Topology(self.nodes, self.per_node,
                        tuple(Link(perm[l.src], perm[l.dst], l.bandwidth_Bps, l.latency_s)
                              for l in self.links), self.name)


def two_level(nodes: int, per_node: int, intra_GBps: float, inter_GBps: float,
              latency_intra_us: float = 1.0, latency_inter_us: float = 5.0,
              intra: str = "all", inter: str = "rail_ring",
              overrides: tuple[tuple[int, int, float], ...] = (), name: str = "") -> Topology:
    """Nodes of `per_node` devices; `overrides` = (src, dst, GB/s) set single links (0 removes)."""
    links: dict[tuple[int, int], Link] = {}
    lat_i, lat_e = latency_intra_us * 1e-6, latency_inter_us * 1e-6
    for node in range(nodes):
        base = node * per_node
        for a in range(per_node):
            peers = {"all": [b for b in range(per_node) if b != a],
                     "ring": [(a + 1) % per_node, (a - 1) % per_node],
                     "none": []}[intra]
            for b in peers:
                if b != a:
                    links[(base + a, base + b)] = Link(base + a, base + b, intra_GBps * 1e9, lat_i)
    for node in range(nodes):
        others = {"rail_ring": [(node + 1) % nodes, (node - 1) % nodes],
                  "rail_all": list(range(nodes)), "none": []}[inter]
        if inter == "rail_ring" and nodes > 2:
            others = [(node + 1) % nodes]  # one egress and one ingress per device
        for other in others:
            if other == node:
                continue
            for local in range(per_node):
                s, d = node * per_node + local, other * per_node + local
                links[(s, d)] = Link(s, d, inter_GBps * 1e9, lat_e)
    for s, d, gbps in overrides:
        old = links.get((s, d))
        if gbps == 0:
            links.pop((s, d), None)
        else:
            lat = old.latency_s if old else (lat_i if s // per_node == d // per_node else lat_e)
            links[(s, d)] = Link(s, d, gbps * 1e9, lat)
    return Topology(nodes, per_node, tuple(links[p] for p in sorted(links)), name)


INTRA_KINDS = ("all", "ring", "none")
INTER_KINDS = ("rail_ring", "rail_all", "none")


def read_table(path: str | Path, key: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"file {str(p)!r} does not exist; give a TOML or JSON file")
    try:
        text = p.read_text()
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"{p} does not parse: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{p} must hold a table, not a {type(raw).__name__}")
    return raw


def _number(raw: dict, name: str, where: str, key: str, default=None, positive=True) -> float:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(key, f"{where} needs `{name}`; e.g. {name} = 10")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            positive and not value > 0) or value < 0:
        raise ConfigError(key, f"{where}: `{name}` must be a {'positive' if positive else ''}"
                               f" number, got {value!r}")
    return value


def topology_from_dict(raw: dict, key: str = "comm.topology", name: str = "") -> Topology:
    known = {"nodes", "devices_per_node", "intra", "inter", "links", "name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(key, f"unknown topology key `{unknown[0]}`; known keys are "
                               f"{', '.join(sorted(known))}")
    nodes = int(_number(raw, "nodes", "the topology", key))
    per_node = int(_number(raw, "devices_per_node", "the topology", key))
    tables = {}
    for level, kinds, default in (("intra", INTRA_KINDS, "all"), ("inter", INTER_KINDS,
                                                                  "rail_ring")):
        table = raw.get(level, {})
        if not isinstance(table, dict):
            raise ConfigError(key, f"[{level}] must be a table of bandwidth_GBps, latency_us, "
                                   "links")
        kind = table.get("links", default)
        if kind not in kinds:
            raise ConfigError(key, f"[{level}] links = {kind!r} is not one of "
                                   f"{', '.join(map(repr, kinds))}")
        needed = kind != "none" and (level == "intra" and per_node > 1
                                     or level == "inter" and nodes > 1)
        bw = _number(table, "bandwidth_GBps", f"[{level}]", key, None if needed else 1.0)
        lat = _number(table, "latency_us", f"[{level}]", key, 1.0 if level == "intra" else 5.0,
                      positive=False)
        tables[level] = (bw, lat, kind)
    overrides = []
    n = nodes * per_node
    for i, link in enumerate(raw.get("links", [])):
        if not isinstance(link, dict) or not {"src", "dst", "bandwidth_GBps"} <= set(link):
            raise ConfigError(key, f"links[{i}] must be a table with src, dst, bandwidth_GBps")
        s, d = link["src"], link["dst"]
        if not all(isinstance(v, int) and 0 <= v < n for v in (s, d)) or s == d:
            raise ConfigError(key, f"links[{i}]: src {s!r} and dst {d!r} must be two distinct "
                                   f"ranks in 0..{n - 1}")
        overrides.append((s, d, _number(link, "bandwidth_GBps", f"links[{i}]", key,
                                        positive=False)))
    (bw_i, lat_i, intra), (bw_e, lat_e, inter) = tables["intra"], tables["inter"]
    return two_level(nodes, per_node, bw_i, bw_e, lat_i, lat_e, intra, inter, tuple(overrides),
                     raw.get("name", name))


def load_topology(path: str | Path, key: str = "comm.topology") -> Topology:
    """Read a topology file; raise ConfigError if it is malformed or not connected."""
    topo = topology_from_dict(read_table(path, key), key, Path(path).stem)
    topo.check_connected(key)
    return topo
