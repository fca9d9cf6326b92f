"""Resuming a checkpoint under another layout: the weights and AdamW's state, resharded.

A checkpoint keys its tensors by the layout that wrote it (fivefold.train.checkpoint): flat
ZeRO units cut into `shard{r}of{n}` pieces, tp shards with padded vocabulary rows, pipeline
stages (and their virtual stages) each with its own root unit. None of that survives a change
of dp, tp, pp, vpp, stage split, cp or ZeRO stage and group, so DCP's own resharding, which
matches a tensor's key and cuts its saved chunks to the loader's, does not apply: the keys
themselves change, and a flat unit holds other parameters under another tp or pp degree.
What every layout shares is the whole model by parameter name, and that is the exchange
format here, in two halves:

1. Read (`read_whole_state`): each rank reads from the files, with no collective, the
   whole-model tensors of the parameters it will hold: fp32 master weights and AdamW's
   `exp_avg` and `exp_avg_sq`, joined over the old layout's shards, units and tp ranks by
   fivefold.train.checkpoint_export (the reader `fivefold convert` uses), and the step count,
   checked to be the same for every parameter.
2. Place (`load_resharded`): the data-parallel engine lays each of its units out flat and
   keeps this rank's shard, after `shard_tensor`, the function that splits a fresh model
   over tp, has cut this rank's tp part (padding vocabulary rows with zeros, which is what
   AdamW keeps in them); a one-rank run copies into its plain model and torch's AdamW.

AdamW's state is per element, so a moment reshards exactly like its parameter: after the
move every element of weights and moments equals the old one bit for bit
(tests/test_resharding.py). The data position needs nothing: it is the step, and a step's
global batch is the same whatever dp (fivefold.train.data). RNG states and the gradient
scaler are rank 0's on every rank (the old layout's other ranks need not exist; a training
step draws no random numbers).

Cost: each rank holds the whole fp32 weights and moments of its own parameters (its pipeline
stage's, all tp shards of them) once, in host memory, while it loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.hf import CheckpointError
from fivefold.parallel.data_parallel import DataParallelEngine
from fivefold.parallel.tensor import shard_tensor
from fivefold.train.checkpoint import load_rank_extra
from fivefold.train.checkpoint_export import read_training_state
from fivefold.train.dist import Runtime


def read_whole_state(path: Path, cfg: ModelConfig, names: set[str]
                     ) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """(kind -> name -> whole tensor for "master", "exp_avg", "exp_avg_sq"; the AdamW step
    count) of the parameters `names` in checkpoint `path`."""
    state = read_training_state(path, cfg, names=names)
    missing = names - state["master"].keys()
    if missing:
        raise CheckpointError(str(path), f"holds no {sorted(missing)[0]} ({len(missing)} "
                                         "parameter(s) of this run are missing)")
    steps = state.pop("step")
    counts = {float(s) for s in steps.values()}
    if len(counts) != 1:
        raise CheckpointError(str(path), f"its parameters' AdamW step counts differ: "
                                         f"{sorted(counts)}")
    return state, next(iter(steps.values())).float()


@torch.no_grad()
def place_in_plain(model: nn.Module, optimizer: torch.optim.Optimizer,
                   whole: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
    """A one-rank run's parameters and torch AdamW's state from whole-model tensors."""
    names = {id(q): n for n, q in model.named_parameters()}
    for group in optimizer.param_groups:
        step_device = group["params"][0].device if group.get("fused") else "cpu"
        for param in group["params"]:
            name = names[id(param)]
            param.copy_(whole["master"][name])
            optimizer.state[param] = {"step": step.clone().to(step_device),
                                      "exp_avg": whole["exp_avg"][name].to(param).clone(),
                                      "exp_avg_sq": whole["exp_avg_sq"][name].to(param).clone()}


def load_resharded(rt: Runtime, path: Path, cfg: ModelConfig, model: nn.Module,
                   engine: DataParallelEngine | None, optimizer: torch.optim.Optimizer | None,
                   tp_size: int, tp_rank: int) -> dict:
    """Take checkpoint `path`, written under another layout, into this rank's `engine` (or,
    on one plain rank, `model` and `optimizer`); return rank 0's extra state (RNG restored)."""
    if engine:
        names = {name for unit in engine.units for name in unit.names}
        whole, step = read_whole_state(path, cfg, names)
        engine.load_whole_state(whole, step,
                                lambda name, full: shard_tensor(name, full, tp_size, tp_rank))
    else:
        whole, step = read_whole_state(path, cfg, {n for n, _ in model.named_parameters()})
        place_in_plain(model, optimizer, whole, step)
    return load_rank_extra(rt, path, 0)


def describe_change(saved: dict, now: dict, keys: list[str]) -> str:
    """"dp 4, tp 1 to dp 2, tp 2": the layout keys that differ, before and after."""
    def side(layout):
        return ", ".join(f"{key.removeprefix('parallel.')} {layout[key]}" for key in keys)
    return f"{side(saved)} to {side(now)}"
