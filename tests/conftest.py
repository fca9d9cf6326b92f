"""Shared fixtures: a small text corpus, a tiny model config that trains in seconds, and that
config as the parity tests run it."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from fivefold.config import load_config
from fivefold.train.data import prepare_data

TINY_MODEL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
              "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32"]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A folder of 60 standard-library modules (about 1 MiB): a real corpus, quick to tokenize."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:60]
    for f in files:
        shutil.copy(f, root / f.name)
    return root


@pytest.fixture(scope="session")
def tiny_overrides(small_corpus, tmp_path_factory) -> list[str]:
    """--set overrides for a tiny model trained on `small_corpus`, caching under tmp."""
    cache = tmp_path_factory.mktemp("cache")
    return TINY_MODEL + [f"data.source='{small_corpus}'", f"data.cache_dir='{cache}'",
                         "data.val_fraction=0.1", "data.tokenizer_sample_mib=0.5",
                         "parallel.global_batch=4", "train.tensorboard=false",
                         "train.sample_tokens=8", "train.log_every=1000", "train.lr=1e-2",
                         "train.warmup_steps=2"]


@pytest.fixture(scope="session")
def parity_overrides(tiny_overrides) -> list[str]:
    """`tiny_overrides` as the parity tests run them: global batch 8 (divisible by every
    layout's dp x micro-batch), lr 1e-3 (the scale their tolerances are stated at) and no text
    sample; the corpus is tokenized here, once, before any ranks start."""
    sets = tiny_overrides + ["parallel.global_batch=8", "train.sample_tokens=0", "train.lr=1e-3"]
    prepare_data(load_config(None, sets))
    return sets
