"""The flight recorder: each rank's last collectives, written out when one of them fails.

A hung collective shows on every rank as a bare backend timeout (gloo raises after the
process group's timeout, `train.timeout_s`), which says neither which collective nor who is
missing. So every ledger entry (fivefold.comm.ledger) is also noted here, in a ring buffer of
the last `capacity`: its number on its axis (`seq`, counted from 1 on this rank), the
operation, the axis, the bytes, the purpose, the step and the micro-batch where the trainer
set them. When a collective raises (fivefold.comm.collectives), `failed`:

1. writes `directory/rank_R.json`: the failed entry, the backend's error, this rank's
   recorder, how many collectives it issued per axis, and the Python stack of every thread;
2. waits up to `grace_s` seconds for the files of the other ranks of that axis's group (a
   shared run directory), reading only files written since this recorder was made;
3. returns a `CollectiveError` naming the operation, the axis and the ranks that never
   reached it: those whose file shows fewer collectives on that axis than this rank's `seq`,
   and those that wrote no file (dead, or stuck outside a collective).

torch-free (the planner's ledger model builds Ledgers): the caller passes the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and the ranks missing from it."""


@dataclass
class FlightRecorder:
    capacity: int = 256
    directory: Path | None = None  # the trainer sets RUN_DIR/flight_recorder
    grace_s: float = 5.0
    step: int | None = None
    micro_batch: int | None = None
    entries: deque = field(default_factory=deque)
    counts: dict[str, int] = field(default_factory=dict)  # collectives issued per axis
    created: float = field(default_factory=time.time)

    def note(self, op: str, axis: str, nbytes: int, purpose: str) -> dict:
        """Append one collective (it is about to be issued); return its entry."""
        seq = self.counts[axis] = self.counts.get(axis, 0) + 1
        entry = {"seq": seq, "op": op, "axis": axis, "bytes": nbytes, "purpose": purpose,
                 "step": self.step, "micro_batch": self.micro_batch, "time": time.time()}
        self.entries.append(entry)
        while len(self.entries) > self.capacity:
            self.entries.popleft()
        return entry

    @property
    def last(self) -> dict | None:
        return self.entries[-1] if self.entries else None

    def dump(self, rank: int, entry: dict | None, error: BaseException) -> dict:
        frames = sys._current_frames()
        return {"rank": rank, "written": time.time(), "failed": entry,
                "error": f"{type(error).__name__}: {error}", "counts": dict(self.counts),
                "entries": list(self.entries),
                "stacks": {str(tid): traceback.format_stack(frame)
                           for tid, frame in frames.items()}}

    def _write(self, rank: int, record: dict) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank_{rank}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path

    def _read_others(self, others: list[int]) -> dict[int, dict]:
        """The fresh recorders of `others`, waiting up to grace_s for all of them."""
        found: dict[int, dict] = {}
        deadline = time.monotonic() + self.grace_s
        while True:
            for r in others:
                path = self.directory / f"rank_{r}.json"
                if r in found or not path.is_file():
                    continue
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if record.get("written", 0) >= self.created:  # not a previous run's
                    found[r] = record
            if len(found) == len(others) or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)

    def failed(self, rank: int, group_ranks: list[int], entry: dict | None,
               error: BaseException) -> CollectiveError:
        """Write this rank's recorder, read its group's, and say who never reached `entry`."""
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        if entry is None:
            return CollectiveError(f"a collective failed on rank {rank}: {first_line}")
        micro = (f", micro-batch {entry['micro_batch']}" if entry["micro_batch"] is not None
                 else "")
        what = (f"{entry['op']} on axis {entry['axis']!r} (purpose {entry['purpose']!r}, "
                f"step {entry['step']}{micro}, collective #{entry['seq']} on this axis) "
                f"failed on rank {rank}: {first_line}")
        if self.directory is None:
            return CollectiveError(what + " (no flight recorder directory set)")
        self._write(rank, self.dump(rank, entry, error))
        others = [r for r in group_ranks if r != rank]
        records = self._read_others(others)
        behind = [r for r in others if r in records
                  and records[r]["counts"].get(entry["axis"], 0) < entry["seq"]]
        silent = [r for r in others if r not in records]
        parts = []
        for r in behind:
            last = records[r].get("failed") or (records[r]["entries"] or [None])[-1]
            at = (f"{last['op']}@{last['axis']} #{last['seq']}, step {last['step']}"
                  if last else "no collective")
            parts.append(f"rank {r} (waiting in {at})")
        reached = ("never reached by " + ", ".join(parts) if parts
                   else "every rank that wrote a recorder reached it")
        if silent:
            reached += (f"; no recorder within {self.grace_s:g} s from rank(s) "
                        f"{', '.join(map(str, silent))} (dead, or stuck outside a collective)")
        return CollectiveError(f"{what}; {reached}. Recorders: {self.directory}")
