"""The memory report at the end of `fivefold train` (fivefold.train.memory_report): the
measured model states and the first micro-batch's saved activations equal the planner's to
the byte (tolerance 0), on the default one-rank run, on a ZeRO-3 x tp 2 run on 4 ranks
(every rank), with MoE layers, and with bf16 autocast on the plain path's fp32 weights under
selective recomputation (whose cache the measured row holds); the report reaches
summary.json and the console."""

from __future__ import annotations

import json

from fivefold.config import load_config
from fivefold.parallel.plan import training_plan
from fivefold.planner.rank_memory import predicted_rank_memory
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer
from parity import CPU

STATES = ("params", "grads", "optimizer")


def _check(memory: dict, label: str) -> None:
    got, want = memory["measured"], memory["predicted"]
    for key in STATES:
        assert got[key] == want[key], (label, key, got[key], want[key])
    assert got["activations_per_micro_batch"] == want["activations_per_micro_batch"], label
    assert got["process_peak"] > got["params"], label


def _run(rt, sets, run_dir):
    cfg = load_config(None, sets)
    plan = training_plan(cfg, rt.world_size, "cpu")
    trainer = Trainer(cfg, rt, f"{run_dir}/r", plan=plan,
                      predicted_memory=predicted_rank_memory(cfg, plan, rt.rank,
                                                             rt.device.type))
    return trainer.run()["memory"]


def test_default_run_reports_its_memory(tiny_overrides, tmp_path, capsys):
    sets = tiny_overrides + ["train.steps=2", "train.sample_tokens=0"]
    memory = _run(CPU, sets, tmp_path)
    _check(memory, "one rank")
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["memory"] == memory
    out = capsys.readouterr().out
    assert "memory on rank 0 (MiB, measured / planner):" in out and "optimizer states" in out


def test_zero3_tp_run_reports_each_ranks_memory(tiny_overrides, tmp_path):
    sets = tiny_overrides + ["train.steps=2", "train.sample_tokens=0", "parallel.tp=2",
                             "parallel.sequence_parallel=true", "parallel.zero_stage=3",
                             "parallel.micro_batch=1"]
    prepare_data(load_config(None, sets))  # once, in this process
    memories = run_on_ranks(_run, 4, sets, str(tmp_path), timeout_s=300)
    for rank, memory in enumerate(memories):
        assert memory["rank"] == rank
        _check(memory, f"rank {rank}")


def test_moe_run_reports_its_memory(tiny_overrides, tmp_path):
    """A dropless MoE model with a shared expert and both auxiliary losses: the router,
    dispatch, grouped expert matmuls and combine save what the planner counts, to the byte."""
    sets = tiny_overrides + ["train.steps=2", "train.sample_tokens=0", "model.moe.experts=4",
                             "model.moe.expert_ffn_hidden=128", "model.moe.shared_experts=1",
                             "model.moe.aux_loss_weight=0.01", "model.moe.z_loss_weight=0.001"]
    _check(_run(CPU, sets, tmp_path), "moe")


def test_bf16_selective_run_reports_its_memory(tiny_overrides, tmp_path):
    """bf16 on one rank trains fp32 weights under autocast (fivefold.planner.
    activations_autocast: the block input is the fp32 residual), and selective recomputation
    keeps its cache until backward, which the measured row counts."""
    sets = tiny_overrides + ["train.steps=2", "train.sample_tokens=0",
                             "parallel.precision='bf16'", "parallel.recompute='selective'"]
    _check(_run(CPU, sets, tmp_path), "bf16 selective")

