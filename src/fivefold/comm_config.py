"""The `[comm]` section of a config: which algorithm runs each collective, and the topology,
sketch or schedule files a synthesized one needs (docs/collectives.md). fivefold.config
assembles the sections, and fivefold.validate.validate_comm checks these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class CommConfig:
    algorithm: str | dict[str, str] = _doc(
        'collective algorithm: "builtin" (torch.distributed\'s) | "ring" | "tree" (recursive '
        'doubling/halving) | "hierarchical" (intra-node, then inter-node; 2D for all_to_all) | '
        '"synthesized" (from comm.topology and comm.sketch, or comm.schedule), for every '
        'collective, or a table by kind, e.g. {all_gather = "synthesized", all_reduce = '
        '"ring"} (docs/collectives.md)', "builtin")
    topology: str | None = _doc("topology file (TOML/JSON: nodes, devices, links with "
                                "bandwidth and latency) of the ranks a synthesized collective "
                                "runs on", None)
    sketch: str | None = _doc("synthesis sketch file (allowed links, symmetry, chunks per rank, "
                              "steps); default: all links, no symmetry, 1 chunk", None)
    schedule: str | None = _doc("a schedule file (JSON, e.g. written by bench/collectives.py) "
                                "that \"synthesized\" runs instead of synthesizing", None)
