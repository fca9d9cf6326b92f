"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step_00000100/ holds the DCP files of the model and optimizer
state the trainer hands over (each rank writes its own shards), one `rank_R.pt` per rank with
its RNG states and gradient-scaler state, and `meta.json` (step, the data position, which is
the step, the config, and the run's `ParallelPlan` with the part of it that decides keys and
shards, `layout`). The step is also the learning-rate schedule's whole state.

Keys: the trainer's state dict keys carry a shard tag where pipeline stages or tp ranks hold
different things under one name (`shard_tag`: ".pp1of2.tp0of2"); this module writes and
`check_layout` reads the layout record. Checkpoints are not resharded: a resume under another
layout stops with the first key that differs.

Atomicity: everything is written into `step_00000100.partial/`; after every rank has
finished, rank 0 writes `meta.json` and renames the folder. A rename is atomic on POSIX, so a
crash at any moment leaves either the old set of checkpoints or the old set plus the new one,
never a half-written "latest". Leftover `.partial` folders are ignored and removed. A save
that fails (a full disk: OSError ENOSPC, or DCP's CheckpointException around it) removes its
`.partial` folder and raises `CheckpointWriteError` naming the checkpoint that stays the
latest one, which a rerun resumes from (tests/test_reliability.py).

Loading unpickles nothing but tensors and plain values: `rank_R.pt` is read with
`torch.load(weights_only=True)`, so its RNG states are saved as tensors, ints, floats and
tuples (numpy's Mersenne Twister key as an int64 tensor, converted back on load).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config import ConfigError
from fivefold.parallel.plan import ParallelPlan
from fivefold.train.dist import Runtime

PARTIAL = ".partial"

# DCP warns when it runs without a process group; for a one-rank run that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def shard_tag(pp_rank: int, pp: int, tp_rank: int, tp: int) -> str:
    """The suffix of state-dict keys that differ between pipeline stages and tp ranks: every
    stage has a "root" unit, and tp ranks hold different shards under one name."""
    return "".join(f".{name}{rank}of{size}"
                   for name, rank, size in (("pp", pp_rank, pp), ("tp", tp_rank, tp))
                   if size > 1)


def layout_record(plan: ParallelPlan) -> dict:
    """The meta.json entries of a plan: the whole plan, and `layout`, what decides the
    checkpoint's keys and shards as "parallel.key": value (a resume must match it)."""
    layout = {f"parallel.{key}": getattr(plan, key)
              for key in ("pp", "tp", "cp", "vpp", "stage_layers", "zero_stage", "zero_group",
                          "hpz")}
    stages = layout["parallel.stage_layers"]
    layout["parallel.stage_layers"] = list(stages) if stages else None  # as JSON reads back
    layout["parallel.schedule"] = "pipedream-2bw" if plan.asynchronous else "synchronous"
    layout["parallel.weight_prediction"] = plan.asynchronous and plan.weight_prediction
    layout["parallel.dp"] = plan.dp
    return {"plan": plan.to_dict(), "layout": layout}


def check_layout(path: Path, meta: dict, plan: ParallelPlan) -> None:
    """ConfigError naming the first layout key in which checkpoint `path` (its meta.json
    `meta`) differs from `plan`."""
    saved, now = meta.get("layout", {}), layout_record(plan)["layout"]
    for key in saved:
        if saved[key] != now[key]:
            raise ConfigError(key, f"{path} was written with {key} = {saved[key]!r}, this run "
                                   f"has {now[key]!r}; checkpoints are not resharded: resume"
                                   " with the same layout or use another --run-dir")


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


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost mount); the previous one stands."""


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos,
                         has_gauss, gauss))
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
    try:
        dcp.save(state, checkpoint_id=partial)
        torch.save({"rng": rng_state(rt.device), **extra}, partial / f"rank_{rt.rank}.pt")
    except (OSError, CheckpointException) as err:
        shutil.rmtree(partial, ignore_errors=True)  # give the space back
        previous = latest_checkpoint(run_dir)
        kept = (f"the latest complete checkpoint, {previous}, is intact and a rerun resumes "
                "from it" if previous else "there is no earlier checkpoint")
        raise CheckpointWriteError(f"rank {rt.rank} could not write checkpoint {final.name} "
                                   f"({err}); {kept}") from err
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
    try:
        extra = torch.load(extra_path, weights_only=True) if extra_path.exists() else {}
    except pickle.UnpicklingError as err:
        raise ConfigError("--run-dir", f"{extra_path} holds objects other than tensors and "
                                       "plain values (written before checkpoints loaded with "
                                       "weights_only); it is not unpickled: resume from a "
                                       "newer checkpoint or use another --run-dir") from err
    if "rng" in extra:
        set_rng_state(extra["rng"], rt.device)
    return json.loads((path / "meta.json").read_text()), extra


def remove_partials(run_dir: Path) -> None:
    """Delete folders left by saves that crashed (rank 0, before training)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.glob(f"*{PARTIAL}"):
            shutil.rmtree(p, ignore_errors=True)
