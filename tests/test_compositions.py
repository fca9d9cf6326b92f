"""The composition table (fivefold.compositions): every refused pair is refused by
validate_for_training with its key, the configurations docs/reliability.md calls tested are
accepted and name tests that exist, and the doc's matrix is the generated one."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from fivefold.compositions import ANY_USE, REFUSALS, features_of, filled
from fivefold.config import ConfigError, load_config
from fivefold.validate import validate_for_training

ROOT = Path(__file__).resolve().parents[1]


def _docs_script():
    spec = importlib.util.spec_from_file_location("composition_docs",
                                                  ROOT / "scripts" / "composition_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = _docs_script()


def test_doc_matrix_is_current():
    """docs/reliability.md holds what scripts/composition_docs.py generates (rerun it with
    --write after changing a feature, a refusal or TESTED)."""
    assert (ROOT / "docs" / "reliability.md").read_text() == DOCS.updated_doc()


def test_tested_configurations_are_accepted_and_their_tests_exist():
    """Each configuration TESTED lists validates for training on its ranks (so no pair is
    both tested and refused), and each named test is a function of the named file."""
    for test, world, cfg in DOCS.tested_configs():
        validate_for_training(cfg, world)
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test


# one configuration per refusal row: (world size, overrides) with the pair
REFUSED = [
    (1, ["parallel.offload=cpu", "train.optimizer=lomo"]),
    (1, ["parallel.offload=nvme", "parallel.offload_path=/tmp", "train.optimizer=lomo"]),
    (2, ["parallel.qwz=true", "parallel.zero_stage=1"]),
    (2, ["parallel.hpz=true", "parallel.zero_stage=2"]),
    (1, ["parallel.offload_activations=1", "parallel.recompute=full"]),
    (2, ["parallel.qgz=true"]),
    (1, ["parallel.offload=cpu", "train.optimizer=muon"]),
    (1, ["parallel.offload=nvme", "parallel.offload_path=/tmp", "train.optimizer=galore"]),
    (1, ["parallel.precision=fp8", "train.optimizer=lomo"]),
    (2, ["parallel.precision=fp8", "parallel.pp=2", "parallel.schedule=terapipe",
         "parallel.global_batch=4"]),
    (2, ["parallel.precision=fp8", "parallel.pp=2", "parallel.schedule=zb"]),
    (2, ["parallel.pp=2", "parallel.schedule=terapipe", "parallel.zero_stage=3",
         "parallel.global_batch=4"]),
    (2, ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=1",
         "parallel.precision=fp16"]),
    (4, ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=terapipe"]),
    (2, ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.zero_stage=1",
         "parallel.micro_batch=1"]),
    (4, ["parallel.pp=2", "parallel.cp=2", "parallel.schedule=terapipe"]),
    (2, ["parallel.offload_activations=1", "parallel.pp=2", "parallel.schedule=terapipe",
         "parallel.global_batch=4"]),
    (2, ["parallel.zero_group=2"]),
    (2, ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.recompute=full",
         "parallel.micro_batch=1"]),
    (2, ["parallel.pp=2", "parallel.schedule=terapipe", "parallel.recompute=selective",
         "parallel.global_batch=4"]),
    (2, ["train.optimizer=galore", "parallel.cp=2"]),
    (2, ["train.optimizer=galore", "train.galore_reduce=projected", "train.grad_clip=0",
         "parallel.tp=2"]),
    (2, ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=1",
         "train.on_nonfinite=skip"]),
    (1, ["train.optimizer=lomo", "train.grad_clip=0", "train.on_nonfinite=skip"]),
    (2, ["train.optimizer=lomo", "parallel.zero_stage=3"]),
    (1, ["train.optimizer=lomo", "parallel.micro_batch=2"]),
    (1, ["train.optimizer=lomo", "parallel.precision=fp16", "train.grad_clip=0"]),
]


@pytest.mark.parametrize("index", range(len(ANY_USE + REFUSALS)))
def test_each_refusal_is_raised_with_its_key(index):
    """Row `index` of the table is the first that its configuration matches, and validation
    raises ConfigError naming that row's key with its message (values filled in)."""
    rows = ANY_USE + REFUSALS
    assert len(REFUSED) == len(rows)
    world, sets = REFUSED[index]
    cfg = load_config(None, DOCS.MODEL + sets)
    p = cfg.parallel
    have = features_of(cfg, world // (p.tp * p.pp * p.cp))
    row = rows[index]
    assert row.a in have and have.intersection(row.b), (row, have)
    with pytest.raises(ConfigError) as info:
        validate_for_training(cfg, world)
    assert info.value.key == row.key, str(info.value)
    assert str(info.value).endswith(filled(row.message, cfg)), str(info.value)


def test_a_refusal_holds_only_where_its_condition_does():
    """LOMO with the skip guard is refused `when` clipping is off (one backward, no norm
    before the update): with clipping, the row lets that configuration through."""
    validate_for_training(load_config(None, DOCS.MODEL + [
        "train.optimizer=lomo", "train.on_nonfinite=skip", "train.grad_clip=1.0"]), 1)
