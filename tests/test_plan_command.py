"""`fivefold plan` and `simulate` as a user calls them: the batch is checked per candidate
layout, the layout keys a spec sets are held fixed, and both say which software stack and
which hardware profile (from where) the prediction assumes, in text and in --json."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.hardware import PROFILES
from fivefold.planner.stack import STACKS


def _spec(tmp_path, name: str = "spec.json", **sections) -> str:
    table = {"model": {"preset": "8B", "layers": 4}, "cluster": {"gpu": "H100-SXM", "gpus": 16},
             "parallel": {"global_batch": 8}}
    for section, values in sections.items():
        table[section] = {**table.get(section, {}), **values}
    path = tmp_path / name
    path.write_text(json.dumps(table))
    return str(path)


def _plan_json(capsys, *argv) -> list[dict]:
    assert main(["plan", *argv, "--top", "20", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_batch_smaller_than_the_devices_plans_layouts_that_split_it(tmp_path, capsys):
    # the spec's default layout, dp = 16, cannot split 8 sequences; layouts with dp <= 8 can
    best = _plan_json(capsys, _spec(tmp_path))
    assert best
    for est in best:
        p = est["parallel"]
        assert 8 % p["dp"] == 0 and p["dp"] * p["tp"] * p["pp"] * p["cp"] == 16


def test_layout_keys_the_spec_sets_are_held_fixed(tmp_path, capsys):
    path = _spec(tmp_path, parallel={"global_batch": 8, "tp": 2, "pp": 2})
    best = _plan_json(capsys, path)
    assert len(best) > 1
    assert {(e["parallel"]["tp"], e["parallel"]["pp"]) for e in best} == {(2, 2)}
    free = _plan_json(capsys, _spec(tmp_path, "free.json"))  # without them the search goes elsewhere
    assert {(e["parallel"]["tp"], e["parallel"]["pp"]) for e in free} != {(2, 2)}
    held = _plan_json(capsys, path, "--set", "parallel.zero_stage=3",
                      "--set", "parallel.recompute=full")
    assert {(e["parallel"]["zero_stage"], e["parallel"]["recompute"]) for e in held} == {
        (3, "full")}


@pytest.mark.parametrize("sets, key", [
    (["parallel.tp=3"], "parallel.tp"),  # 3 does not divide 16 devices
    (["parallel.dp=16"], "parallel.global_batch"),  # dp held at 16 cannot split 8
    (["parallel.tp=16"], "parallel.tp"),  # no layout keeps tp = 16 in 8-device nodes
])
def test_held_keys_no_layout_can_keep_exit_2_naming_them(tmp_path, capsys, sets, key):
    argv = [a for s in sets for a in ("--set", s)]
    assert main(["plan", _spec(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert f"`{key}`" in err and err.count("\n") == 1


def test_simulate_names_the_default_stack_and_the_run_precision_peak(tmp_path, capsys):
    path = _spec(tmp_path, cluster={"gpu": "cpu", "gpus": 2},
                 model={"preset": "tiny"}, parallel={"global_batch": 8})
    assert main(["simulate", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("stack: fivefold (this runtime; default")
    assert 'train.stack = "megatron"' in lines[0]
    profile = next(line for line in lines if line.startswith("profile"))
    fp32 = PROFILES["cpu"].peak_tflops["fp32"]
    assert f"peak {fp32:g} TFLOP/s fp32" in profile and "built-in" in profile
    assert "fp32" in lines[1]  # the layout line: the run is fp32 on the cpu profile


def test_json_carries_stack_release_source_and_profile_origin(tmp_path, capsys):
    profile = tmp_path / "calibrated.json"
    profile.write_text(json.dumps({**PROFILES["H100-SXM"].to_dict(), "name": "my-node"}))
    path = _spec(tmp_path, cluster={"gpu": str(profile)},
                 train={"stack": "megatron", "stack_release": "2024-09"})
    assert main(["simulate", path, "--set", "parallel.tp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stack"] == {"name": "megatron", "release": "2024-09",
                            "source": STACKS["megatron"].source}
    assert out["profile"]["name"] == "my-node" and out["profile"]["from"] == f"file {profile}"
    best = _plan_json(capsys, _spec(tmp_path, "default.json"))
    assert all(e["stack"]["name"] == "fivefold" and e["stack"]["release"] is None
               and e["profile"] == {"name": "H100-SXM", "from": "built-in",
                                    "source": PROFILES["H100-SXM"].source} for e in best)
    assert main(["plan", path, "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("stack: megatron 2024-09 (Megatron-Core")
    assert lines[1] == f"profile: my-node (file {profile})"
