"""The all-to-all bytes of expert parallelism, predicted from the routing a step recorded.

Torch-free. Under `parallel.ep > 1` (fivefold.parallel.expert) every MoE layer's forward on
every micro-batch sends each kept token-assignment's row of `hidden` activations once to the
rank of its expert (`moe_dispatch`) and receives it back (`moe_combine`), and backward sends
each gradient row the reverse way (`moe_dispatch_backward`, `moe_combine_backward`); the
ledger counts a rank's input buffer, its own chunk included. So, summed over the ranks of a
step, each of the four purposes carries exactly

    sum over MoE layers of (assignments routed - assignments dropped) x hidden x act_bytes,

which the step's metrics record (`moe`: tokens_per_expert, dropped_fraction per layer;
fivefold.train.moe_stats) holds. The count exchange before each dispatch (`moe_counts`) is
one int64 per expert per rank, per layer and micro-batch.

`token_split_records` gives the collectives an MoE layer adds where tensor, sequence or
context parallelism splits a micro-batch's tokens (fivefold.parallel.moe_tokens), for
fivefold.planner.ledger_model.
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.models.description import MOE_PARTS, block_parameters, is_moe_layer
from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.params import local_numel

ROW_PURPOSES = ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward")


def predict_moe_all_to_all(moe_record: dict, hidden: int, act_bytes: int, ranks: int,
                           micro_batches: int, experts: int) -> dict[str, int]:
    """Bytes per purpose, summed over `ranks` (the data ranks that route), for one step with
    `micro_batches` micro-batches per rank, from the step's `moe` metrics record."""
    rows = 0
    for stats in moe_record.values():
        routed = sum(stats["tokens_per_expert"])
        rows += round(routed * (1 - stats["dropped_fraction"]))
    out = {purpose: rows * hidden * act_bytes for purpose in ROW_PURPOSES}
    out["moe_counts"] = ranks * len(moe_record) * micro_batches * experts * 8
    return out


def token_split_records(cfg: Config, lay: ParallelPlan, layers: list[int], dtype: str,
                        elem_bytes: int) -> list[tuple[str, str, int, str, int, str]]:
    """(op, mesh dim, size, dtype, bytes, purpose) of one micro-batch on a rank holding blocks
    `layers`, per MoE layer: with the balancing loss, the all-reduce of the assignments per
    expert over the ranks that split the micro-batch (int64; again in recomputation's
    forward); over tp, the router's and shared experts' gradients all-reduced in `dtype`
    and, without sequence parallelism, the all-gather of the layer's output shares and of
    its input gradient's."""
    moe, out = cfg.model.moe, []
    split = 1
    for axis in lay.token_split_axes:
        split *= lay.cp if axis == "cp" else lay.tp
    if moe is None or split == 1:
        return out
    passes = 2 if lay.recompute != "none" else 1
    act = lay.micro_batch * cfg.model.seq_len // lay.cp * cfg.model.hidden * elem_bytes
    for layer in (i for i in layers if is_moe_layer(cfg.model, i)):
        if moe.aux_loss_weight:
            out += [("all_reduce", "+".join(lay.token_split_axes), split, "int64",
                     moe.experts * 8, "moe_balance")] * passes
        if "tp" in lay.token_split_axes:
            out += [("all_reduce", "tp", lay.tp, dtype,
                     local_numel(cfg.model, p, 1, lay.ep) * elem_bytes, "moe_sp_grads")
                    for p in block_parameters(cfg.model, layer)
                    if p.part in MOE_PARTS and p.part != "experts"]
        if "tp" in lay.token_split_axes and not lay.sequence_parallel:
            # once: nothing in the block saves the gathered output, so recomputation's
            # forward stops before it (torch.utils.checkpoint's early stop)
            out += [("all_gather", "tp", lay.tp, dtype, act, "moe_tp_tokens"),
                    ("all_gather", "tp", lay.tp, dtype, act, "moe_tp_tokens_grad")]
    return out
