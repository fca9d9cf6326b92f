"""Typed run configuration: the `Config` of sections model, parallel, train, data, cluster,
comm (each declared in its own module: fivefold.model_config, parallel_config, train_config,
data_config, cluster_config, comm_config), and its loading.

A config is a TOML file (or nothing: every field has a default) plus `--set section.key=value`
overrides. Keys follow docs/run_spec.md, with `train.*` and `data.*` added for
the trainer. Loading checks every key and type; `validate` checks every value and every
combination. Both raise `ConfigError`, whose message names the key and the fix, before any
process is spawned or any tensor is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.cluster_config import ClusterConfig, GroupConfig  # noqa: F401 (re-exported)
from fivefold.comm_config import CommConfig
from fivefold.config_fields import doc_field as _doc
from fivefold.config_paths import resolve_file_paths
from fivefold.data_config import DataConfig, SourceConfig  # noqa: F401 (re-exported)
from fivefold.model_config import ModelConfig, MoEConfig  # noqa: F401 (re-exported)
from fivefold.models.presets import PRESETS
from fivefold.parallel_config import ParallelConfig
from fivefold.train_config import TrainConfig


class ConfigError(ValueError):
    """A user-caused configuration problem; `key` is the dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error in `{key}`: {message}")


@dataclass
class Config:
    model: ModelConfig = _doc("model shape", factory=ModelConfig)
    parallel: ParallelConfig = _doc("parallel layout", factory=ParallelConfig)
    train: TrainConfig = _doc("optimizer and loop", factory=TrainConfig)
    data: DataConfig = _doc("corpus and tokenizer", factory=DataConfig)
    cluster: ClusterConfig = _doc("hardware", factory=ClusterConfig)
    comm: CommConfig = _doc("collective algorithms", factory=CommConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (1, 2.5, true, "x", [1, 2]) or else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(assignment, "a --set override must look like section.key=value, "
                                      "e.g. --set train.lr=1e-3")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(key, "name a section and a key, e.g. model.layers=8 or train.lr=1e-3")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"`{part}` is a value, not a table")
    node[parts[-1]] = parse_value(value.strip())


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Return `value` converted to `hint` (int -> float allowed) or raise naming the key."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        tables = [a for a in args if typing.get_origin(a) is dict]
        if tables and isinstance(value, dict):  # `str | dict[str, str]`: a name or a table
            return _check_type(key, value, tables[0])
        return _check_type(key, value, args[0])
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {value!r}")
        return {k: _check_type(f"{key}.{k}", v, typing.get_args(hint)[1])
                for k, v in value.items()}
    if origin is list:
        item = typing.get_args(hint)[0]
        tables = dataclasses.is_dataclass(item)  # a list of tables, e.g. [[data.sources]]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}; write e.g. " +
                              (f"[[{key}]] tables" if tables else f"{key}=[2, 2]"))
        if tables:
            return [_build(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [_check_type(key, v, item) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if not ok:
        example = {int: "8", float: "1e-3", bool: "true", str: '"name"'}[hint]
        raise ConfigError(key, f"expected {hint.__name__}, got {value!r} "
                               f"({type(value).__name__}); write e.g. {key}={example}")
    return value


def _build(cls: type, raw: dict, prefix: str) -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in hints:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
            if close:
                raise ConfigError(dotted, f"unknown key; did you mean {' or '.join(close)}?")
            raise ConfigError(dotted, f"unknown key; known keys are {', '.join(names)}")
        hint = hints[key]
        sub = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, dotted)
        elif sub and value is not None:
            kwargs[key] = _build(sub[0], value, dotted)
        else:
            kwargs[key] = _check_type(dotted, value, hint)
    return cls(**kwargs)


SHAPE_KEYS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")


def resolve_preset(model_raw: dict) -> dict:
    """Overlay the user's model keys on the named preset's values.

    A table that names no preset but sets every shape key (a run spec's full description)
    takes the field defaults for what it leaves out (kv_heads = heads, untied embeddings), as
    run_spec.md says, instead of the tiny preset's values; its preset is then "custom".
    """
    if not isinstance(model_raw, dict):
        raise ConfigError("model", f"expected a table of keys, got {model_raw!r}")
    if "preset" not in model_raw and all(k in model_raw for k in SHAPE_KEYS):
        return {**model_raw, "preset": "custom"}
    preset = model_raw.get("preset", "tiny")
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset!r}; choose one of "
                                          f"{', '.join(PRESETS)} or set every model key")
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[preset].items()}
    for key, value in model_raw.items():
        if key == "moe" and isinstance(value, dict) and isinstance(merged.get("moe"), dict):
            merged["moe"].update(value)
        else:
            merged[key] = value
    merged["preset"] = preset
    return merged


def read_file(path: str | Path) -> dict:
    """Read a TOML or JSON config file into a dict, with a clear message if it cannot."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("CONFIG", f"config file {str(p)!r} does not exist; pass a TOML file "
                                    "or omit it to use the defaults")
    try:
        text = p.read_text()
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("CONFIG", f"{p} does not parse: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", f"{p} must hold a table of sections (model, parallel, ...), "
                                    f"not a {type(raw).__name__}")
    return raw


AUTO_SHORTHAND = {"parallel=auto": "parallel.auto=true", 'parallel="auto"': "parallel.auto=true"}


def _auto_shorthand(raw: dict) -> None:
    """A file's `parallel = "auto"` is the table `[parallel] auto = true` (docs/planner.md)."""
    if raw.get("parallel") == "auto":
        raw["parallel"] = {"auto": True}
    elif isinstance(raw.get("parallel"), str):
        raise ConfigError("parallel", f"expected a table of keys or \"auto\", got "
                                      f"{raw['parallel']!r}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a config file (optional) and `--set` overrides into a typed `Config`.

    Only structure and types are checked here; call `validate` for values. Relative `[data]`
    paths in the file are taken from its folder (fivefold.config_paths).
    """
    raw: dict = resolve_file_paths(read_file(path), Path(path).parent) if path else {}
    return config_from_raw(raw, overrides)


def config_from_raw(raw: dict, overrides: list[str] = ()) -> Config:
    """A typed `Config` from a dict of sections (a file's, or a checkpoint's saved config,
    `Config.to_dict`) and `--set` overrides, checked as `load_config` checks."""
    _auto_shorthand(raw)
    for assignment in overrides:
        apply_override(raw, AUTO_SHORTHAND.get(assignment.replace(" ", ""), assignment))
    unknown = set(raw) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(key, "unknown section; sections are model, parallel, train, data, "
                               "cluster, comm")
    raw["model"] = resolve_preset(raw.get("model", {}))
    return _build(Config, raw, "")
