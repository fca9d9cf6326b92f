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

PER_SOURCE_KEYS = ("source", "format", "text_field", "token_dtype")  # [data] key = source key


def source_configs(d: DataConfig) -> list[tuple[DataConfig, float]]:
    """Each source as a single-source `DataConfig`, with its weight."""
    if not d.sources:
        return [(d, 1.0)]
    return [(replace(d, source=s.path, format=s.format, text_field=s.text_field,
                     token_dtype=s.token_dtype, sources=None), s.weight) for s in d.sources]


def _source_format(d: DataConfig) -> str:
    from fivefold.train.corpus import detect_format  # reads the path's suffix and folder
    return detect_format(d)


def validate_sources(cfg: Config) -> None:
    """`[[data.sources]]`: at least one table, positive finite weights, known formats,
    existing paths, and the `[data]` keys that a table replaces left at their defaults."""
    from fivefold.validate import DATA_FORMATS, TOKEN_DTYPES

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
    formats = []
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
        fmt = _source_format(one)
        if fmt == "tokens" and not Path(one.source).is_file():
            raise ConfigError(f"{key}.format", f"'tokens' reads one raw token-id file, and "
                                               f"{one.source!r} is not a file")
        if fmt == "tokens" and one.token_dtype == "uint16" and cfg.model.vocab > 65536:
            raise ConfigError(f"{key}.token_dtype", f"uint16 cannot hold ids of a "
                                                    f"{cfg.model.vocab}-token vocabulary; use "
                                                    "'uint32'")
        formats.append(fmt)
    if "tokens" in formats and set(formats) != {"tokens"} and d.tokenizer is None:
        raise ConfigError("data.tokenizer", "the mixture holds token files and text: give "
                                            "the tokenizer.json the token files were made "
                                            "with, which then tokenizes the text too")
