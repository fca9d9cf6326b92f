"""Per-step load statistics of every MoE layer, and the auxiliary-loss-free bias update.

After each optimizer step the trainer calls `moe_step(model, token_axis)`: each MoE layer's
assignments per expert, dropped assignments and auxiliary-loss sum (fivefold.models.moe)
are summed over the ranks that route different tokens (one all-reduce over the token axis,
purpose "moe_load"), so every rank sees the whole global batch's load; with
`bias_update_rate` > 0 every rank then moves each expert's routing bias by the rate towards
the mean load, b_e += rate * sign(mean load - load_e) (DeepSeek-V3, arXiv 2412.19437,
Sec. 2.1.2), identically. The returned record, per layer: tokens_per_expert (assignments),
dropped_fraction, imbalance (max / mean load) and aux_loss (per token of the batch).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm.collectives import Axis
from fivefold.models.moe import MoE


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(block name "layers.i", its MoE) of every MoE layer this rank holds."""
    return [(name.removesuffix(".mlp"), m) for name, m in model.named_modules()
            if isinstance(m, MoE)]


@torch.no_grad()
def moe_step(model: nn.Module, token_axis: Axis, rate: float, tokens: int) -> dict:
    """Reduce, record and reset the step's load statistics; update the biases (`rate`).
    `tokens`: the global batch's tokens (the aux loss is logged per token)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    rows = [torch.cat([m.load.double().cpu(), torch.tensor([m.dropped, m.aux_sum],
                                                           dtype=torch.float64)])
            for _, m in layers]
    device = layers[0][1].expert_bias.device
    table = torch.stack(rows).to(device)
    C.all_reduce(table, token_axis, "moe_load")
    out = {}
    for (name, m), row in zip(layers, table.cpu()):
        load, dropped, aux = row[:m.experts], row[m.experts].item(), row[m.experts + 1].item()
        total = load.sum().item()
        out[name] = {"tokens_per_expert": [int(v) for v in load.tolist()],
                     "dropped_fraction": dropped / total if total else 0.0,
                     "imbalance": load.max().item() / (total / m.experts) if total else 0.0,
                     "aux_loss": aux / tokens}
        if rate and m.balance_bias and total:
            step = rate * torch.sign(total / m.experts - load).to(m.expert_bias)
            m.expert_bias.add_(step)
        m.reset_stats()
    return out
