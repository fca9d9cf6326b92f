"""What one rank of `fivefold train` holds, predicted: the memory report's planner column.

Model states are fivefold.planner.memory's (the data-parallel engine's flat units, equal to
what the engine records; data-parallel GaLore's bucket and sharded projected states, equal
to what fivefold.memory.galore_dp records); on the plain one-rank path the model stays fp32
under autocast and torch's optimizer keeps its state per parameter, so the same count is
taken at fp32 with no master copy. Under offload the optimizer row is what stays on the
device and two rows more, "optimizer states, host" and "optimizer states, disk", hold the
offloaded units' master, moments and fp32 gradient (fivefold.planner.memory's table).
Activations are one micro-batch's saved bytes on this rank (this stage's blocks and its
share of the root, fivefold.planner.activations), which the trainer measures with
saved-tensor hooks on its first micro-batch; under activation offload the first
`offload_activations` blocks of each of the rank's virtual stages (its stage, or under vpp
each of its chunks) put their bytes in the "activations_host" row instead
(fivefold.planner.activation_offload); a pipeline stage holds up to its schedule's
in-flight micro-batches of them, which the report states but does not measure. Under
`parallel.dp_batch_shares` a rank's micro-batches are its replica's (batch_shares.replica_plan).

The activations follow the runtime's dtypes on `device_type`: fp8 keeps its base dtype
outside the fp8 linears, fp32 on the CPU (fivefold.parallel.plan.compute_precision), where
the fp8 linears save their fp32 inputs as a plain linear does; the update paths that keep fp32
weights under autocast save the casts and fp32 tensors planner.activations_autocast counts;
under cp each stage saves its tokens' rotary rows once (activations.rotary_rows_bytes).
"""

from __future__ import annotations

from fivefold.batch_shares import dp_rank_of, replica_plan
from fivefold.config import Config
from fivefold.parallel.pipeline.partition import stage_layer_ranges
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan, compute_precision
from fivefold.planner.activation_offload import rank_offloaded_layers
from fivefold.planner.activations import (layout_block_saved_bytes, layout_root_saved_bytes,
                                          rotary_rows_bytes)
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.ledger_pipeline import stage_layers_of_rank
from fivefold.planner.memory import model_state_bytes, stage_units
from fivefold.planner.schedules import peak_in_flight


def predicted_rank_memory(cfg: Config, plan: ParallelPlan, rank: int,
                          device_type: str = "cuda") -> dict[str, float]:
    """{params, grads, optimizer (master copies and states on the device), host, disk
    (offload's tiers), activations_per_micro_batch (on the device), activations_host,
    micro_batches_in_flight}
    of global rank `rank` under `plan` on `device_type` ranks, in bytes."""
    m = cfg.model
    plan = replica_plan(plan, dp_rank_of(plan, rank))  # dp_batch_shares: its micro-batches
    layers, first, last = stage_layers_of_rank(cfg, plan, plan.pp_rank_of(rank))
    if plan.update in ("engine", "galore-dp"):
        states = predict_ledger(cfg, plan, rank).model_state_bytes
    else:
        fp32 = plan.replace(precision="fp32")
        units = stage_units(m, fp32, layers, first, last, etp=plan.etp)
        states = model_state_bytes(units, fp32)
    a = PRECISION_BYTES[compute_precision(plan.precision, device_type)]
    blocks = {i: layout_block_saved_bytes(m, plan, i, act_bytes=a) for i in layers}
    rows = rotary_rows_bytes(m, plan.cp, 4 if plan.update != "engine" else a)
    ranges = stage_layer_ranges(m, plan.pp * plan.vpp, plan.stage_layers)
    host = sum(blocks.pop(i) + rows for i in rank_offloaded_layers(plan, ranges,
                                                                   plan.pp_rank_of(rank)))
    acts = sum(blocks.values()) + (rows if blocks else 0)
    acts += layout_root_saved_bytes(m, plan, first, last, act_bytes=a)
    inflight = (peak_in_flight(plan.schedule, plan.pp, plan.micro_batches, plan.pp_rank_of(rank),
                               plan.vpp) if plan.pp > 1 else 1)
    return {"params": states["params"], "grads": states["grads"],
            "optimizer": states["master"] + states["optimizer"],
            "host": states["host"], "disk": states["disk"],
            "activations_per_micro_batch": acts, "activations_host": host,
            "micro_batches_in_flight": inflight}
