"""Any model source read as one: what `fivefold convert` and `--init-from` accept.

Three sources, told apart by their files (`source_kind`):

* a Hugging Face model folder (config.json) and a fivefold weights folder (config.toml +
  model.safetensors), read by fivefold.models.pretrained;
* a training run: RUN_DIR/checkpoints/step_N, or RUN_DIR for its latest one, read by
  fivefold.train.checkpoint_export.

The dispatch lives in train/ because the third source needs the runtime's checkpoint layout,
which models/ does not import. `convert` writes any source as a Hugging Face folder or a
fivefold weights folder, with its tokenizer (`load_tokenizer`: a model folder's tokenizer.json,
or the one a run wrote to RUN_DIR/tokenizer) and bos/eos ids; `init_from_overrides` and
`load_weights_into` start a run from one, `check_init_tokenizer` refuses to train a new
tokenizer for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.models.hf import SHARD_BYTES, CheckpointError, model_fields, read_config_json
from fivefold.models.pretrained import (CONFIG_FILE, TOKENIZER_FILES, WEIGHTS_FILE, Pretrained,
                                        folder_kind, load_folder, read_folder_config,
                                        toml_value, write_hf_folder, write_weights_folder)
from fivefold.train.checkpoint_export import (checkpoint_model_config, checkpoint_step,
                                              is_training_run, read_checkpoint)
from fivefold.train.corpus import detect_format
from fivefold.train.data import RUN_TOKENIZER
from fivefold.train.special_tokens import SpecialTokens, special_tokens, write_tokenizer_folder


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


def describe_source(path: Path) -> str:
    """What the model at `path` is, for the start-up lines of a run that starts from it."""
    path = Path(path)
    kind = source_kind(path)
    if kind == "checkpoint":
        return f"checkpoint {checkpoint_step(path)}"
    if kind == "fivefold":
        return f"fivefold weights folder {path}"
    return f"Hugging Face {read_config_json(path).get('model_type')} folder {path}"


def tokenizer_file(path: Path) -> Path | None:
    """The tokenizer.json of the model at `path`: beside a folder's weights, or the one a
    training run wrote to RUN_DIR/tokenizer; None when there is none."""
    path = Path(path)
    if source_kind(path) == "checkpoint":
        path = checkpoint_step(path).parent.parent / RUN_TOKENIZER
    file = path / "tokenizer.json"
    return file if file.is_file() else None


def load_tokenizer(path: Path) -> tuple[Tokenizer, SpecialTokens, Path] | None:
    """(tokenizer, its bos/eos, its folder) of the model at `path`, or None."""
    file = tokenizer_file(path)
    if file is None:
        return None
    tok = Tokenizer.from_file(str(file))
    return tok, special_tokens(tok, file.parent), file.parent


def convert(src: Path, dst: Path, to: str | None = None, shard_bytes: int = SHARD_BYTES,
            log=print) -> tuple[Pretrained, str]:
    """Write the model at `src` to the new folder `dst` as "hf" or "fivefold".

    By default a Hugging Face source becomes a fivefold weights folder and anything else a
    Hugging Face folder. The tokenizer goes along: its files are copied, and a tokenizer.json
    is written with tokenizer_config.json and special_tokens_map.json naming bos and eos
    (fivefold.train.special_tokens), whose ids also go into config.json, so that
    transformers loads model and tokenizer from `dst`. Returns (the model, the format).
    """
    src, dst = Path(src), Path(dst)
    if to not in (None, "hf", "fivefold"):
        raise CheckpointError("--to", f"{to!r} is not a format; use 'hf' or 'fivefold'")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(str(dst), "already exists and is not an empty folder; name a new "
                                        "folder to write into")
    pre = load_pretrained(src)
    to = to or ("fivefold" if source_kind(src) == "hf" else "hf")
    file = tokenizer_file(src)
    try:
        tokens = load_tokenizer(src)
    except ConfigError as err:  # bos/eos unknown: its files go along as they are
        log(f"note: the tokenizer files are copied unchanged, without bos/eos ids: {err}")
        tokens = None
    dst.mkdir(parents=True, exist_ok=True)
    if to == "fivefold":
        write_weights_folder(dst, pre)
    else:
        write_hf_folder(dst, pre, shard_bytes, tokens[1].config_ids() if tokens else None)
    folder = file.parent if file else pre.folder
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy(folder / name, dst / name)
    if tokens:
        tok, special, source = tokens
        write_tokenizer_folder(dst, tok, special, pre.cfg.seq_len, source)
    elif file is None:
        log(f"note: {src} has no tokenizer.json, so {dst} has none either")
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
    file = tokenizer_file(path)
    if file is not None and "tokenizer" not in data:
        out.append(f"data.tokenizer={json.dumps(str(file))}")
    return out


def check_init_tokenizer(cfg: Config, path: Path) -> Config:
    """`cfg`, unless it would train a new tokenizer for a model that came with token ids of
    its own: text data needs the model's tokenizer, found beside it or named by
    `data.tokenizer`."""
    if cfg.data.tokenizer is None and detect_format(cfg.data) != "tokens":
        raise ConfigError("data.tokenizer", f"--init-from {path} has no tokenizer.json, and a "
                                            "newly trained one would not match the model's "
                                            "token ids; set data.tokenizer to the tokenizer.json "
                                            "the model was trained with (transformers writes one:"
                                            " AutoTokenizer.from_pretrained(F).save_pretrained(F))")
    return cfg


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
