"""Pretrained weights in and out of fivefold: the weights folder, `convert` and `--init-from`.

A fivefold weights folder is what `fivefold convert --to fivefold` writes:

    config.toml         a fivefold config file holding only the [model] table, every key set
    model.safetensors   the plain model's tensors by fivefold parameter name, stored dtype kept
    hf_config.json      the source's config.json, when converted from Hugging Face: export
                        restores its family, token ids and windows from it
    tokenizer files     copied from the source when it has them (TOKENIZER_FILES)

`load_pretrained` reads any of three sources, told apart by their files:

* a Hugging Face model folder (config.json), mapped by fivefold.models.hf;
* a fivefold weights folder (config.toml + model.safetensors);
* a training checkpoint: RUN_DIR/checkpoints/step_N, or RUN_DIR for its latest one. These
  are the DCP files of fivefold.train.checkpoint. A one-rank run stores the model's tensors
  by name under `model.`; the data-parallel engine stores each unit (the root, then one per
  block) as one flat fp32 buffer cut into `shard{r}of{n}` pieces, the unit's parameters laid
  end to end with the padding at the end (fivefold.parallel.flat_unit), which are joined and
  cut back into parameters here. With pipeline or tensor parallelism the keys also carry the
  rank that holds them, `.pp{p}of{P}` then `.tp{t}of{T}` (fivefold.train.trainer): each pp
  rank's units are those of its stage (fivefold.parallel.pipeline.stage: the root holds what
  the stage has of the embedding, final norm and head; blocks keep their global index), and
  each tp rank's parameters are its shards (fivefold.parallel.tensor). The reader rebuilds
  each rank's model on the meta device the way the run built it, so it cuts every buffer by
  the runtime's own unit layout, and joins the tp shards with `unshard_tensor`.

Every tensor is checked against the shapes the model config implies before it is used.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fivefold.config import ConfigError, ModelConfig, MoEConfig, load_config
from fivefold.models.description import parameters
from fivefold.models.hf import (SHARD_BYTES, CheckpointError, hf_config_from_model,
                                model_config_from_hf, model_fields, read_config_json,
                                read_hf_tensors, state_from_hf, state_to_hf, write_hf_tensors)
from fivefold.models.llama import Transformer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.toml"
HF_CONFIG_FILE = "hf_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


@dataclass
class Pretrained:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]  # fivefold parameter name -> tensor (stored dtype)
    hf_config: dict | None  # the Hugging Face config.json it came from, if any
    folder: Path  # where it was read, for its tokenizer files


# ------------------------------------------------------------------ reading

def source_kind(path: Path) -> str:
    """"hf", "fivefold" or "checkpoint", from the files `path` holds."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(str(path), "does not exist")
    if (path / "config.json").is_file():
        return "hf"
    if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return "fivefold"
    if (path / "meta.json").is_file() or (path / "checkpoints").is_dir():
        return "checkpoint"
    raise CheckpointError(str(path), "is not a model folder: it has no config.json (Hugging "
                                     f"Face), no {CONFIG_FILE} + {WEIGHTS_FILE} (fivefold "
                                     "weights) and no meta.json or checkpoints/ (training run)")


def read_model_config(path: Path) -> ModelConfig:
    """The model config of any source, without reading its tensors."""
    path = Path(path)
    kind = source_kind(path)
    if kind == "hf":
        return model_config_from_hf(read_config_json(path), str(path / "config.json"))
    if kind == "fivefold":
        return load_config(path / CONFIG_FILE).model
    step = _checkpoint_step(path)
    raw = json.loads((step / "meta.json").read_text()).get("config", {}).get("model")
    try:
        raw = {k: v for k, v in raw.items() if v is not None}
        moe = raw.pop("moe", None)
        return ModelConfig(**raw, moe=MoEConfig(**moe) if moe else None)
    except (AttributeError, TypeError) as err:
        raise CheckpointError(str(step / "meta.json"), f"holds no readable model config: {err}")


def load_pretrained(path: Path) -> Pretrained:
    """Config and tensors of a Hugging Face folder, a weights folder or a training checkpoint."""
    path = Path(path)
    kind = source_kind(path)
    cfg = read_model_config(path)
    hf_config = None
    if kind == "hf":
        hf_config = read_config_json(path)
        state = state_from_hf(read_hf_tensors(path), cfg, str(path))
    elif kind == "fivefold":
        state = load_file(path / WEIGHTS_FILE)
        if (path / HF_CONFIG_FILE).is_file():
            hf_config = json.loads((path / HF_CONFIG_FILE).read_text())
    else:
        path = _checkpoint_step(path)
        state = _read_checkpoint_tensors(path, cfg)
    check_state(state, cfg, str(path))
    return Pretrained(cfg, state, hf_config, path)


