"""Interrupts and preemption (fivefold.train.interrupt): SIGINT or SIGTERM stops every rank at
the next step boundary with a checkpoint and one line, and the rerun continues bit-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fivefold.train.checkpoint import complete_checkpoints
from test_restart import read_metrics, train_command, worker_of_rank

STEPS = 16


def _command(sets: list[str], run_dir, nproc: int) -> list[str]:
    cmd = train_command(sets, run_dir)
    cmd[cmd.index("--nproc") + 1] = str(nproc)
    return cmd


def _interrupted_then_resumed(sets, tmp_path, nproc: int, signum: int, to_rank: int | None):
    """Run `nproc` ranks; once step 2 has been logged send `signum` to the launcher
    (`to_rank` None) or to that rank's worker alone; then rerun the same command. The
    interrupted run's output, exit status, and the run directory."""
    run_dir = tmp_path / f"interrupted-{nproc}-{signum}"
    proc = subprocess.Popen(_command(sets, run_dir, nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.01)
        os.kill(proc.pid if to_rank is None else worker_of_rank(proc.pid, to_rank), signum)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    resumed = subprocess.run(_command(sets, run_dir, nproc), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return out, proc.returncode, run_dir, resumed.stdout


def _check(out: str, status: int, run_dir, resumed: str, straight, signum: int) -> None:
    """One line, no traceback, status 128 + signal; the checkpoint it names is complete and
    the rerun resumes from it and ends with every step's loss and grad norm equal to the
    uninterrupted run's (exact: the same batches and updates, bit for bit)."""
    assert status == 128 + signum, out
    assert "Traceback" not in out and "Error" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("fivefold: interrupted at step")]
    assert len(lines) == 1, out
    step = int(lines[0].split("step ")[1].split(";")[0])
    assert 2 <= step < STEPS, lines[0]
    assert lines[0].endswith("run the same command to resume"), lines[0]
    assert any(p.name == f"step_{step:08d}" for p in complete_checkpoints(run_dir)), lines[0]
    assert f"(step {step})" in resumed, resumed
    expected = {r["step"]: (r["loss"], r["grad_norm"]) for r in straight}
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all((r["loss"], r["grad_norm"]) == expected[r["step"]] for r in records)


def test_sigint_and_sigterm_stop_save_and_resume_bit_exact(parity_overrides, tmp_path):
    """SIGINT to the launcher of a 4-rank gloo run (as Ctrl-C in a terminal) and SIGTERM to
    rank 1 alone of a 2-rank run (a preempted process): both stop at a step boundary on every
    rank, print one line and no traceback, exit 130 / 143, keep their progress although no
    scheduled checkpoint was due (checkpoint_every beyond the run), and the rerun of the
    same command ends exactly as an uninterrupted run."""
    sets = parity_overrides + ["train.checkpoint_every=1000", "train.eval_every=1000",
                               "train.eval_batches=1", "train.log_every=1"]
    straight = {}
    for nproc in (4, 2):
        done = subprocess.run(_command(sets, tmp_path / f"straight-{nproc}", nproc),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        straight[nproc] = read_metrics(tmp_path / f"straight-{nproc}")
    out, status, run_dir, resumed = _interrupted_then_resumed(sets, tmp_path, 4,
                                                             signal.SIGINT, None)
    _check(out, status, run_dir, resumed, straight[4], signal.SIGINT)
    out, status, run_dir, resumed = _interrupted_then_resumed(sets, tmp_path, 2,
                                                             signal.SIGTERM, 1)
    _check(out, status, run_dir, resumed, straight[2], signal.SIGTERM)


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
