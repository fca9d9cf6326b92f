"""Interrupts and preemption (fivefold.train.interrupt): SIGINT or SIGTERM stops every rank at
the next step boundary with a checkpoint and one line, and the rerun continues bit-exact.

Both signals stop the same 2-rank run, one after the other (4 launches in all, with the
uninterrupted reference run): the stop agrees over an all-reduce whatever the world size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fivefold.train.checkpoint import complete_checkpoints
from test_restart import STEPS, read_metrics, train_command, worker_of_rank


def _signalled(sets, run_dir, signum: int, to_rank: int | None, after_step: int) -> tuple:
    """Run (or resume) the 2-rank run in `run_dir`; once step `after_step` + 1 has been
    logged send `signum` to the launcher (`to_rank` None) or to that rank's worker alone.
    Its output (stdout and stderr) and exit status."""
    proc = subprocess.Popen(train_command(sets, run_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > after_step):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.01)
        os.kill(proc.pid if to_rank is None else worker_of_rank(proc.pid, to_rank), signum)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    return out, proc.returncode


def _stopped_at(out: str, status: int, run_dir, signum: int) -> int:
    """One line, no traceback, status 128 + signal, and the checkpoint it names complete:
    the step it names."""
    assert status == 128 + signum, out
    assert "Traceback" not in out and "Error" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("fivefold: interrupted at step")]
    assert len(lines) == 1, out
    step = int(lines[0].split("step ")[1].split(";")[0])
    assert 2 <= step < STEPS, lines[0]
    assert lines[0].endswith("run the same command to resume"), lines[0]
    assert any(p.name == f"step_{step:08d}" for p in complete_checkpoints(run_dir)), lines[0]
    return step


def test_sigint_and_sigterm_stop_save_and_resume_bit_exact(parity_overrides, tmp_path):
    """One 2-rank gloo run, stopped twice: SIGINT to the launcher (as Ctrl-C in a terminal)
    once step 2 is logged; the same command resumes, and SIGTERM to rank 1 alone (a
    preempted process) once it has logged a step; the same command again resumes and
    finishes. Each stop is at a step boundary on every rank, prints one line and no
    traceback, exits 130 / 143, and keeps its progress although no scheduled checkpoint was
    due (checkpoint_every beyond the run); each rerun resumes from the step the stop named,
    and the run ends with every step's loss and grad norm equal to an uninterrupted run's
    (exact: the same batches and updates, bit for bit)."""
    sets = parity_overrides + ["train.checkpoint_every=1000", "train.eval_every=1000",
                               "train.eval_batches=1", "train.log_every=1"]
    done = subprocess.run(train_command(sets, tmp_path / "straight"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "interrupted"
    out, status = _signalled(sets, run_dir, signal.SIGINT, None, after_step=1)
    first = _stopped_at(out, status, run_dir, signal.SIGINT)
    assert len(read_metrics(run_dir)) == first  # no step past the stop was logged
    out, status = _signalled(sets, run_dir, signal.SIGTERM, 1, after_step=first)
    assert f"(step {first})" in out, out
    second = _stopped_at(out, status, run_dir, signal.SIGTERM)
    assert second > first, out
    resumed = subprocess.run(train_command(sets, run_dir), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {second})" in resumed.stdout, resumed.stdout
    expected = {r["step"]: (r["loss"], r["grad_norm"])
                for r in read_metrics(tmp_path / "straight")}
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all((r["loss"], r["grad_norm"]) == expected[r["step"]] for r in records)


SECOND_SIGNAL = """
import os, signal, torch
from fivefold.comm.collectives import Axis
from fivefold.comm.ledger import Ledger
from fivefold.train.interrupt import StopSignals
stop = StopSignals()
with stop.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    print(stop.agreed(Axis("world", None, 1, 0, Ledger()), torch.device("cpu")), flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    print("still running")
"""


def test_first_signal_is_noted_and_the_second_ends_the_process():
    """One rank: the first signal is only noted (and agreed on), the second ends the process
    by its default action, with no traceback."""
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGINT, proc.stdout + proc.stderr
    assert proc.stdout == f"{signal.SIGTERM!s}\n" and proc.stderr == "", proc.stdout + proc.stderr
