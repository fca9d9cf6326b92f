"""Config fuzzing: configurations drawn across every key either train or are refused with
one ConfigError naming a key; never a hang and never an exception from deeper inside.

The strategies are derived from the config dataclasses (fivefold.config), walking every
field of every section: a key's type gives its values (ints, floats with NaN and
infinities, booleans, lists, optional absence), the choices fivefold.validate knows give
its strings (with one that is none of them), and now and then a value of the wrong type.
Each draw sets a few keys as `--set` overrides, on top of the tiny test model, exactly as
the command line would.

- `test_drawn_configs_validate_or_name_a_key`: many draws through what `fivefold train`
  does before any rank starts (load, device, plan or validation); fixed seed and count.
- `test_drawn_configs_train_a_step_or_exit_2`: a few draws of small values, each run as
  `fivefold train --steps 1` on 1 or 2 CPU ranks under a hard timeout: exit 0 with the
  step's metrics, or exit 2 with one `config error in `key`` line and no traceback.
- the `slow` versions draw many more of each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivefold import validate as V
from fivefold import validate_parallel as VP
from fivefold.cli import _auto_plan, _device, _preflight
from fivefold.config import Config, ConfigError, MoEConfig, load_config
from fivefold.models.presets import PRESETS
from fivefold.parallel.plan import training_plan

CHOICES = {
    "model.preset": tuple(PRESETS), "model.ffn_type": V.FFN_TYPES,
    "parallel.cp_mode": VP.CP_MODES, "parallel.schedule": VP.SCHEDULES,
    "parallel.recompute": VP.RECOMPUTE, "parallel.precision": VP.PRECISIONS,
    "parallel.reduce_dtype": ("fp32", "bf16", "fp16"), "train.optimizer": V.OPTIMIZERS,
    "train.stack": V.STACKS, "train.device": V.DEVICES,
    "train.on_nonfinite": ("stop", "skip"), "data.format": V.DATA_FORMATS,
    "data.token_dtype": V.TOKEN_DTYPES, "comm.algorithm": ("builtin", "ring", "tree",
                                                           "hierarchical", "synthesized"),
    "cluster.gpu": ("cpu", "h100", "no-such-gpu"),
}
# keys naming files: drawn absent, or a path that does not exist
PATHS = {"data.source", "data.tokenizer", "data.cache_dir", "comm.topology", "comm.sketch",
         "comm.schedule"}
KEEP = {"data.cache_dir"}  # the test's cache: a drawn one would write elsewhere


def config_keys() -> dict[str, tuple[typing.Any, typing.Any]]:
    """Every dotted key of Config: (type hint, default), model.moe's keys included."""
    out = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, hint = f"{prefix}{f.name}", hints[f.name]
            sub = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")
            elif sub:
                walk(sub[0], key + ".")
            else:
                default = (f.default if f.default is not dataclasses.MISSING
                           else f.default_factory())
                out[key] = (hint, default)

    walk(Config, "")
    return out


KEYS = config_keys()
assert {f"model.moe.{f.name}" for f in dataclasses.fields(MoEConfig)} <= KEYS.keys()


def toml(value) -> str:
    """`value` as the TOML literal a `--set` carries."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else "inf" if value == math.inf else
                "-inf" if value == -math.inf else repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return str(value)


def _base_type(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def value_strategy(key: str, small: bool) -> st.SearchStrategy[str]:
    """TOML literals for `key`: of its type, its choices, absent-able; `small` keeps
    numbers near the values a one-step CPU run can train."""
    hint, default = KEYS[key]
    base, optional = _base_type(hint)
    if key in PATHS:
        values = st.sampled_from(["/no/such/path"])
    elif key in CHOICES:
        values = st.sampled_from((*CHOICES[key], "none-of-these"))
    elif base is bool:
        values = st.booleans()
    elif base is int:
        values = (st.integers(-1, 8) if small else
                  st.one_of(st.integers(-3, 16), st.integers(-2**40, 2**40)))
    elif base is float:
        values = st.one_of(st.sampled_from([0.0, 1e-3, 0.02, 0.5, 1.0, 2.0, -1.0, math.nan,
                                            math.inf]),
                           st.floats(-1e3, 1e3) if small else st.floats())
    elif typing.get_origin(base) is list:
        values = st.lists(st.integers(-1, 4), max_size=5)
    elif base is str:
        values = st.sampled_from(["", "x", str(default)])
    else:
        raise AssertionError(f"no strategy for {key}: {hint}")
    literals = values.map(toml)
    wrong = st.sampled_from(['"text"', "true", "[1]", "1.5", "{a = 1}"])
    return st.one_of(literals, literals, literals, wrong) if not small else literals


def overrides(keys: list[str], small: bool) -> st.SearchStrategy[list[str]]:
    return st.tuples(*(value_strategy(k, small) for k in keys)).map(
        lambda values: [f"{k}={v}" for k, v in zip(keys, values)])


def drawn_sets(max_keys: int, small: bool, exclude: frozenset = frozenset()):
    keys = sorted(k for k in KEYS if k not in KEEP | exclude)
    return st.lists(st.sampled_from(keys), min_size=1, max_size=max_keys,
                    unique=True).flatmap(lambda ks: overrides(ks, small))


def names_a_key(err: ConfigError) -> bool:
    """The key is a config key, one of its sections or tables, or the command line's."""
    sections = {k.rsplit(".", 1)[0] for k in KEYS} | {k.split(".")[0] for k in KEYS}
    return (err.key in KEYS or err.key in sections or err.key in ("CONFIG", "--nproc")
            or any(err.key.startswith(k + ".") for k in KEYS)  # a comm.algorithm table
            or any(err.key.startswith(k + "[") for k in KEYS))  # a data.sources table


