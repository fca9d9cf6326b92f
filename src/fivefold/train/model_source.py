"""Any model source read as one: what `fivefold convert` and `--init-from` accept.

Three sources, told apart by their files (`source_kind`):

* a Hugging Face model folder (config.json) and a fivefold weights folder (config.toml +
  model.safetensors), read by fivefold.models.pretrained;
* a training run: RUN_DIR/checkpoints/step_N, or RUN_DIR for its latest one, read by
  fivefold.train.checkpoint_export.

The dispatch lives in train/ because the third source needs the runtime's checkpoint layout,
which models/ does not import. `convert` writes any source as a Hugging Face folder or a
fivefold weights folder; `init_from_overrides` and `load_weights_into` start a run from one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from fivefold.config import ConfigError, ModelConfig
from fivefold.models.hf import SHARD_BYTES, CheckpointError, model_fields
from fivefold.models.pretrained import (CONFIG_FILE, TOKENIZER_FILES, WEIGHTS_FILE, Pretrained,
                                        folder_kind, load_folder, read_folder_config,
                                        toml_value, write_hf_folder, write_weights_folder)
from fivefold.train.checkpoint_export import (checkpoint_model_config, is_training_run,
                                              read_checkpoint)


def source_kind(path: Path) -> str:
    """"hf", "fivefold" or "checkpoint", from the files `path` holds."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(str(path), "does not exist")
    kind = folder_kind(path)
    if kind is not None:
        return kind
    if is_training_run(path):
        return "checkpoint"
    raise CheckpointError(str(path), "is not a model folder: it has no config.json (Hugging "
                                     f"Face), no {CONFIG_FILE} + {WEIGHTS_FILE} (fivefold "
                                     "weights) and no meta.json or checkpoints/ (training run)")


def read_model_config(path: Path) -> ModelConfig:
    """The model config of any source, without reading its tensors."""
    path = Path(path)
    if source_kind(path) == "checkpoint":
        return checkpoint_model_config(path)
    return read_folder_config(path)


def load_pretrained(path: Path) -> Pretrained:
    """Config and tensors of a Hugging Face folder, a weights folder or a training checkpoint."""
    path = Path(path)
    if source_kind(path) == "checkpoint":
        return read_checkpoint(path)
    return load_folder(path)


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
    out = [f"model.{k}={toml_value(v)}" for k, v in fields.items()
           if k != "moe" and not (k == "seq_len" and "seq_len" in user)]
    for k, v in (fields.get("moe") or {}).items():
        if v is not None:
            out.append(f"model.moe.{k}={toml_value(v)}")
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
