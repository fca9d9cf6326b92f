"""The trainer end to end: loss falls, exact resume, atomic checkpoints, CLI contract."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fivefold import cli
from fivefold.config import load_config
from fivefold.memory.activation_count import SavedActivations
from fivefold.planner.activations import block_saved_bytes
from fivefold.train.checkpoint import PARTIAL, complete_checkpoints, latest_checkpoint
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

CPU = Runtime(0, 1, 0, torch.device("cpu"))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


class SimulatedCrash(Exception):
    pass


def straight_and_resumed(cfg, root: Path, crash_at: int) -> tuple[list[dict], list[dict], str]:
    """Metrics of an uninterrupted `run()` in root/straight and of one in root/resumed that
    crashes before step `crash_at` and is run again, and the checkpoint it resumed from."""
    Trainer(cfg, CPU, root / "straight").run()
    interrupted = Trainer(cfg, CPU, root / "resumed")
    real_step = interrupted.train_step

    def crashing(step):
        if step == crash_at:
            raise SimulatedCrash
        return real_step(step)

    interrupted.train_step = crashing
    with pytest.raises(SimulatedCrash):
        interrupted.run()
    resumed_from = latest_checkpoint(root / "resumed").name
    Trainer(cfg, CPU, root / "resumed").run()
    return read_metrics(root / "straight"), read_metrics(root / "resumed"), resumed_from


def test_loss_falls_and_metrics_contract(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["train.steps=12", "train.eval_every=6",
                                              "train.checkpoint_every=6"])
    summary = Trainer(cfg, CPU, tmp_path).run()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    assert (tmp_path / "sample.txt").read_text().startswith("def ")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000006",
                                                                "step_00000012"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "galore"])
def test_resume_is_bit_identical(tiny_overrides, tmp_path, optimizer):
    """fp32 on CPU: the losses after a resume equal those of an uninterrupted run exactly
    (with Muon or GaLore: both optimizers' states come back, Muon's momentum or GaLore's
    projections and low-rank moments, and AdamW's moments)."""
    sets = tiny_overrides + ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=4",
                             "parallel.micro_batch=2", "train.sample_tokens=0",
                             f"train.optimizer={optimizer}"]
    straight, resumed, resumed_from = straight_and_resumed(load_config(None, sets), tmp_path,
                                                           crash_at=6)
    assert resumed_from == "step_00000004"
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], a["step"]
        assert a.get("val_loss") == b.get("val_loss")


