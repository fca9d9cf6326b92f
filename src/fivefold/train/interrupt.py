"""Interrupts and preemption: SIGINT or SIGTERM on any rank ends the run at the next step
boundary, on every rank, with a checkpoint and one line that says how to resume.

A signal can reach any rank at any moment: Ctrl-C reaches `fivefold train`'s launcher, whose
elastic agent passes it on to every rank; a scheduler that preempts a job sends SIGTERM to
some or all of its processes. The handler only notes the signal. After each step every rank
adds what it has noted into one all-reduce over all ranks (two fp32 flags, 8 bytes, through
fivefold.comm.collectives with purpose "stop"), so every rank learns the same answer at the
same step and they save a checkpoint together (a DCP save is collective). The all-reduce is
issued after the step's metrics record has taken the ledger's summary, as the checkpoint
clock's broadcast is (fivefold.train.save_schedule), so a step's ledger, which the planner
predicts, is that of the step alone.

The exit status is 128 + the signal: 130 for SIGINT, 143 for SIGTERM (143 when the ranks saw
both). A second signal to a rank, while it saves or anywhere else, ends that process at once
by the signal's default action: no traceback and no new checkpoint (a half-written one is
removed when the run starts again, fivefold.train.checkpoint).
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class StopSignals:
    """SIGINT and SIGTERM, noted while `installed()`; `agreed()` at each step boundary."""

    def __init__(self):
        self.seen = {sig: False for sig in SIGNALS}

    @contextlib.contextmanager
    def installed(self):
        """Note the first SIGINT or SIGTERM instead of dying; restore the previous handlers on
        leaving. Off the main thread (where Python cannot set handlers) this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._note) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _note(self, signum: int, frame) -> None:
        self.seen[signal.Signals(signum)] = True
        for sig in SIGNALS:  # the next one ends the process at once
            signal.signal(sig, signal.SIG_DFL)

    def agreed(self, world: Axis, device: torch.device) -> int | None:
        """The signal every rank stops on (SIGTERM if any rank saw it, else SIGINT if any
        did), or None to go on; the same answer on every rank of `world`."""
        flags = torch.tensor([float(self.seen[sig]) for sig in SIGNALS], device=device)
        C.all_reduce(flags, world, "stop")
        sigint, sigterm = (bool(v) for v in flags.tolist())
        return signal.SIGTERM if sigterm else signal.SIGINT if sigint else None

    def quiet(self) -> None:
        """Ignore further signals (after the interrupted run's checkpoint, while the process
        group closes): the launcher's agent stops the ranks that are left with SIGTERM."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def interrupted(say, path, done: int, signum: int) -> dict:
    """The summary of a run stopped by `signum` after step `done`, saved to checkpoint
    `path`, and its one line (`say`: rank 0's print)."""
    say(f"fivefold: interrupted at step {done}; checkpoint saved to {path}; run the same "
        "command to resume")
    return {"steps": done, "complete": False, "interrupted": signum, "checkpoint": str(path)}
