"""The pre-flight memory check of `fivefold train` (fivefold.preflight): a run the planner
predicts cannot fit is refused before the tokenizer, the data and the ranks, naming the
biggest term and the single switches that make it fit; the default run passes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold import cli, preflight
from fivefold.cli import main
from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import training_plan

GiB = 2**30


def _check(sets: list[str], ranks: int, machine: preflight.Machine) -> None:
    cfg = load_config(None, sets)
    plan = training_plan(cfg, ranks, machine.device_type)
    preflight.check(cfg, plan, ranks, ranks, machine)


def _no_ranks(monkeypatch) -> list:
    """Replace the rank's training by a recorder: the check must decide before it."""
    calls = []
    monkeypatch.setattr(cli, "_train_this_rank", lambda *a, **k: calls.append(a) or 0)
    return calls


def test_8b_on_this_machine_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    calls = _no_ranks(monkeypatch)
    run_dir = tmp_path / "run"
    assert main(["train", "--set", "model.preset=8B", "--set", "train.device=cpu",
                 "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run cannot fit" in err and "biggest term is" in err
    assert "GiB" in err and "train.preflight=false" in err
    assert calls == [] and not run_dir.exists()  # no tokenizer, no data, no rank


def test_preflight_false_skips_the_check(tmp_path, monkeypatch):
    calls = _no_ranks(monkeypatch)
    assert main(["train", "--set", "model.preset=8B", "--set", "train.device=cpu",
                 "--set", "train.preflight=false", "--run-dir", str(tmp_path / "r")]) == 0
    assert len(calls) == 1


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_default_run_fits_this_machine(ranks):
    _check([], ranks, preflight.this_machine(torch.device("cpu")))


def test_a_refusal_offers_only_switches_that_fit():
    cfg = load_config(None, [])
    need = preflight.predicted_need(cfg, training_plan(cfg, 1, "cpu"), 1, "cpu")
    # a host with 80% of what the default run needs: activations are its biggest term
    machine = preflight.Machine("cpu", None, int(0.8 * need.host_bytes))
    with pytest.raises(ConfigError) as err:
        _check([], 1, machine)
    text = str(err.value)
    assert "biggest term is activations" in text and "micro_batch=1" in text
    offered = [part.split()[1] for part in text.split("it fits with one of: ")[1].split("; ")
               if part.startswith("--set ")]
    assert offered
    for switch in offered:  # each offered switch passes the same check
        _check([switch], 1, machine)


def test_gpu_ranks_are_checked_per_device_and_zero_3_is_offered():
    machine = preflight.Machine("cuda", 80 * GiB, 2000 * GiB)
    with pytest.raises(ConfigError) as err:
        _check(["model.preset=8B"], 8, machine)
    text = str(err.value)
    assert "on the fullest GPU" in text and "biggest term is optimizer states" in text
    assert "--set parallel.zero_stage=3" in text
    _check(["model.preset=8B", "parallel.zero_stage=3"], 8, machine)
    # the device is one GPU's: 8 ranks on 8 GPUs fit where their sum would not
    cfg = load_config(None, ["model.preset=1B"])
    need = preflight.predicted_need(cfg, training_plan(cfg, 8, "cuda"), 8, "cuda")
    assert need.fits(dataclasses.replace(machine, device_bytes=int(need.total)))
    assert not need.fits(dataclasses.replace(machine, device_bytes=int(need.total) - 1))


def test_offload_needs_the_host(monkeypatch):
    """GPU offload moves optimizer state to the host: a host that cannot hold it refuses."""
    cfg = load_config(None, ["model.preset=1B", "parallel.offload=cpu"])
    plan = training_plan(cfg, 8, "cuda")
    need = preflight.predicted_need(cfg, plan, 8, "cuda")
    assert need.host_bytes > 0
    with pytest.raises(ConfigError, match="host memory"):
        preflight.check(cfg, plan, 8, 8, preflight.Machine("cuda", 80 * GiB,
                                                          int(need.host_bytes) - 1))


def test_mem_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert preflight.mem_available_bytes(str(meminfo)) == 1000 * 1024
    assert preflight.mem_available_bytes(str(tmp_path / "none")) is None
