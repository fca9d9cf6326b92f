"""A training checkpoint read back as the whole model: its model config and state dict.

What `fivefold convert` and `--init-from` (fivefold.train.model_source) read from a run:
RUN_DIR/checkpoints/step_N, or RUN_DIR for its latest one. These are the DCP files of
fivefold.train.checkpoint. A one-rank run stores the model's tensors by name under `model.`;
the data-parallel engine stores each unit (the root, then one per block) as one flat fp32
buffer cut into `shard{r}of{n}` pieces, the unit's parameters laid end to end with the
padding at the end (fivefold.parallel.flat_unit), which are joined and cut back into
parameters here. With pipeline or tensor parallelism the keys also carry the rank that holds
them, `.pp{p}of{P}` then `.tp{t}of{T}` (fivefold.train.trainer): each pp rank's units are
those of its stage (fivefold.parallel.pipeline.stage: the root holds what the stage has of the
embedding, final norm and head; blocks keep their global index), and each tp rank's
parameters are its shards (fivefold.parallel.tensor). On the experts' grid each (ep, etp)
rank's experts are a unit of their own, `layers.i.experts{e}of{E}[x{t}of{T}]`, whose edp
shards may sit under any tp rank's tag (fivefold.train.expert_checkpoint). The reader rebuilds
each (pp, tp) rank's and each (pp, ep, etp) rank's model on the meta device the way the run
built it, so it cuts every buffer by the runtime's own unit layout, joins the tp shards with
`unshard_tensor` and the experts' etp columns and ep rows with `join_expert_parts`.

`read_training_state` reads the optimizer's state the same way: the engine stores each
unit's AdamW moments `exp_avg` and `exp_avg_sq` as flat buffers cut like the master weights
and its step count once per shard (with Muon, each parameter's state whole under its own
name: `momentum_buffer.layers.0.attention.wq.weight.shard0of1`), a one-rank run stores
torch's per-parameter state under `optim.state.`.
A resume under another layout (fivefold.train.reshard) reads, on each rank, only the units
that hold the parameters that rank needs.

It lives in train/, not beside the Hugging Face reader in fivefold.models.pretrained, because
it needs the runtime's layouts (parallel/, comm/, the checkpoint files), which models/ must
not import. Every tensor is checked against the shapes the model config implies.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.config import ModelConfig, MoEConfig
from fivefold.models.hf import CheckpointError
from fivefold.models.llama import Transformer
from fivefold.models.pretrained import Pretrained, check_state
from fivefold.parallel.pipeline.partition import stage_ids_of_rank, stage_layer_ranges
from fivefold.parallel.pipeline.schedules import V_SCHEDULES
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.tensor import apply_tensor_parallel, unshard_tensor
from fivefold.train.checkpoint import latest_checkpoint
from fivefold.train.expert_checkpoint import (BIAS_KEYS, is_expert_unit, join_expert_parts,
                                              rank_units, saved_grid)


def is_training_run(path: Path) -> bool:
    """A run directory (it has checkpoints/) or one checkpoint step folder (meta.json)."""
    return (path / "meta.json").is_file() or (path / "checkpoints").is_dir()


def checkpoint_step(path: Path) -> Path:
    """The step folder `path` names, or the latest finished one of the run at `path`."""
    if (path / "meta.json").is_file():
        return path
    step = latest_checkpoint(path)
    if step is None:
        raise CheckpointError(str(path), "holds no finished checkpoint under checkpoints/")
    return step


def checkpoint_model_config(path: Path) -> ModelConfig:
    """The model config the run at `path` (or its step folder) trained, from meta.json."""
    step = checkpoint_step(Path(path))
    raw = json.loads((step / "meta.json").read_text()).get("config", {}).get("model")
    try:
        raw = {k: v for k, v in raw.items() if v is not None}
        moe = raw.pop("moe", None)
        return ModelConfig(**raw, moe=MoEConfig(**moe) if moe else None)
    except (AttributeError, TypeError) as err:
        raise CheckpointError(str(step / "meta.json"), f"holds no readable model config: {err}")


def read_checkpoint(path: Path) -> Pretrained:
    """Config and whole-model tensors of the run at `path` (or its step folder)."""
    step = checkpoint_step(Path(path))
    cfg = checkpoint_model_config(step)
    state = _read_checkpoint_tensors(step, cfg)
    check_state(state, cfg, str(step))
    return Pretrained(cfg, state, None, step)


def _read_checkpoint_tensors(step: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return read_training_state(step, cfg, optimizer=False)[0]


def read_training_state(step: Path, cfg: ModelConfig, names: set[str] | None = None,
                        optimizer: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(weights, optimizer state) of the checkpoint at `step` as the whole model holds them,
    before any layout split them: each parameter's fp32 weights by name, and its optimizer
    state by name and kind (AdamW's "exp_avg", "exp_avg_sq" and "step", Muon's
    "momentum_buffer"; nothing under LOMO). `names`: only the parameters named (and only the
    units that hold them are read), what one rank of another layout needs
    (fivefold.train.reshard); `optimizer=False`: the weights alone."""
    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    tensors = {key: m for key, m in meta.items() if hasattr(m, "size")}
    if any(key.startswith("model.") for key in tensors):
        return _read_named(step, tensors, names, optimizer)
    if not any(key.startswith("master.") for key in tensors):
        raise CheckpointError(str(step), "holds neither model.* nor master.* tensors")
    parallel = json.loads((step / "meta.json").read_text()).get("config", {}).get("parallel")
    units = _flat_units(tensors, cfg, step, parallel, names)
    unit_tags = {(tag, unit) for tag, unit, *_ in units}
    param_tags = {(tag, name) for tag, _, params, _ in units for name, _ in params}
    empty, kinds, per_param = {}, set(), []
    for key, m in tensors.items():
        match = SHARD_KEY.fullmatch(key)
        if not match or (match["kind"] != "master" and not optimizer):
            continue
        where = (_unit_tag(match["tag"], match["of"]), match["of"])
        if where in unit_tags:  # a flat unit's weights or AdamW moments
            kinds.add(match["kind"])
        elif where in param_tags:  # a parameter's own state (Muon's path: whole tensors)
            per_param.append((key, match))
        else:
            continue
        empty[key] = torch.empty(m.size, dtype=m.properties.dtype)
    _load(empty, step)
    weights = _join_units(empty, units, "master", cfg, step)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for kind in sorted(kinds - {"master"}):
        for name, tensor in _join_units(empty, units, kind, cfg, step).items():
            states.setdefault(name, {})[kind] = tensor
    for key, match in per_param:
        if match["n"] != "1":
            raise CheckpointError(str(step), f"{key}: a parameter's own state is whole (one "
                                             "shard)")
        states.setdefault(match["of"], {})[match["kind"]] = empty[key]
    return weights, states