def refuse_or_plan(sets: list[str], world: int) -> None:
    """What `fivefold train` does before any rank starts (cli.cmd_train): raises only
    ConfigError."""
    cfg = load_config(None, sets)
    device = _device(cfg)
    if cfg.parallel.auto:
        cfg, plan = _auto_plan(cfg, world, device, None)
    else:
        plan = training_plan(cfg, world, device.type)
    if cfg.train.preflight:
        _preflight(cfg, plan, world, world, device, under_launcher=False)


def check_validation(base: list[str], sets: list[str], world: int) -> None:
    try:
        refuse_or_plan(base + sets, world)
    except ConfigError as err:
        assert names_a_key(err), (sets, str(err))


VALIDATE = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def base(tiny_overrides):
    return tiny_overrides + ["train.steps=1", "train.eval_batches=1", "train.sample_tokens=0",
                             "train.warmup_steps=0"]


@pytest.mark.timeout(300)
@settings(max_examples=300, **VALIDATE)
@given(data=st.data())
def test_drawn_configs_validate_or_name_a_key(base, data):
    """300 draws of up to 6 keys each on 1, 2 or 4 ranks (fixed seed): each is planned or
    refused with a ConfigError that names a key."""
    sets = data.draw(drawn_sets(6, small=False, exclude=frozenset({"parallel.auto"})))
    check_validation(base, sets, data.draw(st.sampled_from([1, 2, 4])))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=5000, **VALIDATE)
@given(data=st.data())
def test_drawn_configs_validate_or_name_a_key_long(base, data):
    """5000 draws, `parallel.auto` included (the planner's search on the drawn ranks)."""
    sets = data.draw(drawn_sets(8, small=False))
    check_validation(base, sets, data.draw(st.sampled_from([1, 2, 4, 8])))


TRAIN_TIMEOUT_S = 120


def check_training(base: list[str], sets: list[str], nproc: int, run_dir) -> None:
    """`fivefold train --steps 1`: exit 0 with one step's metrics, or exit 2 with one
    `config error` line naming a key; never a traceback, never past the timeout."""
    argv = [a for s in base + sets for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "fivefold", "train", *argv, "--nproc",
                           str(nproc), "--run-dir", str(run_dir)], capture_output=True,
                          text=True, timeout=TRAIN_TIMEOUT_S)
    out = f"{sets} on {nproc} rank(s):\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, out
    if proc.returncode == 2:
        errors = [line for line in proc.stderr.splitlines() if "config error in `" in line]
        assert len(errors) == 1 and errors[0].startswith("fivefold: config error in `"), out
    else:
        assert proc.returncode == 0, out
        assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1, out


# keys a one-step training run draws: small shapes, and everything else but the model's size
SMALL_EXCLUDE = frozenset({"model.preset", "model.hidden", "model.ffn_hidden", "model.vocab",
                           "model.seq_len", "parallel.auto", "train.steps",
                           "model.moe.expert_ffn_hidden"})
TRAIN = dict(derandomize=True, database=None, deadline=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                    HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(6 * TRAIN_TIMEOUT_S)
@settings(max_examples=5, **TRAIN)
@given(data=st.data())
def test_drawn_configs_train_a_step_or_exit_2(base, data, tmp_path_factory):
    """5 draws of up to 3 keys with small values (fixed seed), on 1 or 2 ranks."""
    sets = data.draw(drawn_sets(3, small=True, exclude=SMALL_EXCLUDE))
    check_training(base, sets, data.draw(st.sampled_from([1, 2])),
                   tmp_path_factory.mktemp("fuzz"))


@pytest.mark.slow
@pytest.mark.timeout(200 * TRAIN_TIMEOUT_S)
@settings(max_examples=150, **TRAIN)
@given(data=st.data())
def test_drawn_configs_train_a_step_or_exit_2_long(base, data, tmp_path_factory):
    """150 draws of up to 5 keys, on 1 or 2 ranks."""
    sets = data.draw(drawn_sets(5, small=True, exclude=SMALL_EXCLUDE))
    check_training(base, sets, data.draw(st.sampled_from([1, 2])),
                   tmp_path_factory.mktemp("fuzz"))
