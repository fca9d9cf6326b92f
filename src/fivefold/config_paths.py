"""Relative paths in a config file name files next to it, not in the current directory.

`data.source`, each `[[data.sources]]` table's `path`, `data.tokenizer` and `data.cache_dir`
written in a TOML or JSON file are joined to that file's folder (made absolute), so a config
works from any directory; "stdlib" and absolute paths stay as written. `--set` values are
applied after this and stay relative to the current directory, as a shell user expects.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_PATH_KEYS = ("source", "tokenizer", "cache_dir")


def _resolved(value, folder: Path):
    """`value` joined to `folder` when it is a relative path; anything else unchanged (a
    wrong type is reported by the config loader)."""
    if not isinstance(value, str) or value == "stdlib" or os.path.isabs(value):
        return value
    return os.path.abspath(folder / value)


def resolve_file_paths(raw: dict, folder: Path) -> dict:
    """`raw` (a config file's tables) with its data paths resolved from `folder`, in place."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return raw
    for key in DATA_PATH_KEYS:
        if key in data:
            data[key] = _resolved(data[key], folder)
    for source in data.get("sources") or []:
        if isinstance(source, dict) and "path" in source:
            source["path"] = _resolved(source["path"], folder)
    return raw
