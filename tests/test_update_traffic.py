"""The optimizer update's memory traffic: the planner's count against the runtime's ops.

fivefold.planner.update_bytes counts the bytes fivefold's AdamW update moves per element;
here a dispatch mode adds up, op by op, what `Trainer._update` really reads and writes on a
step after the first (whose moments are created), and the two must agree within 0.1%: the
engine's within a few hundred bytes (its 0-dim tensors: the clip coefficient, AdamW's step
counters), the plain path's within its vectors' decay, which the count charges (the
smallest term counted, the gradient zeroing, is 4% of the total). Views
move nothing; in-place ops read and write their target (fill_, zero_ and copy_ only write
it); an op's tensors are read once however often they are passed (addcmul_'s g, g);
collectives are the ledger's and are timed as such, not counted here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.memory import stage_units
from fivefold.planner.update_bytes import eager_adamw_traffic
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer

WRITE_ONLY = {"fill_", "zero_", "copy_"}
CASES = {  # world size: overrides of each case
    1: [["parallel.zero_stage=1"], ["parallel.zero_stage=0"]],  # engine; torch's plain AdamW
    2: [["parallel.zero_stage=0"], ["parallel.zero_stage=2"], ["parallel.zero_stage=3"],
        ["parallel.zero_stage=0", "parallel.precision='bf16'"],
        ["parallel.zero_stage=3", "parallel.precision='bf16'"],
        ["parallel.zero_stage=1", "train.weight_decay=0.0"]],
}


class Traffic(TorchDispatchMode):
    """Bytes read and written by the aten ops run under it (module docstring)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.name.startswith("c10d::") or any(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a collective, or a view
        name = schema.name.split("::")[-1]
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        reads, written = {}, 0
        for arg, value in zip(schema.arguments, values):
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    written += n if mutated else 0
                    if not (mutated and name in WRITE_ONLY):
                        reads[t.data_ptr(), n] = n
        for ret, t in zip(schema.returns, tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                written += t.numel() * t.element_size()
        self.bytes += sum(reads.values()) + written
        return out


def _update_bytes(rt, overrides: list[str], cases: list[list[str]]) -> list[int]:
    out = []
    for sets in cases:
        trainer = Trainer(load_config(None, overrides + sets), rt, "unused")
        trainer.train_step(0)
        update, counted = trainer._update, Traffic()

        def counted_update(*args, **kwargs):
            with counted:
                return update(*args, **kwargs)

        trainer._update = counted_update
        trainer.train_step(1)
        out.append(counted.bytes)
    return out


@pytest.fixture(scope="module")
def overrides(tiny_overrides):
    sets = tiny_overrides + ["train.sample_tokens=0"]
    prepare_data(load_config(None, sets))
    return sets


@pytest.mark.parametrize("world", sorted(CASES))
def test_update_traffic_equals_the_runtimes_ops(world, overrides):
    counted = run_on_ranks(_update_bytes, world, overrides, CASES[world], timeout_s=600)[0]
    for sets, got in zip(CASES[world], counted):
        cfg = load_config(None, overrides + sets)
        lay = training_plan(cfg, world, "cpu")
        units = stage_units(cfg.model, lay, list(range(cfg.model.layers)), True, True)
        predicted, _ = eager_adamw_traffic(units, lay, cfg.train.weight_decay)
        assert predicted == pytest.approx(got, rel=1e-3), sets
