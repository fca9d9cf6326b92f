"""Expert tensor parallelism and parallel folding (fivefold.expert_grid,
fivefold.parallel.expert_tensor) against one process, on gloo ranks.

The tiny MoE of tests/test_expert_parallel.py (8 experts of width 32, top-2, both blocks MoE,
dropless, the load-balancing loss on) with a shared expert and the router z-loss, 5 steps on
global batches of 8 in micro-batches of 2, the one-process reference's micro-batches. Losses
and gradient norms to rtol 1e-5 (norms 1e-4: a sum of squares over differently split
parts), parameters (experts gathered over etp and ep) at tests/parity.py's fp32-on-CPU
tolerances, atol 1e-5 + rtol 1e-4; Adam's eps 1e-6 as in tests/test_moe_token_split.py. The
layouts differ from one process only in summation order (the etp partial outputs, the tp
and edp gradient sums). The load per expert, an integer count summed over the ranks, must
equal the reference's exactly.

Work and memory: etp 2 x ep 2 on 4 ranks (tp 2 x dp 2) against ep 2 on 2 ranks (dp 2),
the same micro-batches: each rank holds exactly half the expert elements of the matching ep
rank and runs exactly half its expert forward FLOPs (counted by torch's FlopCounterMode
around the experts' SwiGLU, in its "loop" form, which the counter sees).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fivefold.parallel.expert_tensor as expert_tensor
from fivefold.config import load_config
from fivefold.parallel.expert import gather_experts
from fivefold.testing import run_on_ranks
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer
from parity import assert_params_close, full_parameters
from test_expert_parallel import MOE

CPU = Runtime(0, 1, 0, torch.device("cpu"))
STEPS = 5
SETS = MOE + ["model.moe.z_loss_weight=0.001", "model.moe.shared_experts=1", "train.eps=1e-6"]


def train(rt: Runtime, sets: list[str], run_dir: str) -> dict:
    trainer = Trainer(load_config(None, sets), rt, run_dir)
    results = [trainer.train_step(s) for s in range(STEPS)]
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "load": [[s["tokens_per_expert"] for s in r.moe.values()] for r in results],
            "params": params}


def counted_expert_step(rt: Runtime, sets: list[str], run_dir: str,
                        backward: bool = False) -> tuple[Trainer, int]:
    """One step of `sets` with the experts' SwiGLU in its "loop" form (which FlopCounterMode
    sees), and the FLOPs of this rank's expert SwiGLUs on the rows and weights they got: of
    the forward, or with `backward` of a forward and backward; counted on detached copies,
    so the step itself runs as always."""
    flops = []
    plain = expert_tensor.expert_swiglu

    def counted(x, counts, w1, w3, w2, *args, **kwargs):
        copies = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
        with FlopCounterMode(display=False) as counter:
            out = plain(copies[0], counts, *copies[1:], *args, **kwargs)
            if backward:
                out.backward(torch.ones_like(out))
        flops.append(counter.get_total_flops())
        return plain(x, counts, w1, w3, w2, *args, **kwargs)

    expert_tensor.expert_swiglu = counted
    try:
        trainer = Trainer(load_config(None, sets + ["model.moe.expert_matmul='loop'"]), rt,
                          run_dir)
        trainer.train_step(0)
    finally:
        expert_tensor.expert_swiglu = plain
    return trainer, sum(flops)


def expert_work(rt: Runtime, sets: list[str], run_dir: str) -> dict:
    """One step: this rank's expert elements (its engine's expert units) and the forward
    FLOPs of its expert SwiGLUs; its place in the experts' grid."""
    trainer, flops = counted_expert_step(rt, sets, run_dir)
    engine, axes = trainer.engine, trainer.expert_axes
    return {"elements": sum(u.numel for u, e in zip(engine.units, engine.is_expert) if e),
            "flops": flops, "ep_rank": axes.ep.rank, "etp_rank": axes.etp.rank}


def on_ranks(rt: Runtime, layouts: list[list[str]], run_dir: str,
             work: list[str] | None = None) -> tuple[list[dict], dict | None]:
    runs = [train(rt, sets, f"{run_dir}/{i}") for i, sets in enumerate(layouts)]
    return runs, expert_work(rt, work, f"{run_dir}/work") if work else None


@pytest.fixture(scope="module")
def sets(parity_overrides):
    return parity_overrides + SETS


def assert_same_run(run: dict, ref: dict, label: str) -> None:
    torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-5, atol=0, msg=label)
    torch.testing.assert_close(run["norms"], ref["norms"], rtol=1e-4, atol=0, msg=label)
    assert run["load"] == ref["load"], label
    assert_params_close(run["params"], ref["params"], label)