# an engine key: what, of which unit or parameter, which data-parallel shard, which rank
SHARD_KEY = re.compile(r"(?P<kind>\w+)\.(?P<of>.+)\.shard(?P<r>\d+)of(?P<n>\d+)"
                       r"(?P<tag>(?:\.pp\d+of\d+)?(?:\.tp\d+of\d+)?)")


def _unit_tag(tag: str, unit: str) -> str:
    """The rank tag a unit is listed under: an expert unit's without its tp part (its edp
    shards sit under any tp rank's, fivefold.train.expert_checkpoint)."""
    return re.sub(r"\.tp\d+of\d+", "", tag) if is_expert_unit(unit) else tag


def _load(state: dict, step: Path) -> None:
    """Read `state`'s tensors from the files on this rank alone (`no_dist`: no collective, so
    each rank of a run may read other tensors, or none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended here
        dcp.load(state, checkpoint_id=step, no_dist=True)


def _read_named(step: Path, tensors: dict, names: set[str] | None, optimizer: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A one-rank run's state: the model's tensors by name under `model.`, torch's optimizer
    state under `optim.state.{name}.{kind}`."""
    def empty(key):
        return torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype)

    params = [key.removeprefix("model.") for key in tensors if key.startswith("model.")]
    params = [n for n in params if names is None or n in names]
    nested = {"model": {n: empty(f"model.{n}") for n in params}, "optim": {"state": {}}}
    for n in params if optimizer else ():
        prefix = f"optim.state.{n}."
        nested["optim"]["state"][n] = {key.removeprefix(prefix): empty(key) for key in tensors
                                       if key.startswith(prefix)
                                       and "." not in key.removeprefix(prefix)}
    _load(nested, step)
    return nested["model"], {n: s for n, s in nested["optim"]["state"].items() if s}


