"""The communication and memory ledger: what one training step really does on this rank.

Every collective fivefold issues goes through `fivefold.comm.collectives`, which appends a
`CommRecord` here: the operation, the mesh axis it ran on, the group size, the dtype, the
logical buffer bytes (`bytes`: the full tensor an all-reduce reduces, the full output of an
all-gather, the full input of a reduce-scatter, this rank's send buffer of an all-to-all) and
the bytes this rank puts on the wire under the ring algorithm (`wire_bytes`: 2(n-1)/n of the
buffer for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all). A `purpose`
tag says why the collective ran ("grads", "params", "grad_norm", "loss", ...).

The model-state bytes per rank (parameters, gradients, optimizer states, fp32 master copies)
are recorded by the engine that owns those tensors, as the sum of their `nbytes`. The planner
predicts both from the configuration alone, and the tests hold prediction against record.

Every record also goes to the ledger's flight recorder (fivefold.comm.flight_recorder), which
keeps the last entries across steps, with the step and micro-batch, for the report a failed
collective writes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from fivefold.comm.flight_recorder import FlightRecorder


@dataclass(frozen=True)
class CommRecord:
    op: str
    mesh_dim: str
    group_size: int
    dtype: str
    bytes: int
    wire_bytes: int
    purpose: str


WIRE_FACTOR = {  # numerator and denominator of the ring volume per rank, n = group size
    "all_reduce": lambda n: (2 * (n - 1), n),
    "all_gather": lambda n: (n - 1, n),
    "reduce_scatter": lambda n: (n - 1, n),
    "all_to_all": lambda n: (n - 1, n),
    "broadcast": lambda n: (1, 1),
    "send": lambda n: (1, 1),
    "recv": lambda n: (0, 1),
}


def wire_bytes(op: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for `op` on a buffer of `nbytes` (ring algorithms), exactly."""
    num, den = WIRE_FACTOR[op](group_size)
    return nbytes * num // den


@dataclass
class Ledger:
    """Collectives of the current step plus the model-state bytes held by this rank."""

    records: list[CommRecord] = field(default_factory=list)
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    recorder: FlightRecorder = field(default_factory=FlightRecorder)

    def record(self, op: str, mesh_dim: str, group_size: int, dtype: str, nbytes: int,
               purpose: str) -> None:
        self.records.append(CommRecord(op, mesh_dim, group_size, dtype, nbytes,
                                       wire_bytes(op, nbytes, group_size), purpose))
        self.recorder.note(op, mesh_dim, nbytes, purpose)

    def start_step(self, step: int | None = None) -> None:
        """Forget the last step's records; the flight recorder keeps its ring, tagged `step`."""
        self.records.clear()
        self.recorder.step, self.recorder.micro_batch = step, None

    def totals(self, key: str = "bytes", by: tuple[str, ...] = ("op", "mesh_dim", "purpose")
               ) -> dict[tuple, int]:
        """Sum of `key` over the step's records, grouped by the named fields."""
        out: dict[tuple, int] = defaultdict(int)
        for rec in self.records:
            out[tuple(getattr(rec, f) for f in by)] += getattr(rec, key)
        return dict(out)

    def summary(self) -> dict:
        """A JSON-ready summary for the metrics file: bytes and wire bytes per op and axis."""
        comm = {}
        for (op, dim), nbytes in self.totals("bytes", ("op", "mesh_dim")).items():
            wire = self.totals("wire_bytes", ("op", "mesh_dim"))[(op, dim)]
            count = sum(1 for r in self.records if (r.op, r.mesh_dim) == (op, dim))
            comm[f"{op}@{dim}"] = {"calls": count, "bytes": nbytes, "wire_bytes": wire}
        return {"comm": comm, "model_state_bytes": dict(self.model_state_bytes)}

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
