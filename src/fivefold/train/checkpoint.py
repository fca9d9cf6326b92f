"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step_00000100/ holds the DCP files of the model and optimizer
state the trainer hands over (each rank writes its own shards), one `rank_R.pt` per rank with
its RNG states and gradient-scaler state, and `meta.json` (step, the data position, which is
the step, the config, and the run's `ParallelPlan` with the part of it that decides keys and
shards, `layout`). The step is also the learning-rate schedule's whole state.

Keys: the trainer's state dict keys carry a shard tag where pipeline stages or tp ranks hold
different things under one name (`shard_tag`: ".pp1of2.tp0of2"); this module writes and
`check_layout` reads the layout record. A resume under another layout (other dp, tp, pp, vpp,
stage split, cp, ep, etp, ZeRO stage, group or ZeRO++ switches) is resharded
(fivefold.train.reshard); `check_layout` refuses what cannot be: PipeDream-2BW's weight
versions, optimizers other than AdamW and Muon, and a changed global batch, which would
change the data of every later step.

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

from fivefold.config import Config, ConfigError
from fivefold.parallel.plan import ParallelPlan
from fivefold.train.dist import Runtime
from fivefold.train.resume_data import check_data_keys

PARTIAL = ".partial"
RESHARDED_OPTIMIZERS = ("adamw", "muon")  # whose state a resume under another layout carries

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
    checkpoint's keys and shards as "parallel.key": value (a resume under another one
    reshards, fivefold.train.reshard)."""
    layout = {f"parallel.{key}": getattr(plan, key)
              for key in ("pp", "tp", "cp", "ep", "etp", "vpp", "stage_layers", "zero_stage",
                          "zero_group", "hpz", "qwz", "qgz")}  # qwZ and qgZ pad units to whole blocks
    stages = layout["parallel.stage_layers"]
    layout["parallel.stage_layers"] = list(stages) if stages else None  # as JSON reads back
    layout["parallel.schedule"] = "pipedream-2bw" if plan.asynchronous else "synchronous"
    layout["parallel.weight_prediction"] = plan.asynchronous and plan.weight_prediction
    layout["parallel.dp"] = plan.dp
    return {"plan": plan.to_dict(), "layout": layout}


def check_layout(path: Path, meta: dict, plan: ParallelPlan) -> list[str]:
    """The layout keys in which checkpoint `path` (its meta.json `meta`) differs from `plan`,
    which a resume reshards (fivefold.train.reshard); ConfigError naming the key where the
    checkpoint cannot be taken under `plan`: another global batch (the data position is the
    step, and a step's batch is drawn by (seed, step, global batch), fivefold.train.data), or
    another layout with PipeDream-2BW (its stages' weight versions and own optimizers are not
    resharded), or with sharded Muon (ZeRO or tp: its per-piece states are not) or Muon on
    the experts' tensor-parallel grid (etp > 1), or with another optimizer than AdamW or
    Muon, or than the checkpoint's."""
    saved, now = meta.get("layout", {}), layout_record(plan)["layout"]
    saved_plan = meta.get("plan", {})
    if saved_plan.get("global_batch", plan.global_batch) != plan.global_batch:
        raise ConfigError("parallel.global_batch", f"{path} was written with global_batch = "
                          f"{saved_plan['global_batch']}, this run has {plan.global_batch}; a "
                          "step's batch is drawn by its step and the global batch, so the run "
                          "would not continue the interrupted one: resume with global_batch = "
                          f"{saved_plan['global_batch']} or use another --run-dir")
    changed = [key for key in saved if saved[key] != now[key]]
    if not changed:
        return []
    if "pipedream-2bw" in (saved.get("parallel.schedule"), now["parallel.schedule"]):
        key = changed[0]
        raise ConfigError(key, f"{path} was written with {key} = {saved[key]!r}, this run has "
                               f"{now[key]!r}; PipeDream-2BW checkpoints (each stage's older "
                               "weight version and own optimizer) are not resharded: resume "
                               "with the layout that wrote it or use another --run-dir")
    if plan.optimizer == "muon" and any(layout.get("parallel.zero_stage", 0) or
                                        layout.get("parallel.tp", 1) > 1
                                        for layout in (saved, now)):
        key = changed[0]
        raise ConfigError(key, f"{path} was written with {key} = {saved[key]!r}, this run has "
                               f"{now[key]!r}; sharded Muon's states (under ZeRO or tp, "
                               "fivefold.parallel.muon_sharded) are not resharded: resume "
                               "with the layout that wrote it or use another --run-dir")
    if plan.optimizer == "muon" and max(saved.get("parallel.etp", 1), plan.etp) > 1:
        key = changed[0]
        raise ConfigError(key, f"{path} was written with {key} = {saved[key]!r}, this run has "
                               f"{now[key]!r}; Muon's states of experts split over etp ranks "
                               "are not resharded: resume with the layout that wrote it or "
                               "use another --run-dir")
    saved_optimizer = saved_plan.get("optimizer", plan.optimizer)
    if saved_optimizer != plan.optimizer or plan.optimizer not in RESHARDED_OPTIMIZERS:
        raise ConfigError("train.optimizer", f"{path} was written with {changed[0]} = "
                          f"{saved[changed[0]]!r} and optimizer {saved_optimizer!r}, this run "
                          f"has {now[changed[0]]!r} and {plan.optimizer!r}; resharding carries "
                          "the state of AdamW and Muon, each to itself: resume with the layout"
                          " and optimizer that wrote it or use another --run-dir")
    return changed


def check_resume(run_dir: Path, cfg: Config, plan: ParallelPlan
                 ) -> tuple[Path, dict, list[str]] | None:
    """The latest checkpoint of `run_dir`, its meta.json and the layout keys a resume under
    `plan` reshards (`check_layout`); None when there is none. ConfigError where this run
    cannot resume from it: another model, other data (fivefold.train.resume_data), or what
    `check_layout` refuses. `fivefold train`
    asks before it starts ranks, each rank again before it loads."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return None
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("config", {}).get("model") != cfg.to_dict()["model"]:
        raise ConfigError("model", f"{run_dir} holds a checkpoint of a different model; use "
                                   "another --run-dir or the same model keys")
    check_data_keys(path, meta, cfg)  # fivefold.train.resume_data
    return path, meta, check_layout(path, meta, plan)


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
    return json.loads((path / "meta.json").read_text()), load_rank_extra(rt, path, rt.rank)


def load_rank_extra(rt: Runtime, path: Path, rank: int) -> dict:
    """Rank `rank`'s `rank_R.pt` of checkpoint `path` (empty if none), its RNG states restored
    on this rank."""
    extra_path = path / f"rank_{rank}.pt"
    try:
        extra = torch.load(extra_path, weights_only=True) if extra_path.exists() else {}
    except pickle.UnpicklingError as err:
        raise ConfigError("--run-dir", f"{extra_path} holds objects other than tensors and "
                                       "plain values (written before checkpoints loaded with "
                                       "weights_only); it is not unpickled: resume from a "
                                       "newer checkpoint or use another --run-dir") from err
    if "rng" in extra:
        set_rng_state(extra["rng"], rt.device)
    return extra


def remove_partials(run_dir: Path) -> None:
    """Delete folders left by saves that crashed (rank 0, before training)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.glob(f"*{PARTIAL}"):
            shutil.rmtree(p, ignore_errors=True)