def _rank_degree(keys, axis: str, step: Path) -> int:
    """The degree of mesh axis `axis` ("pp" or "tp") that the keys' rank tags name, else 1."""
    sizes = {int(n) for key in keys for n in re.findall(rf"\.{axis}\d+of(\d+)", key)}
    if len(sizes) > 1:
        raise CheckpointError(str(step), f"its keys name {axis} degrees {sorted(sizes)}; a "
                                         "checkpoint is written by one layout")
    return sizes.pop() if sizes else 1


def _rank_model(cfg: ModelConfig, pp: int, pp_rank: int, tp: int, tp_rank: int,
                parallel: dict | None, step: Path) -> nn.Module:
    """The model (pp = 1) or pipeline stage of one (pp, tp) rank, on the meta device, split
    over tp as the run split it: its parameters have the shapes and order the run's units had."""
    with torch.device("meta"):
        if pp == 1:
            model = Transformer(cfg)
        else:
            if not isinstance(parallel, dict):
                raise CheckpointError(str(step / "meta.json"), "holds no parallel config, "
                                      "which a pipeline checkpoint needs to cut its stages")
            vpp = parallel.get("vpp") or 1
            try:
                ranges = stage_layer_ranges(cfg, pp * vpp, parallel.get("stage_layers"))
            except ValueError as err:
                raise CheckpointError(str(step / "meta.json"), f"parallel config: {err}")
            v_shape = parallel.get("schedule") in V_SCHEDULES
            model = PipelineStage(cfg, stage_ids_of_rank(pp, vpp, pp_rank, v_shape), ranges)
        if tp > 1:  # shapes only: no collective runs while splitting
            apply_tensor_parallel(model, Axis("tp", None, tp, tp_rank, None), False)
    return model


def _flat_units(keys, cfg: ModelConfig, step: Path, parallel: dict | None,
                names: set[str] | None = None) -> list[tuple[str, str, list, tuple | None]]:
    """(rank tag, unit name, named parameters, grid place) of every non-empty unit that the
    keys name, holding any of `names` (None: all), rebuilt on the meta device
    (fivefold.train.expert_checkpoint `rank_units`): the dense units of every (pp, tp) rank,
    the expert units of every (pp, ep, etp) rank, their place (ep rank, etp rank) and a tag
    without tp (the dense units' place: None)."""
    pp, tp = _rank_degree(keys, "pp", step), _rank_degree(keys, "tp", step)
    grid = saved_grid(keys, step)
    units = []
    for pp_rank in range(pp):
        pp_tag = f".pp{pp_rank}of{pp}" if pp > 1 else ""
        for tp_rank in range(tp):
            tag = pp_tag + (f".tp{tp_rank}of{tp}" if tp > 1 else "")
            for place in grid.ranks() if tp_rank == 0 else [(0, 0)]:
                model = _rank_model(cfg, pp, pp_rank, tp, tp_rank, parallel, step)
                for unit, params, expert in rank_units(model, grid, *place):
                    if expert and tp_rank:  # tp leaves the experts whole: listed once
                        continue
                    if params and (names is None or any(n in names for n, _ in params)):
                        units.append((pp_tag if expert else tag, unit, params,
                                      place if expert else None))  # a middle stage's root: none
    return units


def _join_flat_units(flat: dict[str, torch.Tensor], cfg: ModelConfig, step: Path,
                     parallel: dict | None = None) -> dict[str, torch.Tensor]:
    """Parameters from the engine's `master.{unit}.shard{r}of{n}[.pp{p}of{P}][.tp{t}of{T}]`
    buffers; `parallel` is the run's parallel config (for the stages of pp > 1)."""
    return _join_units(flat, _flat_units(flat, cfg, step, parallel), "master", cfg, step)


