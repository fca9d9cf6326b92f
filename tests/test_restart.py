"""Automatic restart: `fivefold train --max-restarts N` survives a rank killed mid-run, and
the checkpoint interval in minutes is one decision on every rank (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fivefold.config import load_config
from fivefold.testing import run_on_ranks
from fivefold.train.checkpoint import complete_checkpoints, step_dir
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

STEPS = 16


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_command(sets: list[str], run_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "fivefold", "train", *[a for s in sets for a in ("--set", s)],
            "--steps", str(STEPS), "--nproc", "2", "--run-dir", str(run_dir), *flags]


def worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's child process running `rank` (its RANK variable)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def checkpoint_tensors(path: Path, out: Path) -> dict:
    """Every entry of a DCP checkpoint (parameters, optimizer state), read back as tensors."""
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}/{key}")
    else:
        yield prefix, tree


def test_sigkilled_rank_restarts_and_ends_bit_identical(parity_overrides, tmp_path):
    """2 gloo ranks, DDP, fp32, 16 steps with a checkpoint every 2. Once step 4's checkpoint
    is complete, the test SIGKILLs rank 1 from outside; under --max-restarts 1 the elastic
    agent restarts both ranks, which resume from the latest checkpoint and finish by
    themselves (exit 0). Exact equality: the final parameters and AdamW moments equal an
    uninterrupted run's bit for bit, and every step's loss and gradient norm (before and
    after the restart) equal its own step's, so no batch was repeated or skipped."""
    sets = parity_overrides + ["train.checkpoint_every=2", "train.eval_every=100",
                               "train.eval_batches=1", "train.keep_checkpoints=100"]
    straight = subprocess.run(train_command(sets, tmp_path / "straight"), capture_output=True,
                              text=True, timeout=300)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(train_command(sets, run_dir, "--max-restarts", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (step_dir(run_dir, 4) / "meta.json").exists():  # written last, then renamed
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.005)
        os.kill(worker_of_rank(proc.pid, 1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # failed: SIGTERM, which the agent passes on to its workers
            proc.terminate()
            proc.wait(timeout=60)
    assert proc.returncode == 0, out
    resumed = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1, out
    resumed_step = int(resumed[0].rsplit("step ", 1)[1].rstrip(")"))
    assert 4 <= resumed_step < STEPS, resumed[0]  # the kill came mid-run, not after the end

    final = {}
    for name in ("straight", "killed"):
        final[name] = dict(flat(checkpoint_tensors(step_dir(tmp_path / name, STEPS),
                                                   tmp_path / f"{name}.pt")))
    assert final["straight"].keys() == final["killed"].keys()
    for key, value in final["straight"].items():
        other = final["killed"][key]
        same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        assert same, key

    expected = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path /
                                                                            "straight")}
    records = read_metrics(run_dir)
    assert {r["step"] for r in records} == set(range(1, STEPS + 1))
    assert all((r["loss"], r["grad_norm"]) == expected[r["step"]] for r in records)


def _minutes_on_ranks(rt: Runtime, sets: list[str], run_dir: str) -> list[str]:
    """Rank 0's clock reads 0, 30 and 70 s (60 s = the interval) after steps 1 and 2, then
    stays; rank 1's never moves. The checkpoints this rank saw written."""
    readings = iter([0.0, 30.0, 70.0])
    clock = (lambda: next(readings, 70.0)) if rt.rank == 0 else (lambda: 0.0)
    trainer = Trainer(load_config(None, sets), rt, Path(run_dir))
    trainer.clock = clock
    trainer.run()
    return [p.name for p in complete_checkpoints(Path(run_dir))]


def test_checkpoint_minutes_is_rank_zeros_decision(tiny_overrides, tmp_path):
    """train.checkpoint_minutes = 1 with checkpoint_every beyond the run: rank 0's clock
    passes the minute at step 2, rank 1's never does; both ranks save step 2 (a save on one
    rank only would leave the other at DCP's collectives until the timeout) and the end,
    and nothing else."""
    sets = tiny_overrides + ["train.steps=4", "train.checkpoint_every=100",
                             "train.checkpoint_minutes=1", "train.keep_checkpoints=10",
                             "train.eval_every=100", "train.eval_batches=1",
                             "train.sample_tokens=0", "train.timeout_s=60"]
    prepare_data(load_config(None, sets))
    results = run_on_ranks(_minutes_on_ranks, 2, sets, str(tmp_path), timeout_s=240)
    assert results == [["step_00000002", "step_00000004"]] * 2
