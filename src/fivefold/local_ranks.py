"""Run a function on N local gloo ranks in fresh processes, with no runtime attached.

`run_local(fn, world_size, *args)` spawns `world_size` processes, joins them in one gloo
process group (rendezvous through a file, so parallel runs never fight over a port), calls
`fn(context, *args)` on each and returns the per-rank results in rank order. `prepare()` runs
first in each rank and `make_context(rank, world_size)` after the group is joined (both
module-level, as `spawn` requires; default: nothing, and `context` is None). A failure on any
rank is re-raised here with that rank's traceback; a hang is killed after `timeout_s`. Each
rank uses one intra-op thread. fivefold.testing builds the parity tests' harness on it (with
the runtime as context); `fivefold calibrate` measures with it without importing the runtime.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this rank when the process that started it dies, even
    by SIGKILL or an unhandled SIGTERM (which skip the cleanup that ends daemonic children):
    an interrupted run then leaves no ranks spinning on the cores."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _worker(fn: Callable, rank: int, world_size: int, store_path: str, results: Any,
            timeout_s: float, args: tuple, kwargs: dict, prepare: Callable | None,
            make_context: Callable | None) -> None:
    _die_with_parent()
    if prepare is not None:
        prepare()
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        context = make_context(rank, world_size) if make_context is not None else None
        buffer = io.BytesIO()  # tensors by value: shared-memory handles die with the rank
        torch.save(fn(context, *args, **kwargs), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable, world_size: int, *args, timeout_s: float = 300.0,
              prepare: Callable | None = None, make_context: Callable | None = None,
              **kwargs) -> list[Any]:
    """`[fn(context_r, *args, **kwargs) for r in ranks]`, computed on `world_size` processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fivefold-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, store, results, timeout_s, args, kwargs,
                                   prepare, make_context))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        out: dict[int, Any] = {}
        try:
            while len(out) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{world_size - len(out)} of {world_size} ranks did not "
                                       f"finish {fn.__name__} within {timeout_s:.0f} s")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in out and p.exitcode not in (None, 0)]
                    if dead:
                        raise RankFailure(f"rank {dead[0]} died with exit code "
                                          f"{procs[dead[0]].exitcode}") from None
                    continue
                if not ok:
                    raise RankFailure(f"rank {rank} failed in {fn.__name__}:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:  # after a failure, kill the rest at once; after success, let them exit
            grace = 10.0 if len(out) == world_size else 0.0
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
