"""Data parallelism: each stage reproduces the single-process run (parity), holds the memory
the ZeRO paper promises (model-state bytes per rank, exactly) and moves the bytes it promises
(communication ledger, exactly).

Parity tolerance: fp32 on CPU at lr 1e-3 (each step moves a parameter by up to 1e-3), after
5 optimizer steps losses agree to 2e-5 relative and parameters (scale 0.02) to 1e-5 absolute
+ 1e-4 relative. The layouts sum gradients in a different order than one process, and Adam
divides by the root of the second moment, so an element with a near-zero gradient turns a
rounding difference of 1e-12 into a parameter difference of about 2e-6 (measured, 8 ranks).
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

STEPS = 5
LAYOUTS_2 = [  # (zero_stage, zero_group, micro_batch)
    (0, None, None), (0, None, 1), (1, None, None), (1, None, 1), (2, None, None),
    (2, None, 1), (3, None, None), (3, None, 1)]
LAYOUTS_4 = [(0, None, None), (1, None, 1), (2, None, None), (3, None, 1), (1, 2, None),
             (2, 2, 1), (3, 2, None), (3, None, 1, ["parallel.hpz=true", "cluster.gpus_per_node=2"])]
LAYOUTS_8 = [(0, None, None), (1, None, None), (3, None, None), (3, 4, None), (2, 2, None)]


def _config(overrides, stage, group, micro, extra=()):
    sets = overrides + [f"parallel.zero_stage={stage}", f"train.steps={STEPS}", *extra]
    if group:
        sets.append(f"parallel.zero_group={group}")
    if micro:
        sets.append(f"parallel.micro_batch={micro}")
    return load_config(None, sets)


def _run(rt, cfg, tmp):
    trainer = Trainer(cfg, rt, tmp)
    losses = [trainer.train_step(s).loss for s in range(STEPS)]
    if trainer.engine:
        params = trainer.engine.full_state_dict()
    else:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, params, trainer.ledger


def _layouts(rt, overrides, layouts, tmp):
    out = []
    for layout in layouts:
        losses, params, ledger = _run(rt, _config(overrides, *layout), tmp)
        out.append((losses, params, ledger.model_state_bytes, ledger.as_dicts())
                   if rt.rank == 0 else None)
    return out


@pytest.fixture(scope="module")
def overrides(tiny_overrides):
    sets = tiny_overrides + ["parallel.global_batch=8", "train.sample_tokens=0", "train.lr=1e-3"]
    prepare_data(load_config(None, sets))  # tokenize once, before the ranks start
    return sets


@pytest.fixture(scope="module")
def reference(overrides, tmp_path_factory):
    cpu = Runtime(0, 1, 0, torch.device("cpu"))
    return {micro: _run(cpu, _config(overrides, 0, None, micro), tmp_path_factory.mktemp("r"))
            for micro in (None, 1)}


def _assert_parity(result, reference, label):
    losses, params = result[0], result[1]
    ref_losses, ref_params = reference[0], reference[1]
    assert losses == pytest.approx(ref_losses, rel=2e-5), label
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-5, msg=f"{label} {name}")


@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4), (8, LAYOUTS_8)])
def test_parity_with_one_process(world, layouts, overrides, reference, tmp_path):
    results = run_on_ranks(_layouts, world, overrides, layouts, str(tmp_path), timeout_s=600)[0]
    for layout, result in zip(layouts, results):
        _assert_parity(result, reference[layout[2]], f"world {world} layout {layout}")


class _Crash(Exception):
    pass


def _interrupted_and_straight(rt, overrides, layouts, tmp):
    """Per layout: metrics of an uninterrupted run and of one that crashed after step 3 and
    resumed from its step-2 checkpoint (read on rank 0)."""
    import json
    from pathlib import Path

    out = []
    for k, layout in enumerate(layouts):
        cfg = _config(overrides + ["train.checkpoint_every=2", "train.eval_every=100"], *layout)
        root = Path(tmp) / str(k)
        Trainer(cfg, rt, root / "straight").run()
        crashing = Trainer(cfg, rt, root / "resumed")
        real_step = crashing.train_step

        def crash_at_3(step, real_step=real_step):
            if step == 3:
                raise _Crash
            return real_step(step)

        crashing.train_step = crash_at_3
        try:
            crashing.run()
        except _Crash:
            pass
        Trainer(cfg, rt, root / "resumed").run()
        if rt.is_main:
            out.append(tuple([json.loads(line) for line in
                              (root / run / "metrics.jsonl").read_text().splitlines()]
                             for run in ("straight", "resumed")))
    return out


def test_sharded_checkpoint_resume_is_bit_identical(overrides, tmp_path):
    """The engine's DCP checkpoint (master shards + Adam moments) restores a run exactly."""
    layouts = [(0, None, None), (1, None, None), (3, None, 1), (2, 1, None)]
    results = run_on_ranks(_interrupted_and_straight, 2, overrides, layouts, str(tmp_path),
                           timeout_s=600)[0]
    for layout, (straight, resumed) in zip(layouts, results):
        assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)), layout
        for a, b in zip(straight, resumed):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (layout, a["step"])