def check(per_rank: list, ref: dict, labels: list[str]) -> None:
    for rank, (runs, _) in enumerate(per_rank):
        for run, label in zip(runs, labels):
            assert_same_run(run, ref, f"{label}, rank {rank}")


def test_etp_slices_partial_outputs_sum_to_the_expert():
    """The column slices of w1 and w3 and the matching row slice of w2 (`expert_slice`)
    give partial SwiGLU outputs that sum over the etp ranks to the whole expert's, for
    etp 2 and 4, with an expert that gets no row (fp32 sums in another order: atol 1e-5 +
    rtol 1e-5)."""
    gen = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(3, 16, 8, generator=gen) for _ in range(2))
    w2 = torch.randn(3, 8, 16, generator=gen)
    x, counts = torch.randn(7, 8, generator=gen), [4, 0, 3]
    whole = expert_tensor.expert_swiglu(x, counts, w1, w3, w2, "loop")
    for etp in (2, 4):
        parts = [expert_tensor.expert_swiglu(
            x, counts, *(expert_tensor.expert_slice(n, w, etp, r)
                         for n, w in (("w1", w1), ("w3", w3), ("w2", w2))), "loop")
                 for r in range(etp)]
        torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_tp2_folds_into_ep_and_etp_on_2_ranks(sets, tmp_path):
    """2 ranks: tp 2 with etp 1 folded into ep 2 (each tp rank routes half the tokens and
    holds half the experts, whole), and tp 2 with etp 2 (every expert split over the tp
    ranks, each routing half the tokens, with sequence parallelism)."""
    ref = train(CPU, sets, str(tmp_path / "ref"))
    layouts = [sets + ["parallel.tp=2", "parallel.ep=2"],
               sets + ["parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"]]
    per_rank = run_on_ranks(on_ranks, 2, layouts, str(tmp_path / "runs"), timeout_s=600)
    check(per_rank, ref, ["tp 2 folded into ep 2", "tp 2 sp x etp 2"])


@pytest.mark.slow
def test_etp2_by_ep2_on_4_ranks_halves_expert_memory_and_flops(sets, tmp_path):
    """4 ranks: etp 2 x ep 2 over tp 2 x dp 2, with ZeRO-1; etp 2 x ep 2 over dp 4 (the etp
    ranks hold other tokens: no tensor parallelism at all); and, against ep 2 on 2 ranks,
    half the expert elements and forward FLOPs per rank."""
    ref = train(CPU, sets, str(tmp_path / "ref"))
    grid = ["parallel.etp=2", "parallel.ep=2"]
    layouts = [sets + ["parallel.tp=2", "parallel.zero_stage=1"] + grid, sets + grid]
    work = sets + ["parallel.tp=2"] + grid
    per_rank = run_on_ranks(on_ranks, 4, layouts, str(tmp_path / "runs"), work,
                            timeout_s=900)
    check(per_rank, ref, ["etp 2 x ep 2 over tp 2 x dp 2 zero1", "etp 2 x ep 2 over dp 4"])
    whole = {w["ep_rank"]: w for w in run_on_ranks(expert_work, 2, sets + ["parallel.ep=2"],
                                                   str(tmp_path / "work2"), timeout_s=600)}
    for _, w in per_rank:
        assert w["etp_rank"] in (0, 1)
        assert 2 * w["elements"] == whole[w["ep_rank"]]["elements"]
        assert 2 * w["flops"] == whole[w["ep_rank"]]["flops"] > 0


@pytest.mark.slow
def test_pp2_by_ep2_by_etp2_on_8_ranks(sets, tmp_path):
    """8 ranks: 2 pipeline stages (1F1B), each tp 2 x dp 2 with etp 2 x ep 2 over them; the
    stages' parameters together are the one-process run's."""
    ref = train(CPU, sets, str(tmp_path / "ref"))
    layouts = [sets + ["parallel.pp=2", "parallel.tp=2", "parallel.etp=2", "parallel.ep=2"]]
    per_rank = run_on_ranks(on_ranks, 8, layouts, str(tmp_path / "runs"), timeout_s=1200)
    first, last = per_rank[0][0][0], per_rank[4][0][0]
    torch.testing.assert_close(first["losses"], ref["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(first["norms"], ref["norms"], rtol=1e-4, atol=0)
    assert_params_close({**first["params"], **last["params"]}, ref["params"], "pp2 ep2 etp2")
