"""The ledger of the two update paths outside the data-parallel engine: data-parallel GaLore
(fivefold.memory.galore_dp) and LOMO with data parallelism (fivefold.memory.lomo).

GaLore, on a step without subspace refresh (every step but one in `train.galore_update_gap`;
a refresh step all-reduces the whole gradient bucket instead and broadcasts each matrix's
new projection from the rank that took its SVD): at stage 0 one all-reduce of
the gradient bucket (of the projected gradient under `train.galore_reduce = "projected"`),
at stage 1 one reduce-scatter of it, at stage 2 one per micro-batch; at stages 1-2 the
squared gradient norm's 4-byte all-reduce over the shard axis and one all-gather of the
low-rank steps and the full-rank parameters' new values; each bucket is 4 bytes per element
of n segments (fivefold.planner.memory.galore_dp_segment). LOMO: every parameter's fp32
gradient all-reduced in backward, in each of its passes (two with clipping); at ZeRO-1/2
reduce-scattered instead, each parameter padded to a multiple of dp, then all-gathered once
after its update, and the norm's 4-byte all-reduce. Both
all-reduce the step's loss (4 bytes) over the data-parallel ranks.
"""

from __future__ import annotations

from fivefold.comm.ledger import Ledger
from fivefold.config import Config
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.memory import galore_dp_segment, galore_dp_state_bytes
from fivefold.models.description import block_parameters, root_parameters
from fivefold.planner.params import local_numel, total_params


def update_path_ledger(cfg: Config, lay: ParallelPlan) -> Ledger:
    """The ledger `Trainer.train_step` records under `lay` (update "galore-dp" or "lomo")."""
    ledger = Ledger()
    dp = "+".join(("dp_replicate", *lay.shard_axes))

    def record(op: str, dim: str, nbytes: int, purpose: str, times: int = 1) -> None:
        for _ in range(times if lay.dp > 1 else 0):
            ledger.record(op, dim, lay.dp, "float32", nbytes, purpose)

    if lay.update == "lomo":
        record("all_reduce", dp, 4, "loss")
        passes = 2 if cfg.train.grad_clip else 1
        if lay.zero_stage == 0:
            record("all_reduce", dp, 4 * total_params(cfg.model), "grads", passes)
            return ledger
        params = root_parameters(cfg.model) + [p for layer in range(cfg.model.layers)
                                               for p in block_parameters(cfg.model, layer)]
        padded = 4 * sum(-(-local_numel(cfg.model, p) // lay.dp) * lay.dp for p in params)
        record("reduce_scatter", dp, padded, "grads", passes)
        record("all_gather", dp, padded, "params")
        record("all_reduce", dp, 4, "grad_norm")
        return ledger
    n = lay.dp if lay.zero_stage >= 1 else 1
    projected = cfg.train.galore_reduce == "projected"
    grads, steps, _ = (4 * n * seg for seg in galore_dp_segment(cfg.model, n))
    grads = steps if projected else grads  # the projected gradient has the steps' layout
    if lay.zero_stage == 0:
        record("all_reduce", dp, grads, "grads")
    else:
        record("reduce_scatter", dp, grads, "grads",
               lay.micro_batches if lay.zero_stage == 2 else 1)
        record("all_reduce", "+".join(lay.shard_axes), 4, "grad_norm")
        record("all_gather", dp, steps, "params")
    record("all_reduce", dp, 4, "loss")
    ledger.model_state_bytes = galore_dp_state_bytes(cfg.model, lay, projected)
    return ledger
