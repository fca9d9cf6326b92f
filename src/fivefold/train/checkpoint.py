"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step_00000100/ holds the DCP files of the model and optimizer
state the trainer hands over (each rank writes its own shards), one `rank_R.pt` per rank with
its RNG states and gradient-scaler state, and `meta.json` (step, the data position, which is
the step, and the config). The step is also the learning-rate schedule's whole state.

Atomicity: everything is written into `step_00000100.partial/`; after every rank has
finished, rank 0 writes `meta.json` and renames the folder. A rename is atomic on POSIX, so a
crash at any moment leaves either the old set of checkpoints or the old set plus the new one,
never a half-written "latest". Leftover `.partial` folders are ignored and removed.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fivefold.train.dist import Runtime

PARTIAL = ".partial"

# DCP warns when it runs without a process group; for a one-rank run that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir()
            if p.is_dir() and not p.name.endswith(PARTIAL) and (p / "meta.json").is_file()]
    return sorted(done, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def _barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(rt: Runtime, run_dir: Path, step: int, state: dict, meta: dict,
                    extra: dict, keep: int) -> Path:
    """Write `state` (DCP) and this rank's `extra` (with its RNG) for `step`, atomically, and
    prune all but the newest `keep` checkpoints."""
    final = step_dir(run_dir, step)
    partial = final.with_name(final.name + PARTIAL)
    if rt.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(rt)
    dcp.save(state, checkpoint_id=partial)
    torch.save({"rng": rng_state(rt.device), **extra}, partial / f"rank_{rt.rank}.pt")
    _barrier(rt)
    if rt.is_main:
        (partial / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(rt)
    return final


def load_checkpoint(rt: Runtime, path: Path, state: dict) -> tuple[dict, dict]:
    """Load `state` in place, restore this rank's RNG; return (meta, this rank's extra)."""
    dcp.load(state, checkpoint_id=path)
    extra_path = path / f"rank_{rt.rank}.pt"
    extra = torch.load(extra_path, weights_only=False) if extra_path.exists() else {}
    if "rng" in extra:
        set_rng_state(extra["rng"], rt.device)
    return json.loads((path / "meta.json").read_text()), extra


def remove_partials(run_dir: Path) -> None:
    """Delete folders left by saves that crashed (rank 0, before training)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.glob(f"*{PARTIAL}"):
            shutil.rmtree(p, ignore_errors=True)
