"""The space `fivefold plan` searches (fivefold.planner.search): every layout the model,
the batch and the cluster can take (`candidates`), and the offloaded variants a layout that
does not fit is tried with, in order (`offload_tries`; activation offload where it composes,
`hosts_activations`). Kept apart from the scoring so the space reads in one place; the
heterogeneous planner (fivefold.planner.hetero) draws its degrees from the same lists.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from fivefold.config import Config
from fivefold.parallel.plan import ParallelPlan

RECOMPUTE = ("none", "selective", "full")
VIRTUAL_STAGES = (2, 4)
OFFLOAD_TRIES = (("cpu", 0.5), ("cpu", 1.0), ("nvme", 0.5), ("nvme", 1.0))


def powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(max(1, limit))) + 1)]


def candidates(cfg: Config, base: ParallelPlan) -> list[ParallelPlan]:
    """Every layout of the search space that the model and batch can take."""
    m, gpus = cfg.model, base.gpus
    gpn = cfg.cluster.gpus_per_node
    out = []
    tps = [t for t in powers_of_two(min(gpn, m.heads)) if m.heads % t == 0
           and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0) and m.ffn_hidden % t == 0]
    cps = [c for c in powers_of_two(16) if m.seq_len % (c * 2) == 0 or c == 1]
    for tp, cp in itertools.product(tps, cps):
        if gpus % (tp * cp):
            continue
        rest = gpus // (tp * cp)
        for pp in (d for d in range(1, min(rest, m.layers) + 1) if rest % d == 0):
            dp = rest // pp
            if base.global_batch % dp:
                continue
            per_rank = base.global_batch // dp
            eps = [1]
            if m.moe is not None:
                eps = [e for e in range(1, dp * cp + 1)
                       if (dp * cp) % e == 0 and m.moe.experts % e == 0]
            micro = [b for b in range(1, per_rank + 1) if per_rank % b == 0][:8]
            for ep, mb in itertools.product(eps, micro):
                for sched, vpp in _schedules(pp, per_rank // mb, m.layers):
                    for zero, rec, sp in itertools.product(range(4), RECOMPUTE,
                                                           (False, True) if tp > 1 else (False,)):
                        if base.offload_activations and not hosts_activations(rec, sched):
                            continue
                        out.append(base.replace(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep,
                                                zero_group=dp, micro_batch=mb, schedule=sched,
                                                vpp=vpp, zero_stage=zero, recompute=rec,
                                                sequence_parallel=sp))
    return out


def _schedules(pp: int, micro: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zb", 1)]
    for v in VIRTUAL_STAGES:
        if pp * v <= layers and (micro <= pp or micro % pp == 0):
            out.append(("interleaved", v))
    return out


def hosts_activations(recompute: str, schedule: str) -> bool:
    """Whether activation offload composes with a layout's recomputation and schedule:
    fivefold.compositions refuses it with recomputation and TeraPipe (a cheap filter on the
    search's hot path; tests/test_plan_activation_offload.py holds it to the composition
    table). Under virtual stages its count is per model chunk (fivefold.parallel.
    parallelize.offloaded_blocks), as the search prices it."""
    return recompute == "none" and schedule != "terapipe"


def offload_tries(lay: ParallelPlan) -> Iterator[ParallelPlan]:
    """`lay`, then its offloaded variants in the order the search tries them (module
    docstring); only `lay` when it offloads already or offload does not compose with it.
    Lazy: most layouts fit as they are, and building a variant is a dataclass copy."""
    yield lay
    if lay.offload != "none" or lay.optimizer != "adamw" or lay.schedule == "pipedream-2bw":
        return
    for tier, f in OFFLOAD_TRIES:
        yield lay.replace(offload=tier, offload_fraction=f)