def check_state(state: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Raise naming the first missing, unexpected or misshapen tensor."""
    shapes = {p.name: p.shape for p in parameters(cfg)}
    missing = sorted(set(shapes) - set(state))
    extra = sorted(set(state) - set(shapes))
    if missing:
        raise CheckpointError(where, f"{len(missing)} tensor(s) the config implies are missing, "
                                     f"e.g. {missing[0]}")
    if extra:
        raise CheckpointError(where, f"{len(extra)} tensor(s) the config has no place for, "
                                     f"e.g. {extra[0]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(where, f"tensor {name} has shape {tuple(state[name].shape)}, "
                                         f"but the config implies {shape}")


def _checkpoint_step(path: Path) -> Path:
    from fivefold.train.checkpoint import latest_checkpoint

    if (path / "meta.json").is_file():
        return path
    step = latest_checkpoint(path)
    if step is None:
        raise CheckpointError(str(path), "holds no finished checkpoint under checkpoints/")
    return step


def _read_checkpoint_tensors(step: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    empty = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items()
             if key.startswith(("model.", "master.")) and hasattr(m, "size")}
    if not empty:
        raise CheckpointError(str(step), "holds neither model.* nor master.* tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended here
        if any(key.startswith("model.") for key in empty):
            nested = {"model": {k.removeprefix("model."): v for k, v in empty.items()
                                if k.startswith("model.")}}
            dcp.load(nested, checkpoint_id=step)
            return nested["model"]
        dcp.load(empty, checkpoint_id=step)
    parallel = json.loads((step / "meta.json").read_text()).get("config", {}).get("parallel")
    return _join_flat_units(empty, cfg, step, parallel)


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
    from fivefold.comm.collectives import Axis
    from fivefold.parallel.pipeline.build import stage_ids_of_rank
    from fivefold.parallel.pipeline.partition import stage_layer_ranges
    from fivefold.parallel.pipeline.stage import PipelineStage
    from fivefold.parallel.tensor import apply_tensor_parallel

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


def _join_flat_units(flat: dict[str, torch.Tensor], cfg: ModelConfig, step: Path,
                     parallel: dict | None = None) -> dict[str, torch.Tensor]:
    """Parameters from the engine's `master.{unit}.shard{r}of{n}[.pp{p}of{P}][.tp{t}of{T}]`
    buffers; `parallel` is the run's parallel config (for the stages of pp > 1)."""
    from fivefold.parallel.data_parallel import split_units
    from fivefold.parallel.tensor import unshard_tensor

    pp, tp = _rank_degree(flat, "pp", step), _rank_degree(flat, "tp", step)
    parts: dict[str, list[torch.Tensor]] = {}  # name -> its tp shards, in tp rank order
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model = _rank_model(cfg, pp, pp_rank, tp, tp_rank, parallel, step)
            tag = (f".pp{pp_rank}of{pp}" if pp > 1 else "") + (f".tp{tp_rank}of{tp}"
                                                                if tp > 1 else "")
            for unit, params, _ in split_units(model):
                if params:  # a middle stage's root unit holds nothing
                    for name, tensor in _cut_unit(flat, unit, tag, params, step):
                        parts.setdefault(name, []).append(tensor)
    state = {}
    for name, shards in parts.items():
        if len(shards) != tp:
            raise CheckpointError(str(step), f"{name} is held {len(shards)} times over {tp} tp "
                                             f"rank(s) of {pp} stage(s)")
        state[name] = unshard_tensor(name, shards, cfg.vocab) if tp > 1 else shards[0]
    return state


def _cut_unit(flat: dict[str, torch.Tensor], unit: str, tag: str, params, step: Path):
    """(name, tensor) of each parameter of unit `unit` of the rank tagged `tag`, cut from its
    joined `shard{r}of{n}` pieces."""
    pattern = re.compile(rf"master\.{re.escape(unit)}\.shard(\d+)of(\d+){re.escape(tag)}")
    found = {int(m.group(1)): int(m.group(2)) for k in flat if (m := pattern.fullmatch(k))}
    n = next(iter(found.values()), 0)
    if not n or sorted(found) != list(range(n)):
        raise CheckpointError(str(step), f"unit {unit}{tag}: shards {sorted(found)} do not "
                                         "cover it")
    buffer = torch.cat([flat[f"master.{unit}.shard{r}of{n}{tag}"] for r in range(n)])
    offset = 0
    for name, p in params:
        if offset + p.numel() > buffer.numel():
            raise CheckpointError(str(step), f"unit {unit}{tag} is smaller than its parameters")
        yield name, buffer[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()


# ------------------------------------------------------------------ writing

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def write_weights_folder(folder: Path, pre: Pretrained) -> None:
    """config.toml + model.safetensors (+ hf_config.json), the fivefold weights folder."""
    fields = model_fields(pre.cfg)
    moe = fields.pop("moe", None)
    lines = ["# fivefold weights folder: model shape (fivefold.models.pretrained)", "[model]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    if moe:
        lines += ["", "[model.moe]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in moe.items() if v is not None]
    (folder / CONFIG_FILE).write_text("\n".join(lines) + "\n")
    save_file({k: v.contiguous() for k, v in pre.state.items()}, folder / WEIGHTS_FILE,
              metadata={"format": "pt"})
    if pre.hf_config is not None:
        (folder / HF_CONFIG_FILE).write_text(json.dumps(pre.hf_config, indent=2) + "\n")


def write_hf_folder(folder: Path, pre: Pretrained, shard_bytes: int = SHARD_BYTES) -> None:
    """config.json + safetensors in Hugging Face's names and layout."""
    dtype = pre.state["tok_embeddings.weight"].dtype
    config = hf_config_from_model(pre.cfg, dtype, pre.hf_config)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_hf_tensors(folder, state_to_hf(pre.state, pre.cfg), shard_bytes)


def convert(src: Path, dst: Path, to: str | None = None,
            shard_bytes: int = SHARD_BYTES) -> tuple[Pretrained, str]:
    """Write the model at `src` to the new folder `dst` as "hf" or "fivefold".

    By default a Hugging Face source becomes a fivefold weights folder and anything else a
    Hugging Face folder. Tokenizer files are copied along. Returns (the model, the format).
    """
    src, dst = Path(src), Path(dst)
    if to not in (None, "hf", "fivefold"):
        raise CheckpointError("--to", f"{to!r} is not a format; use 'hf' or 'fivefold'")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(str(dst), "already exists and is not an empty folder; name a new "
                                        "folder to write into")
    pre = load_pretrained(src)
    to = to or ("fivefold" if source_kind(src) == "hf" else "hf")
    dst.mkdir(parents=True, exist_ok=True)
    if to == "fivefold":
        write_weights_folder(dst, pre)
    else:
        write_hf_folder(dst, pre, shard_bytes)
    for name in TOKENIZER_FILES:
        if (pre.folder / name).is_file():
            shutil.copy(pre.folder / name, dst / name)
    return pre, to


# ------------------------------------------------------------------ --init-from

def init_from_overrides(path: Path, raw: dict) -> list[str]:
    """`--set` overrides that give a run the model at `path`.

    `raw` is the user's config (file plus overrides) before presets are applied: the model
    keys it sets must equal the checkpoint's, except `seq_len`, which may be shorter than the
    checkpoint's. A tokenizer.json in the folder becomes `data.tokenizer` unless one is set.
    """
    path = Path(path)
    fields = model_fields(read_model_config(path))
    user = raw.get("model", {}) if isinstance(raw.get("model", {}), dict) else {}
    if "preset" in user:
        raise ConfigError("model.preset", f"the model comes from --init-from {path}; drop "
                                          "model.preset")
    ffn = fields["ffn_hidden"]
    for key, value in user.items():
        have = fields.get(key)
        if key == "seq_len":
            if isinstance(value, int) and value > fields["seq_len"]:
                raise ConfigError("model.seq_len", f"{value} exceeds the {fields['seq_len']} "
                                                   f"positions the model at {path} was made for;"
                                                   " use at most that")
            continue
        if key == "moe" and isinstance(value, dict) and have is not None:
            value = {**have, **value}
            value["expert_ffn_hidden"] = value["expert_ffn_hidden"] or ffn
        if key in ("kv_heads", "head_dim") and value is None:
            continue
        if key in fields or key == "moe":
            if value != have:
                raise ConfigError(f"model.{key}", f"--init-from {path} holds a model with {key} "
                                                  f"= {have!r}, but the config sets {value!r}; "
                                                  f"drop model.{key} or make them agree")
    out = [f"model.{k}={_toml_value(v)}" for k, v in fields.items()
           if k != "moe" and not (k == "seq_len" and "seq_len" in user)]
    for k, v in (fields.get("moe") or {}).items():
        if v is not None:
            out.append(f"model.moe.{k}={_toml_value(v)}")
    data = raw.get("data", {}) if isinstance(raw.get("data", {}), dict) else {}
    if (path / "tokenizer.json").is_file() and "tokenizer" not in data:
        out.append(f"data.tokenizer={json.dumps(str(path / 'tokenizer.json'))}")
    return out


@torch.no_grad()
def load_weights_into(model: nn.Module, cfg: ModelConfig, path: Path) -> None:
    """Copy the weights at `path` into the plain (unwrapped) model built from `cfg`."""
    pre = load_pretrained(path)
    want, have = model_fields(cfg), model_fields(pre.cfg)
    for key in set(want) | set(have):
        if key != "seq_len" and want.get(key) != have.get(key):
            raise ConfigError(f"model.{key}", f"the run's model has {key} = {want.get(key)!r} but"
                                              f" {path} holds {have.get(key)!r}; start with "
                                              "`fivefold train --init-from` to take its shape")
    model.load_state_dict(pre.state, strict=True)