def test_recompute_changes_nothing_but_memory(tiny_overrides, tmp_path):
    """parallel.recompute = 'full' and 'selective' on one rank (fp32, CPU): under 'full' each
    block keeps only its input (a x D bytes per token, counted), under 'selective' what the
    planner predicts, to the byte; the recomputed forward is the same computation, so
    losses, gradient norms and parameters equal the run without it bit for bit."""
    sets = tiny_overrides + ["train.steps=3", "parallel.micro_batch=2"]
    runs = {}
    for mode in ("none", "full", "selective"):
        trainer = Trainer(load_config(None, sets + [f"parallel.recompute={mode}"]), CPU,
                          tmp_path / mode)
        model, m = trainer.model, trainer.cfg.model
        with SavedActivations(model, {"block": model.layers[0]}) as acts:
            model(torch.zeros(2, m.seq_len, dtype=torch.long))
        kept = acts.bytes_by_label["block"]
        assert (kept == 2 * m.seq_len * m.hidden * 4) == (mode == "full"), (mode, kept)
        if mode == "selective":
            assert kept == block_saved_bytes(m, 2 * m.seq_len, 4, recompute="selective")
        results = [trainer.train_step(s) for s in range(3)]
        runs[mode] = ([(r.loss, r.grad_norm) for r in results],
                      {n: q.detach().clone() for n, q in trainer.model.named_parameters()})
    plain, plain_params = runs["none"]
    for mode in ("full", "selective"):
        recomputed, recomputed_params = runs[mode]
        assert recomputed == plain, mode
        for name, q in plain_params.items():
            assert torch.equal(recomputed_params[name], q), (mode, name)


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_lomo_is_sgd_fused_into_backward(tiny_overrides, tmp_path, clip):
    """train.optimizer = 'lomo' equals torch's SGD without momentum over the same groups,
    with and without clipping (two backward passes when clipping): losses, gradient norms
    and parameters bit for bit; no gradient is left on any parameter after a step; a
    checkpoint without optimizer state resumes exactly."""
    sets = tiny_overrides + ["train.steps=4", "train.lr=0.05", f"train.grad_clip={clip}",
                             "train.checkpoint_every=2", "train.eval_every=100",
                             "train.sample_tokens=0"]
    runs = {}
    for name, extra in (("lomo", ["train.optimizer=lomo"]),
                        ("sgd", ["train.optimizer=sgd", "train.beta1=0"])):
        trainer = Trainer(load_config(None, sets + extra), CPU, tmp_path / name)
        results = [trainer.train_step(s) for s in range(4)]
        assert all(q.grad is None for q in trainer.model.parameters()), name
        runs[name] = ([(r.loss, r.grad_norm) for r in results],
                      {n: q.detach().clone() for n, q in trainer.model.named_parameters()})
    assert runs["lomo"][0] == runs["sgd"][0]
    for n, q in runs["sgd"][1].items():
        assert torch.equal(runs["lomo"][1][n], q), n
    # inside backward: right after each parameter's gradient is complete (a hook that runs
    # after LOMO's), no parameter holds a gradient; a plain backward holds them all
    trainer = Trainer(load_config(None, sets + ["train.optimizer=lomo"]), CPU, tmp_path / "x")
    params, held = list(trainer.model.parameters()), []
    for q in params:
        q.register_post_accumulate_grad_hook(
            lambda q: held.append(sum(p.grad is not None for p in params)))
    trainer.train_step(0)
    passes = 1 if clip == "0" else 2  # clipping measures the norm in a first backward
    assert trainer.optimizer is None and len(held) == passes * len(params) and max(held) == 0
    straight, resumed, resumed_from = straight_and_resumed(
        load_config(None, sets + ["train.optimizer=lomo"]), tmp_path, crash_at=3)
    assert resumed_from == "step_00000002"
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_resume_with_another_layout_is_resharded(tiny_overrides, tmp_path, capsys):
    """A checkpoint of the plain one-rank trainer (torch's AdamW by parameter) seeds a ZeRO-1
    run (the engine's flat units) on resume: it says what it resharded, and the continued
    losses are the straight plain run's, rel 1e-6 (the same AdamW on the same values, its
    elements in other tensors; tests/test_resharding.py has the multi-rank layouts)."""
    sets = tiny_overrides + ["train.steps=4", "train.sample_tokens=0", "train.eval_every=100"]
    Trainer(load_config(None, sets), CPU, tmp_path / "straight").run()
    Trainer(load_config(None, sets + ["train.steps=2"]), CPU, tmp_path / "run").run()
    capsys.readouterr()
    Trainer(load_config(None, sets + ["parallel.zero_stage=1"]), CPU, tmp_path / "run").run()
    assert "from zero_stage 0 to zero_stage 1" in capsys.readouterr().out
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert ([r["loss"] for r in resumed] ==
            pytest.approx([r["loss"] for r in straight], rel=1e-6))


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import fivefold.train.checkpoint as ckpt
    from fivefold.config import load_config
    from fivefold.train.dist import Runtime
    from fivefold.train.trainer import Trainer

    real_save = ckpt.dcp.save
    def save_then_die(state, checkpoint_id):
        if str(checkpoint_id).endswith("step_00000004" + ckpt.PARTIAL):
            real_save(state, checkpoint_id=checkpoint_id)   # shards on disk, not yet renamed
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(state, checkpoint_id=checkpoint_id)
    ckpt.dcp.save = save_then_die
    cfg = load_config(None, sys.argv[2:])
    Trainer(cfg, Runtime(0, 1, 0, torch.device("cpu")), sys.argv[1]).run()
