"""Run a function on N gloo ranks in fresh processes: the harness of every parity test.

`run_on_ranks(fn, world_size, *args)` spawns `world_size` processes, joins them in one gloo
process group (rendezvous through a file, so parallel test runs never fight over a port),
calls `fn(runtime, *args)` on each and returns the per-rank results in rank order. A failure on
any rank is re-raised here with that rank's traceback; a hang is killed after `timeout_s`.
`fn` must be importable by name (defined at module level), as `spawn` requires. Each rank uses
one intra-op thread so that 8 ranks share two cores without thrashing, and keeps its freed
memory for the next step as a `fivefold train` CPU rank does (fivefold.host_heap). The
spawning itself is fivefold.local_ranks, which imports no runtime.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fivefold.local_ranks import RankFailure, run_local
from fivefold.train.dist import Runtime
from fivefold.host_heap import keep_host_heap

__all__ = ["RankFailure", "run_on_ranks"]


def _runtime(rank: int, world_size: int) -> Runtime:
    return Runtime(rank, world_size, rank, torch.device("cpu"))


def run_on_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 300.0,
                 **kwargs) -> list[Any]:
    """`[fn(runtime_r, *args, **kwargs) for r in ranks]`, computed on `world_size` processes."""
    return run_local(fn, world_size, *args, timeout_s=timeout_s, prepare=keep_host_heap,
                     make_context=_runtime, **kwargs)
