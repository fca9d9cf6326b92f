"""What the parity tests share: a few Trainer steps with everything they compare collected,
the resume-from-a-checkpoint run, and the parameter comparison.

A parity test trains the same config through the single-process Trainer (the reference) and
through a parallel layout, and compares per-step losses and the final parameters. The
tolerances are arguments: each test file states its own, and why, in its docstring; the
defaults are the fp32-on-CPU ones at lr 1e-3 that tests/test_data_parallel.py derives
(parameters of scale 0.02 to atol 1e-5 + rtol 1e-4).
"""

from __future__ import annotations

import pytest

from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

from fivefold.config import Config
from fivefold.parallel.tensor import gather_full_state
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

STEPS = 5
CPU = Runtime(0, 1, 0, torch.device("cpu"))


class TrainedRun(NamedTuple):
    """A run of `steps` optimizer steps, as this rank sees it."""

    losses: list[float]  # per step: mean token loss of the global batch
    grad_norms: list[float]  # per step: global gradient norm before clipping
    params: dict[str, torch.Tensor]  # this rank's parameters by name, whole (full_parameters)
    records: list[dict]  # the last step's ledger records
    val_loss: float | None  # Trainer.evaluate() after the steps, when asked for
    first_ledger: tuple  # the first step's (bytes totals, wire-bytes totals, model-state bytes)


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters by name as full tensors: gathered over the data-parallel shards
    (when an engine holds them) and the tensor-parallel ranks (vocabulary padding dropped).
    A pipeline stage's are only that stage's."""
    if trainer.engine:
        return gather_full_state(trainer.engine.full_state_dict(), trainer.cfg.model.vocab,
                                 trainer.tp_axis)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def train_steps(rt: Runtime, cfg: Config, run_dir: str | Path, steps: int = STEPS,
                evaluate: bool = False) -> TrainedRun:
    """`steps` Trainer steps from step 0 (then a validation pass if `evaluate`); a collective
    call when rt has several ranks, so every rank must make it."""
    trainer = Trainer(cfg, rt, run_dir)
    results = [trainer.train_step(0)]
    first_ledger = (trainer.ledger.totals("bytes"), trainer.ledger.totals("wire_bytes"),
                    dict(trainer.ledger.model_state_bytes))
    results += [trainer.train_step(s) for s in range(1, steps)]
    records = trainer.ledger.as_dicts()  # before evaluate adds its own collectives
    val_loss = trainer.evaluate() if evaluate else None
    return TrainedRun([r.loss for r in results], [r.grad_norm for r in results],
                      full_parameters(trainer), records, val_loss, first_ledger)


def resumed_losses(rt: Runtime, cfg: Config, run_dir: str | Path, save_at: int,
                   steps: int) -> tuple[list[float], int, Trainer]:
    """Losses of `save_at` steps, a checkpoint, then a new Trainer that resumes from it in the
    same run_dir and trains up to `steps`; also the step it resumed at and that Trainer."""
    first = Trainer(cfg, rt, run_dir)
    losses = [first.train_step(s).loss for s in range(save_at)]
    first._save(save_at)
    second = Trainer(cfg, rt, run_dir)
    start = second._resume()
    losses += [second.train_step(s).loss for s in range(start, steps)]
    return losses, start, second


def assert_params_close(params: dict[str, torch.Tensor], ref_params: dict[str, torch.Tensor],
                        label: str, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """The same parameter names, and every value within atol + rtol * |reference|."""
    assert params.keys() == ref_params.keys(), label
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=rtol, atol=atol, msg=f"{label} {name}")


def assert_state_equal(got: tuple, want: tuple, label: str) -> None:
    """The same weights and optimizer states (read_training_state), bit for bit."""
    (weights, states), (want_weights, want_states) = got, want
    assert weights.keys() == want_weights.keys() and states.keys() == want_states.keys(), label
    for name, tensor in want_weights.items():
        assert torch.equal(weights[name], tensor), (label, name)
    for name, state in want_states.items():
        assert state.keys() == states[name].keys(), (label, name)
        for kind, tensor in state.items():
            assert torch.equal(states[name][kind], tensor), (label, name, kind)


MOE_ROUTED = ("moe_combine", "moe_dispatch_backward")  # sized by the routing the step did


def moe_run(rt: Runtime, sets: list[str], steps: int = 5) -> dict:
    """`steps` steps: losses, whole parameters (experts gathered over ep), the first step's
    ledger (bytes totals, wire-bytes totals, model-state bytes)."""
    from fivefold.config import load_config
    from fivefold.parallel.expert import gather_experts

    trainer = Trainer(load_config(None, sets), rt, "unused")
    losses = [trainer.train_step(0).loss]
    ledger = (trainer.ledger.totals("bytes"), trainer.ledger.totals("wire_bytes"),
              trainer.ledger.model_state_bytes)
    losses += [trainer.train_step(s).loss for s in range(1, steps)]
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return {"losses": losses, "params": params, "ledger": ledger}


def moe_runs(rt: Runtime, layouts: list[list[str]]) -> list[dict]:
    return [moe_run(rt, sets) for sets in layouts]


def assert_ledgers_predicted(predicted: list, recorded: list, routed: tuple,
                             label: str) -> Counter:
    """Each rank's predicted ledger (fivefold.planner.ledger_model.predict_ledger) against
    its recorded (bytes totals, wire-bytes totals, model-state bytes): every collective
    exact, except the `routed` purposes (sized by the routing the step did), which are
    exact summed over the ranks. Returns those sums (empty where no routed purpose ran)."""
    routed_want, routed_have = Counter(), Counter()
    for rank, (ledger, (nbytes, wire, state)) in enumerate(zip(predicted, recorded)):
        for key, have in (("bytes", nbytes), ("wire_bytes", wire)):
            want = ledger.totals(key)
            assert want.keys() == have.keys(), (label, rank, key)
            for k, count in want.items():
                if k[2] in routed:
                    routed_want[key, k] += count
                    routed_have[key, k] += have[k]
                else:
                    assert have[k] == count, (label, rank, k)
        assert ledger.model_state_bytes == state, (label, rank)
    assert routed_want == routed_have, label
    return routed_want


def assert_hf_export_matches(source: Path, hf_dir: Path) -> tuple:
    """`fivefold convert` of the checkpoint folder `source` into `hf_dir`: a Hugging Face
    folder whose logits in transformers equal fivefold's on the checkpoint's weights (rtol
    1e-4, atol 1e-5). Returns the checkpoint read back and the folder's tensors by name, for
    the caller's per-tensor checks."""
    transformers = pytest.importorskip("transformers")
    from fivefold.models.hf import read_hf_tensors
    from fivefold.models.llama import Transformer
    from fivefold.train.checkpoint_export import read_checkpoint
    from fivefold.train.model_source import convert

    _, fmt = convert(source, hf_dir)
    assert fmt == "hf"
    pre = read_checkpoint(source)
    model = Transformer(pre.cfg)
    model.load_state_dict(pre.state)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = torch.randint(0, pre.cfg.vocab, (2, pre.cfg.seq_len),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), loaded(tokens).logits
    assert ours.abs().max() > 0.1  # a few steps from init: logits of magnitude 0.1-1
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    return pre, read_hf_tensors(hf_dir)


