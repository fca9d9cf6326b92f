"""MoE layers on a rank's share of the tokens (fivefold.parallel.moe_tokens) against one
process, on 2 gloo ranks: tp 2 with sequence parallelism, cp 2 in ring and in Ulysses mode,
and cp 2 ring with ep 2 over the cp ranks; on 4: tp 2 with sequence parallelism x
ep 2 over dp 2, cp 2 x tp 2 with sequence parallelism, and cp 4 in hybrid mode.

The tiny MoE of tests/test_expert_parallel.py (8 experts, top-2, both blocks MoE), dropless,
with the load-balancing loss, the router z-loss and a shared expert on, so every term whose
statistics span the micro-batch is exercised; 5 steps on global batches of 8 in micro-batches
of 2, the one-process reference's micro-batches. Tolerances are the fp32-on-CPU ones of
tests/parity.py (losses rtol 1e-5; parameters atol 1e-5 + rtol 1e-4, the experts gathered
over ep): the layouts differ from one process only in summation order, and Adam's eps is
1e-6 as in tests/test_tensor_parallel.py (with 1e-8 an embedding row whose first gradient is
nearly zero turns that rounding into a 2e-5 difference, measured here too). The load per expert
(an integer count summed over the ranks) must equal the reference's exactly, and the logged
auxiliary loss to rel 1e-5. With a capacity factor the capacity group is a rank's share of
the micro-batch (fivefold.models.moe), which one process does not reproduce, so capacity is
checked for what it promises there: each rank keeps what `capacity_keep` keeps of its own
tokens alone, at the capacity of its own token count. The activation bytes each block saves
for backward under tp 2 with sequence parallelism (saved-tensor hooks) are the planner's
`block_saved_bytes` within 5%, as tests/test_planner_ledger.py holds them.
"""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.config import load_config
from fivefold.memory.activation_count import SavedActivations
from fivefold.models.moe import MoE, capacity_keep
from fivefold.planner.activations import block_saved_bytes
from fivefold.testing import run_on_ranks
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer
from test_expert_parallel import MOE, assert_same_run, reference, train

SPLIT_MOE = MOE + ["model.moe.z_loss_weight=0.001", "model.moe.shared_experts=1",
                   "train.eps=1e-6"]
LAYOUTS = [  # (overrides, label), on 2 ranks
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "tp 2 sequence parallel"),
    (["parallel.cp=2", "parallel.cp_mode='ring'"], "cp 2 ring"),
    (["parallel.cp=2", "parallel.cp_mode='ulysses'"], "cp 2 Ulysses"),
    (["parallel.cp=2", "parallel.cp_mode='ring'", "parallel.ep=2"], "cp 2 ring x ep 2"),
]


def layouts_on_ranks(rt: Runtime, layouts: list[list[str]], run_dir: str,
                     capacity: list[str]) -> tuple[list[dict], list[tuple[int, int, int]],
                                                   list[tuple[int, float]]]:
    runs = [train(rt, sets, f"{run_dir}/{i}") for i, sets in enumerate(layouts)]
    return (runs, capacity_groups(rt, capacity, f"{run_dir}/capacity"),
            saved_bytes(rt, layouts[0], f"{run_dir}/saved"))


def saved_bytes(rt: Runtime, sets: list[str], run_dir: str) -> list[tuple[int, float]]:
    """Per block, (bytes it saves for backward over one micro-batch on this rank, counted by
    saved-tensor hooks; the planner's `block_saved_bytes` for it)."""
    cfg = load_config(None, sets)
    trainer = Trainer(cfg, rt, run_dir)
    x, y = trainer.train_sampler.rank_batch(0)
    x, y = x[:trainer.micro_batch], y[:trainer.micro_batch]
    labels = {f"layers.{i}": block for i, block in enumerate(trainer.model.layers)}
    with SavedActivations(trainer.model, labels) as acts:
        trainer.micro_batch_loss(x, y).backward()
    plan = trainer.plan
    return [(acts.bytes_by_label[name], block_saved_bytes(cfg.model, x.numel(), 4, plan.tp,
                                                          plan.sequence_parallel, layer=i))
            for i, name in enumerate(labels)]


