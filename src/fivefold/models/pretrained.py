"""Pretrained weights in and out of fivefold: Hugging Face folders and the weights folder.

A fivefold weights folder is what `fivefold convert --to fivefold` writes:

    config.toml         a fivefold config file holding only the [model] table, every key set
    model.safetensors   the plain model's tensors by fivefold parameter name, stored dtype kept
    hf_config.json      the source's config.json, when converted from Hugging Face: export
                        restores its family, token ids and windows from it
    tokenizer files     copied from the source when it has them (TOKENIZER_FILES)

`load_folder` reads a Hugging Face model folder (config.json, mapped by fivefold.models.hf)
or a fivefold weights folder (config.toml + model.safetensors), told apart by `folder_kind`.
A training checkpoint is the third source that `convert` and `--init-from` take; reading it
needs the runtime's layouts, so it is fivefold.train.checkpoint_export's, and
fivefold.train.model_source tells the three apart.

Every tensor is checked against the shapes the model config implies before it is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fivefold.config import ModelConfig, load_config
from fivefold.models.description import parameters
from fivefold.models.hf import (SHARD_BYTES, CheckpointError, hf_config_from_model,
                                model_config_from_hf, model_fields, read_config_json,
                                read_hf_tensors, state_from_hf, state_to_hf, write_hf_tensors)

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

def folder_kind(path: Path) -> str | None:
    """"hf" or "fivefold" from the files `path` holds; None when it is neither."""
    if (path / "config.json").is_file():
        return "hf"
    if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return "fivefold"
    return None


def read_folder_config(path: Path) -> ModelConfig:
    """The model config of a Hugging Face or weights folder, without reading its tensors."""
    path = Path(path)
    if folder_kind(path) == "hf":
        return model_config_from_hf(read_config_json(path), str(path / "config.json"))
    return load_config(path / CONFIG_FILE).model


def load_folder(path: Path) -> Pretrained:
    """Config and tensors of a Hugging Face folder or a fivefold weights folder."""
    path = Path(path)
    cfg = read_folder_config(path)
    hf_config = None
    if folder_kind(path) == "hf":
        hf_config = read_config_json(path)
        state = state_from_hf(read_hf_tensors(path), cfg, str(path))
    else:
        state = load_file(path / WEIGHTS_FILE)
        if (path / HF_CONFIG_FILE).is_file():
            hf_config = json.loads((path / HF_CONFIG_FILE).read_text())
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


# ------------------------------------------------------------------ writing

def toml_value(value) -> str:
    """`value` as TOML writes it: the weights folder's config.toml, `--set` overrides."""
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
    lines += [f"{k} = {toml_value(v)}" for k, v in fields.items()]
    if moe:
        lines += ["", "[model.moe]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in moe.items() if v is not None]
    (folder / CONFIG_FILE).write_text("\n".join(lines) + "\n")
    save_file({k: v.contiguous() for k, v in pre.state.items()}, folder / WEIGHTS_FILE,
              metadata={"format": "pt"})
    if pre.hf_config is not None:
        (folder / HF_CONFIG_FILE).write_text(json.dumps(pre.hf_config, indent=2) + "\n")


def write_hf_folder(folder: Path, pre: Pretrained, shard_bytes: int = SHARD_BYTES,
                    token_ids: dict | None = None) -> None:
    """config.json + safetensors in Hugging Face's names and layout; `token_ids`
    (bos_token_id, eos_token_id) are those of the tokenizer written beside them, set where
    the source's config.json has none (its own, e.g. a list of stop ids, are kept)."""
    dtype = pre.state["tok_embeddings.weight"].dtype
    config = hf_config_from_model(pre.cfg, dtype, pre.hf_config)
    config.update({k: v for k, v in (token_ids or {}).items() if config.get(k) is None})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_hf_tensors(folder, state_to_hf(pre.state, pre.cfg), shard_bytes)
