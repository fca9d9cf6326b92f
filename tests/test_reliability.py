"""Faults a run survives: a full disk during a save, non-finite steps, a collective that one
rank never reaches (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fivefold.train.checkpoint as ckpt
from fivefold.config import ConfigError, load_config
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.nonfinite import NonFiniteError
from fivefold.train.trainer import Trainer
from fivefold.validate import validate_for_training

CPU = Runtime(0, 1, 0, torch.device("cpu"))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rng_state_round_trips_through_weights_only(tmp_path):
    """rank_R.pt holds tensors and plain values only: torch.load(weights_only=True) reads it
    and every generator continues where it was saved."""
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    torch.save({"rng": ckpt.rng_state(CPU.device)}, tmp_path / "r.pt")
    expected = torch.rand(3), np.random.rand(3), random.random()
    ckpt.set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"], CPU.device)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_disk_full_during_save_keeps_the_last_checkpoint(tiny_overrides, tmp_path, monkeypatch):
    """ENOSPC while DCP writes the step-4 checkpoint: the run stops with a message naming the
    checkpoint that stands, no `.partial` is left, and the rerun resumes from step 2 (its
    rank_0.pt read with weights_only) to the very losses of an uninterrupted run (fp32)."""
    sets = tiny_overrides + ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=100",
                             "train.eval_batches=1", "train.sample_tokens=0"]
    cfg = load_config(None, sets)
    Trainer(cfg, CPU, tmp_path / "straight").run()
    real_save = ckpt.dcp.save

    def disk_full(state, checkpoint_id):
        if "step_00000004" in str(checkpoint_id):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    run_dir = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointWriteError,
                       match=r"could not write checkpoint step_00000004 .*No space left on "
                             r"device.*step_00000002, is intact"):
        Trainer(cfg, CPU, run_dir).run()
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(run_dir).name == "step_00000002"
    assert not list((run_dir / "checkpoints").glob(f"*{ckpt.PARTIAL}"))
    Trainer(cfg, CPU, run_dir).run()
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 5))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["grad_norm"]) for r in straight]


# ---------------------------------------------------------------- the non-finite guard

def poison_gradient(trainer: Trainer, index: int = 3):
    """Make parameter `index`'s gradient NaN in the next backward(s); (its name, the hook)."""
    name, q = [(n, q) for n, q in trainer.model.named_parameters() if q.requires_grad][index]
    return name, q.register_hook(lambda g: torch.full_like(g, float("nan")))


def state_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of `trainer` holds (parameters, optimizer state), cloned."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            out[prefix] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", trainer._checkpoint_state())
    return out


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_skip_drops_the_update_and_counts_it(tiny_overrides, tmp_path, capsys):
    """One plain rank, train.on_nonfinite = "skip": a NaN gradient at step 2 leaves every
    parameter and AdamW moment as it was, the metrics count it from then on, the progress
    output says so, and step 3 trains on."""
    sets = tiny_overrides + ["train.steps=3", "train.eval_every=100", "train.eval_batches=1",
                             "train.sample_tokens=0", "train.log_every=1",
                             "train.on_nonfinite=skip"]
    trainer = Trainer(load_config(None, sets), CPU, tmp_path)
    real_step, seen = trainer.train_step, {}

    def poisoned(step):
        if step != 1:
            return real_step(step)
        before = state_tensors(trainer)
        _, hook = poison_gradient(trainer)
        result = real_step(step)
        hook.remove()
        seen["untouched"] = same_state(before, state_tensors(trainer))
        return result

    trainer.train_step = poisoned
    trainer.run()
    assert seen["untouched"]
    records = read_metrics(tmp_path)
    assert [r["skipped_steps"] for r in records] == [0, 1, 1]
    assert torch.isnan(torch.tensor(records[1]["grad_norm"]))
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in (records[0], records[2]))
    out = capsys.readouterr()
    assert "step 2: non-finite loss or gradient norm, update skipped" in out.out
    assert "skipped 1 non-finite" in out.err