def capacity_groups(rt: Runtime, sets: list[str], run_dir: str) -> list[tuple[int, int, int]]:
    """One tp 2 sequence-parallel step with a capacity factor: per MoE forward on this rank,
    (tokens it routed, assignments it kept, assignments kept when its own tokens alone are
    the group: `capacity_keep` at C = ceil(c N k / X) of its N)."""
    trainer = Trainer(load_config(None, sets), rt, run_dir)
    seen = []

    def record(m, args, out):
        x_ND = args[0].reshape(-1, args[0].shape[-1])
        n = x_ND.shape[0]
        kept = m.load.sum().item() - m.dropped  # this forward's: reset after each
        with torch.no_grad():
            experts_NK = m.route(x_ND)[2]
        cap = math.ceil(m.capacity_factor * n * m.top_k / m.experts)
        seen.append((n, kept, capacity_keep(experts_NK, m.experts, cap).sum().item()))
        m.reset_stats()

    for module in trainer.model.modules():
        if isinstance(module, MoE):
            module.register_forward_hook(record)
    trainer.train_step(0)
    return seen


LAYOUTS_4 = [  # (overrides, label), on 4 ranks
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"],
     "tp 2 sequence parallel x ep 2 over dp 2"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "cp 2 ring x tp 2 sequence parallel: the balancing counts over cp+tp"),
    (["parallel.cp=4", "parallel.cp_mode='hybrid'", "parallel.cp_ulysses=2"],
     "cp 4 hybrid (ring 2 x Ulysses 2)"),
]


def runs_on_ranks(rt: Runtime, layouts: list[list[str]], run_dir: str) -> list[dict]:
    return [train(rt, sets, f"{run_dir}/{i}") for i, sets in enumerate(layouts)]


def assert_matches(run: dict, ref: dict, label: str) -> None:
    """Losses and parameters (assert_same_run), exact loads, the aux loss to rel 1e-5."""
    assert_same_run(run, ref, label)
    for step, ref_step in zip(run["moe"], ref["moe"]):
        for layer, stats in step.items():
            assert stats["tokens_per_expert"] == ref_step[layer]["tokens_per_expert"], label
            assert stats["aux_loss"] == pytest.approx(ref_step[layer]["aux_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def split_sets(parity_overrides):
    return parity_overrides + SPLIT_MOE


def test_moe_on_sequence_and_context_shards_matches_one_process(split_sets, tmp_path):
    ref = reference(split_sets, tmp_path / "ref")
    capacity = split_sets + ["parallel.tp=2", "parallel.sequence_parallel=true",
                             "model.moe.capacity_factor=1.0"]
    results = run_on_ranks(layouts_on_ranks, 2, [split_sets + s for s, _ in LAYOUTS],
                           str(tmp_path / "runs"), capacity, timeout_s=900)
    for i, (_, label) in enumerate(LAYOUTS):
        for rank, (runs, _, _) in enumerate(results):
            assert_matches(runs[i], ref, f"{label}, rank {rank}")
    tokens = 2 * load_config(None, capacity).model.seq_len // 2  # micro-batch x T / tp
    for _, groups, _ in results:
        assert groups and all(n == tokens and kept == want for n, kept, want in groups)
        assert any(kept < 2 * n for n, kept, _ in groups)  # the capacity dropped some
    for _, _, blocks in results:  # the MoE layers save for their T / tp tokens only
        for counted, predicted in blocks:
            assert predicted == pytest.approx(counted, rel=0.05)


def test_moe_with_sequence_parallel_and_ep_or_cp_on_4_ranks_matches_one_process(
        split_sets, tmp_path):
    ref = reference(split_sets, tmp_path / "ref")
    per_rank = run_on_ranks(runs_on_ranks, 4, [split_sets + s for s, _ in LAYOUTS_4],
                            str(tmp_path / "runs"), timeout_s=900)
    for i, (_, label) in enumerate(LAYOUTS_4):
        for rank, runs in enumerate(per_rank):
            assert_matches(runs[i], ref, f"{label}, rank {rank}")
