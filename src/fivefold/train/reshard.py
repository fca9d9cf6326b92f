"""Resuming a checkpoint under another layout: the weights and the optimizer state, resharded.

A checkpoint keys its tensors by the layout that wrote it (fivefold.train.checkpoint): flat
ZeRO units cut into `shard{r}of{n}` pieces, tp shards with padded vocabulary rows, pipeline
stages (and their virtual stages) each with its own root unit. None of that survives a change
of dp, tp, pp, vpp, stage split, cp or ZeRO stage and group, so DCP's own resharding, which
matches a tensor's key and cuts its saved chunks to the loader's, does not apply: the keys
themselves change, and a flat unit holds other parameters under another tp or pp degree.
What every layout shares is the whole model by parameter name, and that is the exchange
format here, in two halves:

1. Read (`read_whole_state`): each rank reads from the files, with no collective, the
   whole-model tensors of the parameters it will hold: fp32 master weights and their
   optimizer state (AdamW's `exp_avg`, `exp_avg_sq` and step count, Muon's momentum),
   joined over the old layout's shards, units and tp ranks by
   fivefold.train.checkpoint_export (the reader `fivefold convert` uses); the step count is
   checked to be the same for every parameter.
2. Place (`load_resharded`): the data-parallel engine lays each of its units out flat and
   keeps this rank's shard, after `shard_tensor`, the function that splits a fresh model
   over tp, has cut this rank's tp part (padding vocabulary rows with zeros, which is what
   AdamW keeps in them) and, on the experts' grid, `expert_part` its ep rank's experts and
   etp rank's columns of them; a one-rank run copies into its plain model and torch's
   optimizer.

AdamW's state is per element, so a moment reshards exactly like its parameter; Muon runs
where every rank holds whole matrices (ZeRO stage 0, no tp), so its momentum moves whole.
After the move every element of weights and optimizer state equals the old one bit for bit
(tests/test_resharding.py). The data position needs nothing: it is the step, and a step's
global batch is the same whatever dp (fivefold.train.data). RNG states and the gradient
scaler are rank 0's on every rank (the old layout's other ranks need not exist; a training
step draws no random numbers).

Cost: each rank holds the whole fp32 weights and optimizer state of its own parameters (its
pipeline stage's, all tp shards of them) once, in host memory, while it loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.config import ModelConfig
from fivefold.models.hf import CheckpointError
from fivefold.parallel.data_parallel import DataParallelEngine
from fivefold.parallel.mesh import ExpertAxes
from fivefold.parallel.tensor import shard_tensor
from fivefold.train.checkpoint import load_rank_extra
from fivefold.train.checkpoint_export import read_expert_biases, read_training_state
from fivefold.train.expert_checkpoint import expert_part, place_expert_biases
from fivefold.train.dist import Runtime


def read_whole_state(path: Path, cfg: ModelConfig, names: set[str]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]],
                                torch.Tensor]:
    """(weights, optimizer state by name and kind, AdamW's step count) of the parameters
    `names` in checkpoint `path`; the step count is checked to be every parameter's."""
    weights, states = read_training_state(path, cfg, names=names)
    missing = sorted(names - (weights.keys() & states.keys()))
    if missing:
        raise CheckpointError(str(path), f"holds no weights or optimizer state for {missing[0]}"
                                         f" ({len(missing)} parameter(s) of this run)")
    steps = [state["step"] for state in states.values() if "step" in state]
    counts = {float(s) for s in steps}
    if len(counts) != 1:
        raise CheckpointError(str(path), f"its parameters' AdamW step counts differ: "
                                         f"{sorted(counts)}")
    return weights, states, steps[0].float()


@torch.no_grad()
def place_in_plain(model: nn.Module, optimizer, weights: dict[str, torch.Tensor],
                   states: dict[str, dict[str, torch.Tensor]]) -> None:
    """A one-rank run's parameters and torch optimizer state (AdamW, or Muon and AdamW as
    fivefold.optim.OptimizerPair) from whole-model tensors."""
    names = {id(q): n for n, q in model.named_parameters()}
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for group in opt.param_groups:
            for param in group["params"]:
                name = names[id(param)]
                param.copy_(weights[name])
                step_device = param.device if group.get("fused") else "cpu"
                opt.state[param] = {kind: tensor.to(step_device if kind == "step" else
                                                    param.device).clone()
                                    for kind, tensor in states[name].items()}


def load_resharded(rt: Runtime, path: Path, cfg: ModelConfig, model: nn.Module,
                   engine: DataParallelEngine | None, optimizer, tp_axis: Axis,
                   expert_axes: ExpertAxes | None = None) -> dict:
    """Take checkpoint `path`, written under another layout, into this rank's `engine` (or,
    on one plain rank, `model` and `optimizer`); this rank holds its `tp_axis` rank's part and,
    on the experts' grid (`expert_axes`, as the trainer holds them), its ep rank's experts and
    its etp rank's columns of them. Return rank 0's extra state (RNG restored)."""
    tp_size, tp_rank = tp_axis.size, tp_axis.rank
    grid = ((expert_axes.ep.size, expert_axes.ep.rank, expert_axes.etp.size,
             expert_axes.etp.rank) if expert_axes else (1, 0, 1, 0))
    if engine:
        names = {name for unit in engine.units for name in unit.names}
        weights, states, step = read_whole_state(path, cfg, names)

        def local(name, full):
            return shard_tensor(name, expert_part(name, full, *grid), tp_size, tp_rank)

        engine.load_whole_state(weights, states, step, local)
    else:
        names = {n for n, _ in model.named_parameters()}
        weights, states, _ = read_whole_state(path, cfg, names)
        place_in_plain(model, optimizer, weights, states)
    place_expert_biases(model, read_expert_biases(path), path)
    return load_rank_extra(rt, path, 0)


def describe_change(saved: dict, now: dict, keys: list[str]) -> str:
    """"dp 4, tp 1 to dp 2, tp 2": the layout keys that differ, before and after."""
    def side(layout):
        return ", ".join(f"{key.removeprefix('parallel.')} {layout[key]}" for key in keys)
    return f"{side(saved)} to {side(now)}"