def test_stop_names_the_step_and_the_parameter(tiny_overrides, tmp_path):
    sets = tiny_overrides + ["train.steps=3", "train.sample_tokens=0"]
    trainer = Trainer(load_config(None, sets), CPU, tmp_path)  # "stop" is the default
    trainer.train_step(0)
    name, _ = poison_gradient(trainer, index=5)
    with pytest.raises(NonFiniteError, match=rf"step 2: non-finite .* on rank 0 is "
                                             rf"{name.replace('.', r'[.]')}\b"):
        trainer.train_step(1)


def test_lomo_skips_before_its_applying_pass(tiny_overrides, tmp_path):
    """LOMO with clipping measures the norm in a first backward: a NaN there skips the pass
    that would apply the update, so no parameter moves."""
    sets = tiny_overrides + ["train.steps=3", "train.optimizer=lomo", "train.grad_clip=1.0",
                             "train.sample_tokens=0", "train.on_nonfinite=skip"]
    trainer = Trainer(load_config(None, sets), CPU, tmp_path)
    trainer.train_step(0)
    before = {n: q.detach().clone() for n, q in trainer.model.named_parameters()}
    poison_gradient(trainer)
    trainer.train_step(1)
    assert trainer.skipped_steps == 1
    assert all(torch.equal(q, before[n]) for n, q in trainer.model.named_parameters())


@pytest.mark.parametrize("sets, ranks, message", [
    (["train.on_nonfinite=maybe"], 1, "is not one of"),
    (["train.on_nonfinite=skip", "train.optimizer=lomo", "train.grad_clip=0"], 1,
     "LOMO without clipping"),
    (["train.on_nonfinite=skip", "parallel.pp=2", "parallel.schedule=pipedream-2bw",
      "parallel.micro_batch=1"], 2, "PipeDream-2BW updates each stage"),
])
def test_on_nonfinite_is_validated(tiny_overrides, sets, ranks, message):
    with pytest.raises(ConfigError, match=rf"`train.on_nonfinite`: .*{message}"):
        validate_for_training(load_config(None, tiny_overrides + sets), ranks)


def _nonfinite_on_ranks(rt: Runtime, sets: list[str], run_dir: str) -> dict:
    """Step 1 trains; at step 2 rank 1 alone poisons a gradient. Under "skip": whether this
    rank's state is untouched and the loss and norm it saw; under "stop": the error."""
    out = {}
    for policy in ("skip", "stop"):
        trainer = Trainer(load_config(None, sets + [f"train.on_nonfinite={policy}"]), rt,
                          Path(run_dir) / policy)
        trainer.train_step(0)
        before = state_tensors(trainer)
        name = poison_gradient(trainer)[0] if rt.rank == 1 else None
        try:
            result = trainer.train_step(1)
            out[policy] = (same_state(before, state_tensors(trainer)), result.grad_norm,
                           trainer.skipped_steps)
        except NonFiniteError as err:
            out[policy] = str(err)
        out["name"] = name
    return out


NONFINITE_LAYOUTS = {"zero1-dp2": ["parallel.zero_stage=1"],
                     "pp2-1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
                     "galore-zero2-dp2": ["train.optimizer=galore", "parallel.zero_stage=2"]}


def _nonfinite_layouts(rt: Runtime, layouts: dict[str, list[str]], run_dir: str) -> dict:
    return {name: _nonfinite_on_ranks(rt, sets, f"{run_dir}/{name}")
            for name, sets in layouts.items()}


@pytest.fixture(scope="module")
def nonfinite(tiny_overrides, tmp_path_factory) -> list[dict]:
    """Each rank's _nonfinite_on_ranks of every layout, from one start of 2 ranks."""
    layouts = {name: tiny_overrides + layout + ["train.steps=3", "train.sample_tokens=0",
                                                 "parallel.micro_batch=2"]
               for name, layout in NONFINITE_LAYOUTS.items()}
    for sets in layouts.values():
        prepare_data(load_config(None, sets))
    return run_on_ranks(_nonfinite_layouts, 2, layouts, str(tmp_path_factory.mktemp("nan")),
                        timeout_s=480)


