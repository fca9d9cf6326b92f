"""The data sources of a config: `data.source`, or the `[[data.sources]]` mixture, checked.

Each source becomes a `DataConfig` of its own (path, format, text field, token dtype; the
shared keys, validation share, tokenizer and cache, from `[data]`), so that one source is
read exactly as `data.source` is (fivefold.train.corpus, fivefold.train.data). `data.source`
is the mixture of one source of weight 1.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from pathlib import Path

from fivefold.config import Config, ConfigError, DataConfig

DATA_FORMATS = ("auto", "text", "jsonl", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
PER_SOURCE_KEYS = ("source", "format", "text_field", "token_dtype")  # [data] key = source key


def source_configs(d: DataConfig) -> list[tuple[DataConfig, float]]:
    """Each source as a single-source `DataConfig`, with its weight."""
    if not d.sources:
        return [(d, 1.0)]
    return [(replace(d, source=s.path, format=s.format, text_field=s.text_field,
                     token_dtype=s.token_dtype, sources=None), s.weight) for s in d.sources]


def validate_sources(cfg: Config) -> None:
    """`[[data.sources]]`: at least one table, positive finite weights, known formats,
    existing paths, and the `[data]` keys that a table replaces left at their defaults (as
    validate.validate_data checks `data.source`; what needs a source's detected format is
    checked where it is read, fivefold.train.data)."""
    d = cfg.data
    if d.sources is None:
        return
    if not d.sources:
        raise ConfigError("data.sources", "is an empty list; give one [[data.sources]] table "
                                          "per source, or use data.source")
    defaults = {f.name: f.default for f in fields(DataConfig)}
    for key in PER_SOURCE_KEYS:
        if getattr(d, key) != defaults[key]:
            raise ConfigError(f"data.{key}", "applies to data.source only; with data.sources "
                                             f"set `{'path' if key == 'source' else key}` in "
                                             "each [[data.sources]] table instead")
    for i, (one, weight) in enumerate(source_configs(d)):
        key = f"data.sources[{i}]"
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"{key}.weight", f"must be a positive number, got {weight}")
        if one.format not in DATA_FORMATS:
            raise ConfigError(f"{key}.format", f"unknown value {one.format!r}; choose one of "
                                               f"{', '.join(DATA_FORMATS)}")
        if one.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"{key}.token_dtype", f"unknown value {one.token_dtype!r}; "
                                                    f"choose one of {', '.join(TOKEN_DTYPES)}")
        if one.source != "stdlib" and not Path(one.source).exists():
            raise ConfigError(f"{key}.path", f"path {one.source!r} does not exist; give an "
                                             "existing text/JSONL/token file or folder, or "
                                             "'stdlib'")
        if one.format == "tokens" and not Path(one.source).is_file():
            raise ConfigError(f"{key}.format", f"'tokens' reads one raw token-id file, and "
                                               f"{one.source!r} is not a file")
        if one.format == "tokens" and one.token_dtype == "uint16" and cfg.model.vocab > 65536:
            raise ConfigError(f"{key}.token_dtype", f"uint16 cannot hold ids of a "
                                                    f"{cfg.model.vocab}-token vocabulary; use "
                                                    "'uint32'")