def assert_moe_layouts_match(world: int, base: list[str], layouts: list[tuple],
                             timeout_s: float = 600) -> list:
    """`moe_run` of `base` in one process against each of `layouts`, (overrides, label,
    quantized), all on `world` gloo ranks in one process start: every rank sees the same
    losses; a layout that changes no arithmetic but the order of sums matches to losses
    rtol 1e-5 and `assert_params_close`'s fp32 tolerance, one that sends int8 on purpose
    (ZeRO++ qwZ, qgZ) to losses rtol 1e-2 and every parameter within 10% relative (L2 of
    the difference over L2 of the reference); every rank's first-step ledger equals
    `predict_ledger` (the `MOE_ROUTED` rows summed over the ranks). Returns the per-rank
    runs, for the caller's own checks."""
    from fivefold.config import load_config
    from fivefold.parallel.plan import training_plan
    from fivefold.planner.ledger_model import predict_ledger
    from fivefold.testing import run_on_ranks

    ref = moe_run(CPU, base)
    per_rank = run_on_ranks(moe_runs, world, [base + sets for sets, _, _ in layouts],
                            timeout_s=timeout_s)
    for i, (sets, label, quantized) in enumerate(layouts):
        run = per_rank[0][i]
        for rank in per_rank:
            assert rank[i]["losses"] == run["losses"], label
        if quantized:
            torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-2, atol=0,
                                       msg=label)
            worst = max((run["params"][n] - p).norm() / p.norm()
                        for n, p in ref["params"].items())
            print(f"{label}: losses {run['losses']} vs {ref['losses']}, worst relative "
                  f"parameter error {worst:.2e}")
            assert worst < 0.1, (label, worst)
        else:
            torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-5, atol=0,
                                       msg=label)
            assert_params_close(run["params"], ref["params"], label)
        cfg = load_config(None, base + sets)
        plan = training_plan(cfg, world, "cpu")
        assert_ledgers_predicted([predict_ledger(cfg, plan, rank=r) for r in range(world)],
                                 [rank[i]["ledger"] for rank in per_rank], MOE_ROUTED, label)
    return per_rank