""")


def test_checkpoint_killed_mid_save_leaves_last_good_one(tiny_overrides, tmp_path):
    sets = tiny_overrides + ["train.steps=6", "train.checkpoint_every=2", "train.eval_every=100",
                             "train.sample_tokens=0"]
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(run_dir), *sets], timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (run_dir / "checkpoints" / f"step_00000004{PARTIAL}").is_dir()
    assert latest_checkpoint(run_dir).name == "step_00000002"

    resumed = Trainer(load_config(None, sets), CPU, run_dir)
    resumed.run()
    assert not list((run_dir / "checkpoints").glob(f"*{PARTIAL}"))
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))


@pytest.mark.parametrize("args, key", [
    (["--set", "model.kv_heads=3"], "model.kv_heads"),
    (["--set", "train.lr=-1"], "train.lr"),
    (["--set", "model.nope=1"], "model.nope"),
    (["--set", "data.source='/no/such/path'"], "data.source"),
    (["--set", "parallel.zero_stage=7"], "parallel.zero_stage"),
    (["--nproc", "3", "--set", "parallel.global_batch=8"], "parallel.global_batch"),
    (["/no/such/config.toml"], "CONFIG"),
])
def test_cli_config_error_exits_2_without_traceback(args, key, tmp_path, capsys):
    """`fivefold train` with a bad config: status 2, the key named on stderr, no traceback
    and no run started (in this process: the command line's own code path)."""
    assert cli.main(["train", *args, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"`{key}`" in err
    assert "Traceback" not in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_python_m_fivefold_exits_2_on_a_config_error(tmp_path):
    """The same through `python -m fivefold`: the process's exit status is main's 2."""
    proc = run_cli("train", "--set", "model.kv_heads=3", "--run-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "`model.kv_heads`" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_two_ranks_match_one_rank(tiny_overrides, tmp_path):
    """--nproc 2 (torch.distributed.run, gloo, DDP) reproduces the one-process losses.

    Tolerance 1e-5 relative: the two runs sum gradients in a different order.
    """
    sets = [a for s in tiny_overrides + ["train.eval_every=3", "train.checkpoint_every=3"]
            for a in ("--set", s)]
    one = run_cli("train", *sets, "--steps", "3", "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = run_cli("train", *sets, "--steps", "3", "--nproc", "2", "--run-dir",
                  str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout + two.stderr
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert len(list((latest_checkpoint(tmp_path / "two")).glob("rank_*.pt"))) == 2
    again = run_cli("train", *sets, "--steps", "3", "--run-dir", str(tmp_path / "one"))
    assert again.returncode == 0 and "already complete" in again.stdout


@pytest.mark.parametrize("shape", [(8, 20), (20, 8)])
def test_galore_is_adam_in_a_refreshed_low_rank_subspace(shape):
    """GaLore on one matrix, 3 steps with a subspace refresh every 2 (steps 0 and 2), against
    the algorithm written out (arXiv 2403.03507, Alg. 2): rank 8 // 4 = 2, projection from
    the left for a wide matrix and from the right for a tall one; float rounding only."""
    from fivefold.memory.galore import GaLoreAdamW

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape))
    ref = w.detach().clone()
    opt = GaLoreAdamW([w], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                      update_gap=2, scale=0.25)
    left, m, v = shape[0] <= shape[1], 0.0, 0.0
    for k in range(1, 4):
        g = torch.randn(shape)
        w.grad = g.clone()
        opt.step()
        if k in (1, 3):  # refresh: top-2 singular vectors of this gradient
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            proj = u[:, :2] if left else vh[:2].T
        low = proj.T @ g if left else g @ proj
        m = 0.9 * m + 0.1 * low
        v = 0.95 * v + 0.05 * low * low
        n = (m / (1 - 0.9 ** k)) / ((v / (1 - 0.95 ** k)).sqrt() + 1e-8)
        ref = ref * (1 - 0.1 * 0.1) - 0.1 * 0.25 * (proj @ n if left else n @ proj.T)
        torch.testing.assert_close(w.detach(), ref, rtol=1e-5, atol=1e-6)
    assert opt.state[w]["exp_avg"].shape == ((2, 20) if left else (20, 2))


def test_galore_randomized_refresh_finds_the_subspace_deterministically():
    """GaLore 2's randomized SVD refresh (train.galore_svd = 'randomized'): on a gradient
    with a clear rank-2 part (singular values 100 and 50 over noise of norm about 1), the
    rank-2 projector is within 1e-3 of the exact SVD's (spectral norm); the same seed gives
    the same basis bit for bit, and the global RNG is left as it was."""
    from fivefold.memory.galore import GaLoreAdamW

    g = torch.Generator().manual_seed(0)
    for shape, left in (((16, 40), True), ((40, 16), False)):
        a, b = torch.linalg.qr(torch.randn(shape[0], 2, generator=g))[0], \
            torch.linalg.qr(torch.randn(shape[1], 2, generator=g))[0]
        grad = a @ torch.diag(torch.tensor([100.0, 50.0])) @ b.T \
            + 0.05 * torch.randn(shape, generator=g)
        exact = GaLoreAdamW([torch.nn.Parameter(torch.zeros(shape))], 0.1, (0.9, 0.95), 1e-8,
                            0.0, 1, 1.0).subspace(grad, 2, left, seed=0)
        randomized = GaLoreAdamW([torch.nn.Parameter(torch.zeros(shape))], 0.1, (0.9, 0.95),
                                 1e-8, 0.0, 1, 1.0, svd="randomized")
        before = torch.get_rng_state()
        p1, p2 = (randomized.subspace(grad, 2, left, seed=7) for _ in range(2))
        assert torch.equal(torch.get_rng_state(), before)
        assert torch.equal(p1, p2)
        gap = torch.linalg.matrix_norm(p1 @ p1.T - exact @ exact.T, ord=2)
        assert gap < 1e-3, (shape, gap)


def test_galore_randomized_and_exact_runs_end_close(tiny_overrides, tmp_path):
    """The tiny model trained 20 steps with GaLore, exact against randomized refresh: the
    final losses within 1% (the default run's figures are in docs/training.md)."""
    sets = tiny_overrides + ["train.steps=20", "train.optimizer=galore",
                             "train.galore_update_gap=5"]
    losses = {}
    for svd in ("exact", "randomized"):
        trainer = Trainer(load_config(None, sets + [f"train.galore_svd={svd}"]), CPU,
                          tmp_path / svd)
        losses[svd] = [trainer.train_step(s).loss for s in range(20)]
    assert losses["randomized"][0] == losses["exact"][0]  # the first step's loss precedes
    assert losses["randomized"][-1] == pytest.approx(losses["exact"][-1], rel=0.01)
    assert losses["randomized"] != losses["exact"]  # the refreshes differ
