"""The planner's command line: `simulate --json` and `--trace`, `plan --json`, `plan validate`,
and bad specs and profile files exiting 2 with the key named.
"""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.planner.spec import load_spec

from planner_specs import BAND_FIELDS, CONTEXT_FIELDS, OBJECTIVE_FIELDS, OUTPUT_FIELDS, spec


def _spec_file(tmp_path, table: dict):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_cli_simulate_json_and_trace(tmp_path, capsys):
    path = _spec_file(tmp_path, spec(parallel={"pp": 2, "micro_batch": 4}))
    trace = tmp_path / "trace.json"
    assert main(["simulate", path, "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == OUTPUT_FIELDS | CONTEXT_FIELDS | BAND_FIELDS
    events = json.loads(trace.read_text())["traceEvents"]
    computes = [e for e in events if e.get("ph") == "X" and e["tid"] == 0
                and e["name"][0] in "FB"]
    assert len(computes) == 2 * 2 * (128 // 32 // 4)  # F and B, 2 stages, 4 micro-batches
    assert {e["pid"] for e in computes} == {0, 1}


def test_cli_plan_json_lists_best_first(tmp_path, capsys):
    path = _spec_file(tmp_path, spec(model={"preset": "8B", "layers": 4},
                                     cluster={"gpus": 8}, parallel={"global_batch": 16}))
    assert main(["plan", path, "--top", "2", "--json"]) == 0
    captured = capsys.readouterr()
    best = json.loads(captured.out)
    assert len(best) == 2 and best[0]["step_time_s"] <= best[1]["step_time_s"]
    assert all(set(b) == OUTPUT_FIELDS | CONTEXT_FIELDS | BAND_FIELDS | OBJECTIVE_FIELDS
               for b in best)
    assert "scored" in captured.err
    assert main(["plan", path, "--top", "1"]) == 0
    assert "fivefold train" in capsys.readouterr().out


def test_cli_plan_validate_prints_rows_and_mape(capsys):
    assert main(["plan", "validate"]) == 0
    out = capsys.readouterr().out
    assert out.count("%") >= 37 and "MAPE all" in out
    assert "megatron21_t1_1.7B" in out


@pytest.mark.parametrize("table, key", [
    (spec(parallel={"tpp": 2}), "parallel.tpp"),
    (spec(parallel={"tp": 3}), "parallel.tp"),  # does not divide 64 devices
    (spec(parallel={"global_batch": 100}), "parallel.global_batch"),  # not over dp = 64
    (spec(cluster={"gpu": "Z100"}), "cluster.gpu"),
    ({"model": {"preset": "8B"}, "cluster": {"gpu": "H100-SXM"}}, "cluster.gpus"),
])
def test_bad_specs_exit_2_naming_the_key(tmp_path, capsys, table, key):
    assert main(["simulate", _spec_file(tmp_path, table)]) == 2
    assert f"`{key}`" in capsys.readouterr().err


def test_a_profile_file_that_does_not_parse(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    path = _spec_file(tmp_path, spec(cluster={"gpu": str(bad)}))
    assert main(["simulate", path]) == 2
    err = capsys.readouterr().err
    assert "`cluster.gpu`" in err and "does not parse" in err
    with pytest.raises(ConfigError):
        load_spec(path)
