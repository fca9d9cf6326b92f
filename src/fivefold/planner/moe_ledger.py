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
"""

from __future__ import annotations

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
