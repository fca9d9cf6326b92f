"""What a run's data position depends on, recorded with every checkpoint and checked on resume.

The data position is a step: step s trains on the batch the sampler draws by (train.seed, s)
from the token streams (fivefold.train.data), and those streams are fixed by the data keys:
the source(s) and any mixture of them, the format, text field and token dtype, the tokenizer
(the named file's contents too) and what trains one, and val_fraction. (model.vocab is the
model check's, fivefold.train.checkpoint.) Resuming with any of them changed would go on
with other batches than the run that saved, silently (a retrained tokenizer even changes what
every id means), so it is refused with a ConfigError naming the key, unless
`train.reset_data = true`: the weights, optimizer state and schedule resume at the checkpoint's
step and the data order starts afresh there (`data_start`, which later checkpoints carry, so
a run resumed after that continues exactly). `data.cache_dir` is where the streams are
cached, not what they hold, and is not compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError, DataConfig

NOT_COMPARED = ("cache_dir",)
TOKENIZER_FILE = "data.tokenizer (file contents)"


def _plain(value):
    """`value` as meta.json reads it back (tuples as lists)."""
    return json.loads(json.dumps(value))


def data_record(cfg: Config) -> dict:
    """The keys the data position depends on, as "section.key": value."""
    record = {f"data.{key}": _plain(value) for key, value in dataclasses.asdict(cfg.data).items()
              if key not in NOT_COMPARED}
    record["train.seed"] = cfg.train.seed
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        digest = hashlib.sha256(Path(cfg.data.tokenizer).read_bytes()).hexdigest()[:16]
        record[TOKENIZER_FILE] = f"sha256 {digest}"
    return record


def _saved_record(meta: dict) -> dict:
    """The checkpoint's record; for one written before records were kept, its config's."""
    if "data" in meta:
        return meta["data"]
    cfg = meta.get("config", {})
    record = {f"data.{key}": value for key, value in cfg.get("data", {}).items()}
    record["train.seed"] = cfg.get("train", {}).get("seed")
    return record


def changed_data_keys(meta: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, saved, now) for each key the data position depends on that differs; a key the
    checkpoint does not record (added to fivefold since) counts as its default."""
    saved, now = _saved_record(meta), data_record(cfg)
    defaults = {f"data.{k}": _plain(v) for k, v in dataclasses.asdict(DataConfig()).items()}
    return [(key, saved.get(key, defaults.get(key)), value) for key, value in now.items()
            if (key in saved or key in defaults) and saved.get(key, defaults.get(key)) != value]


def check_data_keys(path: Path, meta: dict, cfg: Config) -> None:
    """ConfigError naming the first changed key, unless `train.reset_data`."""
    changed = changed_data_keys(meta, cfg)
    if not changed or cfg.train.reset_data:
        return
    key, saved, now = changed[0]
    config_key = "data.tokenizer" if key == TOKENIZER_FILE else key
    fix = ("the tokenizer file as it was" if key == TOKENIZER_FILE else
           f"{config_key} = {saved!r}")
    raise ConfigError(config_key, f"{path} was written with {key} = {saved!r}, this run has "
                      f"{now!r}; the resumed steps would train on other batches than the "
                      f"interrupted run's: resume with {fix}, or add --set "
                      "train.reset_data=true to keep the weights and optimizer state and "
                      "start the data order afresh, or use another --run-dir")


def data_start(meta: dict, cfg: Config) -> tuple[int, list[str]]:
    """The step at which the resumed run's data order began, and the changed keys that
    `train.reset_data` restarts it for (then at the checkpoint's step)."""
    changed = [key for key, _, _ in changed_data_keys(meta, cfg)]
    if changed:  # only under train.reset_data: check_data_keys refuses it otherwise
        return meta["step"], changed
    return meta.get("data_start", 0), []


class DataOrder:
    """A batch sampler read by training step: step s draws the batch at position s - start
    (`start` 0 unless `train.reset_data` restarted the order)."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def rank_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sampler.rank_batch(step - self.start)