@pytest.mark.parametrize("layout", NONFINITE_LAYOUTS)
def test_nonfinite_guard_agrees_across_ranks(nonfinite, layout):
    """2 gloo ranks, a NaN gradient on rank 1 only: under "skip" both ranks drop the update
    (the norm they share is NaN) and keep parameters and optimizer state; under "stop" both
    raise at step 2, and the rank holding the poisoned gradient names the parameter."""
    results = [rank[layout] for rank in nonfinite]
    for r in results:
        untouched, norm, skipped = r["skip"]
        assert untouched and math.isnan(norm) and skipped == 1
        assert r["stop"].startswith("step 2: non-finite")
    name = results[1]["name"]
    assert any(f"is {name}." in r["stop"] for r in results), [r["stop"] for r in results]


# ---------------------------------------------------------------- the hang guard

HANG_TIMEOUT_S = 3.0


def _skip_one_collective(rt: Runtime, run_dir: str) -> tuple[str, float]:
    """Two axes over both ranks, with a 3 s timeout each; at step 1 rank 1 skips the "dp"
    all-reduce and waits in the "tp" one, which rank 0 never reaches: both time out. The
    error each rank raised, and how long after issuing it."""
    import datetime

    import torch.distributed as dist

    from fivefold.comm import collectives as C
    from fivefold.comm.flight_recorder import CollectiveError
    from fivefold.comm.ledger import Ledger

    ledger = Ledger()
    ledger.recorder.directory = Path(run_dir) / "flight_recorder"
    timeout = datetime.timedelta(seconds=HANG_TIMEOUT_S)
    dp = C.Axis("dp", dist.new_group([0, 1], timeout=timeout), 2, rt.rank, ledger)
    tp = C.Axis("tp", dist.new_group([0, 1], timeout=timeout), 2, rt.rank, ledger)
    x = torch.ones(8)
    ledger.start_step(0)
    C.all_reduce(x, dp, "grads")
    C.all_reduce(x, tp, "tp_activations")
    ledger.start_step(1)
    start = time.monotonic()
    try:
        if rt.rank == 0:
            C.all_reduce(x, dp, "grads")
        C.all_reduce(x, tp, "tp_activations")
    except CollectiveError as err:
        return str(err), time.monotonic() - start
    return "", time.monotonic() - start


def test_skipped_collective_is_named_with_the_missing_rank(tmp_path):
    """A rank that skips a collective: both ranks fail within the timeout plus a margin
    (no hang; run_on_ranks kills at 120 s), each writes its flight recorder, and the error
    names the operation, the axis and the rank that never reached it."""
    (zero, zero_s), (one, one_s) = run_on_ranks(_skip_one_collective, 2, str(tmp_path),
                                                timeout_s=120)
    assert zero.startswith("all_reduce on axis 'dp' (purpose 'grads', step 1, collective #2 "
                           "on this axis) failed on rank 0: "), zero
    assert "never reached by rank 1 (waiting in all_reduce@tp #2, step 1)" in zero, zero
    assert one.startswith("all_reduce on axis 'tp'"), one
    assert "never reached by rank 0 (waiting in all_reduce@dp #2, step 1)" in one, one
    assert max(zero_s, one_s) < HANG_TIMEOUT_S + 10
    for rank in (0, 1):
        record = json.loads((tmp_path / "flight_recorder" / f"rank_{rank}.json").read_text())
        assert record["failed"]["axis"] == ("dp" if rank == 0 else "tp")
        assert [(e["op"], e["axis"], e["step"]) for e in record["entries"]][:2] == [
            ("all_reduce", "dp", 0), ("all_reduce", "tp", 0)]
        assert record["entries"][0]["bytes"] == 32 and record["stacks"]
