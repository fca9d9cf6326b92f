"""The documented dataclass field every config section declares its keys with: one place
for the key's one-line documentation, which docs/config.md shows (scripts/config_docs.py).
Its own module so that the sections kept outside config.py (fivefold.cluster_config) use
it without importing config.py back."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def doc_field(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its one-line documentation (shown by docs/config.md)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})
