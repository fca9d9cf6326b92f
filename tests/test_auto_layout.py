"""`parallel = "auto"`: the planner picks a layout the runtime executes, and the run is that
layout's run (fivefold.planner.auto, docs/planner.md "Training the planner's layout")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import ParallelPlan, training_plan
from fivefold.planner.auto import layout_overrides, resolve_auto
from fivefold.train.checkpoint import latest_checkpoint
from fivefold.validate import validate_for_training


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_auto_is_parsed_from_a_file_and_from_set(tmp_path):
    spec = tmp_path / "auto.toml"
    spec.write_text('parallel = "auto"\n')
    cfg = load_config(spec, ["parallel.global_batch=16"])
    assert cfg.parallel.auto and cfg.parallel.global_batch == 16
    assert load_config(None, ["parallel=auto"]).parallel.auto
    assert load_config(None, ["parallel.auto=true"]).parallel.auto
    assert not load_config(spec, ["parallel.auto=false"]).parallel.auto
    spec.write_text('parallel = "fast"\n')
    with pytest.raises(ConfigError) as err:
        load_config(spec)
    assert err.value.key == "parallel"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_resolved_layout_validates_and_is_the_written_layout(world, tiny_overrides):
    """The winner passes the runtime's checks; its overrides, applied after `auto`, load to
    the very same config; the estimate describes that layout on `world` CPU ranks."""
    sets = tiny_overrides + ["parallel.global_batch=8", "parallel=auto"]
    auto = resolve_auto(load_config(None, sets), world, "cpu")
    validate_for_training(auto.cfg, world)
    assert not auto.cfg.parallel.auto
    assert load_config(None, sets + auto.overrides) == auto.cfg
    assert layout_overrides(auto.cfg) == auto.overrides
    p, est = auto.cfg.parallel, auto.estimate.parallel
    assert (est["tp"], est["pp"], est["cp"], est["zero_stage"], est["micro_batch"]) == \
        (p.tp, p.pp, p.cp, p.zero_stage, p.micro_batch)
    assert est["tp"] * est["pp"] * est["cp"] * est["dp"] == world
    assert auto.profile.name == "cpu" and est["precision"] == "fp32"
    assert auto.result.scored >= 1 and auto.estimate.step_time_s > 0
    # one plan: the scored one is the written config's training plan, and survives JSON
    assert auto.plan is auto.estimate.layout
    assert training_plan(auto.cfg, world, "cpu") == auto.plan
    assert ParallelPlan.from_dict(json.loads(json.dumps(auto.plan.to_dict()))) == auto.plan


def test_keys_set_alongside_auto_are_held_fixed(tiny_overrides):
    base = tiny_overrides + ["parallel.global_batch=8", "parallel=auto"]
    for extra, key, value in ((["parallel.zero_stage=3"], "zero_stage", 3),
                              (["parallel.micro_batch=1"], "micro_batch", 1),
                              (["parallel.tp=2"], "tp", 2),
                              (["parallel.pp=2"], "pp", 2)):
        auto = resolve_auto(load_config(None, base + extra), 2, "cpu")
        assert getattr(auto.cfg.parallel, key) == value, extra
        assert load_config(None, base + extra + auto.overrides) == auto.cfg, extra
    # a pipelined winner carries the planner's block split, which the run then uses
    assert auto.cfg.parallel.stage_layers == auto.estimate.stage_layers
    assert sum(auto.cfg.parallel.stage_layers) == auto.cfg.model.layers


@pytest.mark.parametrize("extra, world, key, words", [
    (["parallel.stage_layers=[1, 1]"], 2, "parallel.stage_layers", "cuts the blocks"),
    (["parallel.tp=3"], 2, "parallel.auto", "parallel.tp = 3"),  # 3 divides no head count
    ([], 3, "parallel.auto", "no layout for 3 rank(s)"),  # 8 sequences split over no dp
    # LOMO with fp16 loss scaling and no clipping runs on no searched layout of 2 ranks
    # (LOMO on none but data-parallel ones, fp16 LOMO on none without clipping): the reason
    # named is one of the user's own keys, not the recompute modes most candidates are
    # refused for
    (["parallel.precision=fp16", "train.optimizer=lomo", "train.grad_clip=0"], 2,
     "parallel.auto",
     "(e.g. config error in `train.optimizer`"),
])
def test_impossible_auto_configs_are_config_errors(extra, world, key, words, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["parallel.global_batch=8", "parallel=auto"]
                      + extra)
    with pytest.raises(ConfigError) as err:
        resolve_auto(cfg, world, "cpu")
    assert err.value.key == key and words in str(err.value)


def test_simulate_rejects_auto(tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text('parallel = "auto"\n[cluster]\ngpu = "cpu"\ngpus = 2\n')
    assert main(["simulate", str(spec)]) == 2
    assert "`parallel.auto`" in capsys.readouterr().err


def test_cli_trains_the_resolved_layout_on_two_ranks(tiny_overrides, tmp_path):
    """`fivefold train --set parallel=auto --nproc 2`: one resolution (printed once, before
    the ranks start), 2 steps on 2 gloo ranks, and the same losses (rel 1e-6: the same
    layout, data and seed) as the run with the printed layout written out."""
    sets = [a for s in tiny_overrides + ["parallel.global_batch=8"] for a in ("--set", s)]
    auto = run_cli("train", *sets, "--set", "parallel=auto", "--steps", "2", "--nproc", "2",
                   "--run-dir", str(tmp_path / "auto"))
    assert auto.returncode == 0, auto.stdout + auto.stderr
    lines = [ln for ln in auto.stdout.splitlines() if ln.startswith("parallel.auto: the same")]
    assert len(lines) == 1, auto.stdout
    written = lines[0].split("the same as ")[1].split()
    meta = json.loads((latest_checkpoint(tmp_path / "auto") / "meta.json").read_text())
    assert meta["config"]["parallel"]["auto"] is False
    # the ranks trained the plan the launcher scored, handed over as a plan, not as strings
    scored = resolve_auto(load_config(None, tiny_overrides + ["parallel.global_batch=8",
                                                              "parallel=auto"]), 2, "cpu").plan
    handed = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert ParallelPlan.from_dict(handed) == ParallelPlan.from_dict(meta["plan"]) == scored
    plain = run_cli("train", *sets, *(a for s in written for a in ("--set", s)), "--steps", "2",
                    "--nproc", "2", "--run-dir", str(tmp_path / "written"))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "parallel.auto:" not in plain.stdout
    losses = [[json.loads(ln)["loss"] for ln in (tmp_path / run / "metrics.jsonl").open()]
              for run in ("auto", "written")]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert json.loads((latest_checkpoint(tmp_path / "written") / "meta.json").read_text())[
        "config"] == meta["config"]


def test_plan_train_is_train_with_auto(tiny_overrides, tmp_path):
    """`fivefold plan SPEC --train` on one rank: the resolution line, 2 steps trained; an
    error no layout can fix (warm-up longer than the run) is reported as itself."""
    spec = tmp_path / "spec.toml"
    spec.write_text("[cluster]\ngpu = \"cpu\"\ngpus = 1\n")
    sets = [a for s in tiny_overrides for a in ("--set", s)]
    bad = run_cli("plan", str(spec), *sets, "--train", "--steps", "1", "--run-dir",
                  str(tmp_path / "bad"))
    assert bad.returncode == 2 and "`train.warmup_steps`" in bad.stderr
    proc = run_cli("plan", str(spec), *sets, "--train", "--steps", "2", "--run-dir",
                   str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parallel.auto: tp=1 pp=1 cp=1 dp=1" in proc.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
