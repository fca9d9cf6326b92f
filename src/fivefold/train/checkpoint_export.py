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
parameters are its shards (fivefold.parallel.tensor). The reader rebuilds each rank's model on
the meta device the way the run built it, so it cuts every buffer by the runtime's own unit
layout, and joins the tp shards with `unshard_tensor`.

`read_training_state` reads AdamW's state the same way: the engine stores each unit's
moments `exp_avg` and `exp_avg_sq` as flat buffers cut like the master weights and its step
count once per shard, a one-rank run stores torch's per-parameter state under `optim.state.`.
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
from fivefold.parallel.data_parallel import split_units
from fivefold.parallel.pipeline.partition import stage_ids_of_rank, stage_layer_ranges
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.tensor import apply_tensor_parallel, unshard_tensor
from fivefold.train.checkpoint import latest_checkpoint

# what a resume under another layout carries over: the weights and AdamW's state
TRAINING_STATE = ("master", "exp_avg", "exp_avg_sq", "step")


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
    return read_training_state(step, cfg, ("master",))["master"]


def read_training_state(step: Path, cfg: ModelConfig, kinds: tuple[str, ...] = TRAINING_STATE,
                        names: set[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Whole-model tensors of the checkpoint at `step`, by kind and parameter name: "master"
    (the fp32 weights), and AdamW's per-parameter "exp_avg", "exp_avg_sq" and "step" (each
    parameter's step count), as the run held them before any layout split them. `names`:
    read only the parameters named (the units that hold them): what one rank of another
    layout needs (fivefold.train.reshard)."""
    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    tensors = {key: m for key, m in meta.items() if hasattr(m, "size")}
    if any(key.startswith("model.") for key in tensors):
        return _read_named(step, tensors, kinds, names)
    if not any(key.startswith("master.") for key in tensors):
        raise CheckpointError(str(step), "holds neither model.* nor master.* tensors")
    parallel = json.loads((step / "meta.json").read_text()).get("config", {}).get("parallel")
    units = _flat_units(tensors, cfg, step, parallel, names)
    pattern = re.compile(rf"({'|'.join(kinds)})\.(.+)\.shard\d+of\d+((?:\.pp\d+of\d+)?"
                         r"(?:\.tp\d+of\d+)?)")
    wanted = {(tag, unit) for tag, unit, _ in units}
    empty = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in tensors.items()
             if (match := pattern.fullmatch(key)) and (match[3], match[2]) in wanted}
    _load(empty, step)
    return {kind: _join_units(empty, units, kind, cfg, step) for kind in kinds}


def _load(state: dict, step: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended here
        dcp.load(state, checkpoint_id=step)


def _read_named(step: Path, tensors: dict, kinds: tuple[str, ...], names: set[str] | None
                ) -> dict[str, dict[str, torch.Tensor]]:
    """A one-rank run's state: the model's tensors by name under `model.`, torch AdamW's
    state under `optim.state.{name}.{exp_avg, exp_avg_sq, step}`."""
    def empty(key):
        return torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype)

    params = [key.removeprefix("model.") for key in tensors if key.startswith("model.")]
    params = [n for n in params if names is None or n in names]
    nested = {"model": {n: empty(f"model.{n}") for n in params} if "master" in kinds else {},
              "optim": {"state": {}}}
    for n in params:
        moments = {k: empty(f"optim.state.{n}.{k}") for k in kinds
                   if k != "master" and f"optim.state.{n}.{k}" in tensors}
        if len(moments) != len(kinds) - ("master" in kinds):
            raise CheckpointError(str(step), f"holds no AdamW state for {n} (another optimizer, "
                                             "or LOMO, which keeps none)")
        nested["optim"]["state"][n] = moments
    _load(nested, step)
    return {kind: nested["model"] if kind == "master" else
            {n: nested["optim"]["state"][n][kind] for n in params} for kind in kinds}


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
            model = PipelineStage(cfg, stage_ids_of_rank(pp, vpp, pp_rank), ranges)
        if tp > 1:  # shapes only: no collective runs while splitting
            apply_tensor_parallel(model, Axis("tp", None, tp, tp_rank, None), False)
    return model


def _flat_units(keys, cfg: ModelConfig, step: Path, parallel: dict | None,
                names: set[str] | None = None) -> list[tuple[str, str, list]]:
    """(rank tag, unit name, named parameters) of every non-empty unit of every (pp, tp) rank
    that the keys' tags name, holding any of `names` (None: all), rebuilt on the meta device."""
    pp, tp = _rank_degree(keys, "pp", step), _rank_degree(keys, "tp", step)
    units = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model = _rank_model(cfg, pp, pp_rank, tp, tp_rank, parallel, step)
            tag = (f".pp{pp_rank}of{pp}" if pp > 1 else "") + (f".tp{tp_rank}of{tp}"
                                                                if tp > 1 else "")
            for unit, params, _ in split_units(model):
                if params and (names is None or any(n in names for n, _ in params)):
                    units.append((tag, unit, params))  # a middle stage's root holds nothing
    return units


def _join_flat_units(flat: dict[str, torch.Tensor], cfg: ModelConfig, step: Path,
                     parallel: dict | None = None) -> dict[str, torch.Tensor]:
    """Parameters from the engine's `master.{unit}.shard{r}of{n}[.pp{p}of{P}][.tp{t}of{T}]`
    buffers; `parallel` is the run's parallel config (for the stages of pp > 1)."""
    return _join_units(flat, _flat_units(flat, cfg, step, parallel), "master", cfg, step)


def _join_units(flat: dict[str, torch.Tensor], units: list, kind: str, cfg: ModelConfig,
                step: Path) -> dict[str, torch.Tensor]:
    """Each parameter's whole `kind` tensor ("master", "exp_avg", "exp_avg_sq": cut from the
    units' flat buffers and joined over tp; "step": its unit's step count)."""
    tp = _rank_degree(flat, "tp", step)
    parts: dict[str, list[torch.Tensor]] = {}  # name -> its tp shards, in tp rank order
    for tag, unit, params in units:
        for name, tensor in _cut_unit(flat, kind, unit, tag, params, step):
            parts.setdefault(name, []).append(tensor)
    state = {}
    for name, shards in parts.items():
        if len(shards) != tp:
            raise CheckpointError(str(step), f"{name} is held {len(shards)} times over {tp} tp "
                                             "rank(s)")
        state[name] = (shards[0] if kind == "step" or tp == 1 else
                       unshard_tensor(name, shards, cfg.vocab))
    return state


def _cut_unit(flat: dict[str, torch.Tensor], kind: str, unit: str, tag: str, params,
              step: Path):
    """(name, tensor) of each parameter of unit `unit` of the rank tagged `tag`, cut from its
    joined `{kind}.{unit}.shard{r}of{n}` pieces; for "step", the unit's count (the same in
    every piece)."""
    pattern = re.compile(rf"{kind}\.{re.escape(unit)}\.shard(\d+)of(\d+){re.escape(tag)}")
    found = {int(m.group(1)): int(m.group(2)) for k in flat if (m := pattern.fullmatch(k))}
    n = next(iter(found.values()), 0)
    if not n or sorted(found) != list(range(n)):
        raise CheckpointError(str(step), f"{kind} of unit {unit}{tag}: shards {sorted(found)} "
                                         "do not cover it")
    pieces = [flat[f"{kind}.{unit}.shard{r}of{n}{tag}"] for r in range(n)]
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