def _join_units(flat: dict[str, torch.Tensor], units: list, kind: str, cfg: ModelConfig,
                step: Path) -> dict[str, torch.Tensor]:
    """Each parameter's whole `kind` tensor ("master", "exp_avg", "exp_avg_sq": cut from the
    units' flat buffers, a dense one joined over tp, an expert matrix from its grid places;
    "step": its unit's step count)."""
    tp, grid = _rank_degree(flat, "tp", step), saved_grid(flat, step)
    parts: dict[str, dict[tuple | None, list[torch.Tensor]]] = {}  # name -> place -> shards
    for tag, unit, params, place in units:
        for name, tensor in _cut_unit(flat, kind, unit, tag, params, step, place is not None):
            parts.setdefault(name, {}).setdefault(place, []).append(tensor)
    state = {}
    for name, by_place in parts.items():
        if kind == "step":
            state[name] = next(iter(by_place.values()))[0]
            continue
        held = {place: len(shards) for place, shards in by_place.items()}
        if None not in by_place and set(held.values()) == {1}:
            state[name] = join_expert_parts(name, {p: s[0] for p, s in by_place.items()},
                                            grid, step)
        elif list(held) == [None] and held[None] == tp:
            state[name] = (by_place[None][0] if tp == 1 else
                           unshard_tensor(name, by_place[None], cfg.vocab))
        else:
            raise CheckpointError(str(step), f"{name} is held {held[None] if None in held else 0}"
                                             f" time(s) over {tp} tp rank(s) and at "
                                             f"{len(held) - (None in held)} expert grid place(s)")
    return state


def _cut_unit(flat: dict[str, torch.Tensor], kind: str, unit: str, tag: str, params,
              step: Path, any_tp: bool = False):
    """(name, tensor) of each parameter of unit `unit` of the rank tagged `tag`, cut from its
    joined `{kind}.{unit}.shard{r}of{n}` pieces (`any_tp`: an expert unit's, whose pieces
    sit under any tp rank's tag, fivefold.train.expert_checkpoint); for "step", the unit's
    count (the same in every piece)."""
    tp_part = r"(?:\.tp\d+of\d+)?" if any_tp else ""
    pattern = re.compile(rf"{kind}\.{re.escape(unit)}\.shard(\d+)of(\d+){re.escape(tag)}{tp_part}")
    found: dict[int, tuple[int, str]] = {}
    for k in flat:  # an expert unit's shard may be under several tp tags: equal copies
        if m := pattern.fullmatch(k):
            found.setdefault(int(m.group(1)), (int(m.group(2)), k))
    n = next(iter(found.values()), (0, ""))[0]
    if not n or sorted(found) != list(range(n)):
        raise CheckpointError(str(step), f"{kind} of unit {unit}{tag}: shards {sorted(found)} "
                                         "do not cover it")
    pieces = [flat[found[r][1]] for r in range(n)]
    if kind == "step":
        if any(not torch.equal(p, pieces[0]) for p in pieces):
            raise CheckpointError(str(step), f"unit {unit}{tag}: its shards' step counts differ")
        yield from ((name, pieces[0].clone()) for name, _ in params)
        return
    buffer = torch.cat(pieces)
    offset = 0
    for name, p in params:
        if offset + p.numel() > buffer.numel():
            raise CheckpointError(str(step), f"unit {unit}{tag} is smaller than its parameters")
        yield name, buffer[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()


def read_expert_biases(step: Path) -> dict[str, torch.Tensor]:
    """The routing bias of every MoE block ("layers.i": (X,) fp32) in checkpoint `step`, from
    the engine's `expert_bias.layers.i` or one plain rank's `model.layers.i.mlp.expert_bias`
    (fivefold.train.expert_checkpoint); empty where the model balances without them."""
    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    keys = {key: m.group(1) for key in meta for pattern in BIAS_KEYS
            if (m := pattern.fullmatch(key))}
    state = {key: torch.empty(meta[key].size, dtype=meta[key].properties.dtype) for key in keys}
    if state:
        _load(state, step)
    return {block: state[key] for key, block in keys.items()}