def staged_run(rt: Runtime, sets: list[str], run_dir: str, steps: int) -> dict:
    """`steps` steps: losses, whole parameters of this rank's stages (experts gathered over
    ep), the ledger's byte totals and model-state bytes."""
    from fivefold.config import load_config
    from fivefold.parallel.expert import gather_experts

    trainer = Trainer(load_config(None, sets), rt, run_dir)
    losses = [trainer.train_step(s).loss for s in range(steps)]
    ledger = trainer.ledger  # read before full_parameters' gathers add to it
    out = {"losses": losses, "bytes": ledger.totals("bytes"),
           "wire": ledger.totals("wire_bytes"), "state": ledger.model_state_bytes}
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return {**out, "params": params}


def staged_runs(rt: Runtime, base: list[str], layouts: list[list[str]], tmp: str,
                steps: int) -> list[dict]:
    return [staged_run(rt, base + sets, f"{tmp}/{i}", steps) for i, sets in enumerate(layouts)]


def assert_layouts_match_one_process(world: int, base: list[str], layouts: list[tuple],
                                     tmp_path: Path, steps: int, routed: tuple) -> None:
    """Each of `layouts`, (overrides, label), trained `steps` steps on `world` gloo ranks
    (one process start for all), against the one-process run of its model keys and
    micro-batches: every rank's losses within rel 1e-5, the parameters of all its ranks'
    stages together within `assert_params_close`'s fp32 tolerance, and every rank's ledger
    `predict_ledger`'s (the `routed` purposes summed over the ranks)."""
    from fivefold.config import load_config
    from fivefold.parallel.plan import training_plan
    from fivefold.planner.ledger_model import predict_ledger
    from fivefold.testing import run_on_ranks

    runs = run_on_ranks(staged_runs, world, base, [s for s, _ in layouts], str(tmp_path),
                        steps, timeout_s=2000)
    for i, (sets, label) in enumerate(layouts):
        same_model = [s for s in sets if s.startswith(("model.", "parallel.micro_batch"))]
        ref = staged_run(CPU, base + same_model, str(tmp_path / f"ref{i}"), steps)
        params = {}
        for rank in range(world):
            run = runs[rank][i]
            assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), (label, rank)
            params.update(run["params"])
        assert_params_close(params, ref["params"], label)
        cfg = load_config(None, base + sets)
        plan = training_plan(cfg, world, "cpu")
        assert_ledgers_predicted(
            [predict_ledger(cfg, plan, rank=r) for r in range(world)],
            [(runs[r][i]["bytes"], runs[r][i]["wire"], runs[r][i]["state"])
             for r in range(world)], routed, label)
