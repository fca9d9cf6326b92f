"""What the config tests share: loading a config from --set overrides, and asserting that
loading and validating one fails on a named key with a given message."""

from __future__ import annotations

import pytest

from fivefold.config import Config, ConfigError, load_config
from fivefold.validate import validate, validate_for_training


def load(*overrides: str, path=None) -> Config:
    return load_config(path, list(overrides))


def rejects(key: str, fragment: str, *overrides: str, world_size=None, path=None,
            training: bool = False) -> ConfigError:
    """Assert that loading + validating fails on `key` with `fragment` in the message."""
    with pytest.raises(ConfigError) as info:
        cfg = load_config(path, list(overrides))
        if training:
            validate_for_training(cfg, world_size or 1)
        else:
            validate(cfg, world_size)
    err = info.value
    assert err.key == key, str(err)
    assert fragment in str(err), str(err)
    assert f"`{key}`" in str(err)
    return err
