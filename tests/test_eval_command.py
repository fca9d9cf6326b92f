"""`fivefold eval`: a checkpoint's loss on held-out data, under any layout.

One tiny run (fp32, CPU) is trained once; its last checkpoint is evaluated in one process,
against the run's own last `val_loss`, on `--data` holding exactly its validation data, and
on two ranks under tensor parallelism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.config import load_config
from fivefold.train.corpus import Document, is_validation
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer

from test_train import CPU, read_metrics, run_cli


@pytest.fixture(scope="module")
def trained_run(tiny_overrides, tmp_path_factory) -> tuple[Path, list[str]]:
    sets = tiny_overrides + ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=4",
                             "train.sample_tokens=0", "parallel.global_batch=8"]
    run_dir = tmp_path_factory.mktemp("run")
    Trainer(load_config(None, sets), CPU, run_dir).run()
    return run_dir, sets


def eval_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_equals_the_runs_last_validation_loss(trained_run, capsys):
    """The same weights, the same validation batches, the same fp32 arithmetic on one
    process: equal to the run's last `val_loss` exactly."""
    run_dir, _ = trained_run
    result = eval_json(capsys, str(run_dir))
    assert result["loss"] == read_metrics(run_dir)[-1]["val_loss"]
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]), rel=1e-12)
    assert result["step"] == 4 and result["tokens"] == 4 * 8 * 32
    assert Path(result["checkpoint"]).name == "step_00000004"
    step_folder = eval_json(capsys, str(run_dir / "checkpoints" / "step_00000004"),
                            "--batches", "2")
    assert step_folder["tokens"] == 2 * 8 * 32 and step_folder["loss"] != result["loss"]
    main(["eval", str(run_dir)])
    line = capsys.readouterr().out.strip().splitlines()[-1]  # after the "loaded" line
    assert line.startswith("eval ") and f"loss {result['loss']:.4f}" in line
    assert "\n" not in line


def test_eval_data_holding_the_validation_split_gives_its_loss(trained_run, small_corpus,
                                                               tmp_path, capsys):
    """--data as text (a folder of exactly the held-out documents: tokenized with the run's
    tokenizer into the same stream) and as raw ids (that stream written out): both draw the
    validation pass's windows of the same tokens, so the loss is the default eval's exactly."""
    run_dir, sets = trained_run
    default = eval_json(capsys, str(run_dir))["loss"]
    cfg = load_config(None, sets)
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    for path in sorted(small_corpus.iterdir()):
        if is_validation(Document(path.name, ""), cfg.data.val_fraction):
            shutil.copy(path, held_out / path.name)
    assert len(list(held_out.iterdir())) >= 2
    assert eval_json(capsys, str(run_dir), "--data", str(held_out))["loss"] == default
    ids = tmp_path / "val.bin"
    ids.write_bytes(np.asarray(prepare_data(cfg).val, dtype="<u2").tobytes())
    assert eval_json(capsys, str(run_dir), "--data", str(ids))["loss"] == default


def test_eval_on_two_ranks_with_tensor_parallelism_matches_one(trained_run, capsys):
    """--nproc 2 --set parallel.tp=2: the whole weights split over tp 2 on two launched
    ranks. Tolerance 1e-5 relative: the tp matmuls and the vocabulary-parallel loss sum in
    another order."""
    run_dir, _ = trained_run
    one = eval_json(capsys, str(run_dir))["loss"]
    proc = run_cli("eval", str(run_dir), "--nproc", "2", "--set", "parallel.tp=2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    assert two["loss"] == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize("args, key", [
    (["--data", "no/such/path"], "--data"),
    (["--batches", "0"], "--batches"),
    (["--set", "parallel.tp=3"], "parallel.tp"),
])
def test_eval_mistakes_exit_2_naming_the_key(trained_run, args, key, capsys):
    run_dir, _ = trained_run
    assert main(["eval", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert f"`{key}`" in err and len(err.strip().splitlines()) == 1


def test_eval_of_a_folder_without_checkpoints_exits_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "no finished checkpoint" in capsys.readouterr().err
