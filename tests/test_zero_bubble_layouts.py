"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipe-V) with sequence parallelism, against one
process and the ledger, on gloo ranks.

Each layout trains 3 optimizer steps of the tiny model (4 blocks) through `Trainer.train_step`
on global batches of 8 sequences, pp 2 x tp 2 on 4 ranks; the reference is the single-process
Trainer with the same micro-batches. Tolerances are tests/parity.py's fp32-on-CPU ones at lr
1e-3: losses rel 1e-5, every parameter (gathered over the stages and the tp ranks) atol 1e-5
+ rtol 1e-4: the split backward and the tensor-parallel sums only change the order of float
additions. On the same steps every rank's ledger equals `predict_ledger` of the config
exactly: the W pass re-gathers each sequence-parallel region's input once per micro-batch, as
a full backward does, and the I pass re-gathers nothing (fivefold.parallel.tensor_comm).
The ranks start once per group; the
default suite runs ZB-H1, the V schedules are marked slow.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fivefold.comm import collectives as C
from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.parallel import tensor_comm
from fivefold.parallel.pipeline import executor
from fivefold.parallel.pipeline.build import build_pipeline_stage
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.tensor_stage import apply_tensor_parallel_to_stage
from fivefold.parallel.plan import plan_from_config, training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from parity import CPU, assert_ledgers_predicted, assert_params_close, full_parameters

STEPS = 3
SP = ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.layers=4"]
LAYOUTS = {  # group -> [(overrides, label)], all on 4 ranks
    "sp": [(SP + ["parallel.schedule=zb", "parallel.micro_batch=2"], "zb pp2 x tp2 sp")],
    "sp slow": [
        (SP + ["parallel.schedule=zbv", "parallel.vpp=2", "parallel.micro_batch=2",
               "model.tied_embeddings=true"], "zbv pp2 x tp2 sp tied"),
        (SP + ["parallel.schedule=dualpipev", "parallel.vpp=2", "parallel.micro_batch=2"],
         "dualpipev pp2 x tp2 sp")],
}
SLOW = [pytest.mark.slow, pytest.mark.timeout(2400)]  # minutes on 2 shared cores


def _train(rt, sets: list[str], run_dir: str) -> dict:
    """STEPS steps: losses, whole parameters of this rank's stages, the ledger's byte totals
    and model-state bytes."""
    trainer = Trainer(load_config(None, sets), rt, run_dir)
    losses = [trainer.train_step(s).loss for s in range(STEPS)]
    ledger = trainer.ledger  # read before full_parameters' gathers add to it
    out = {"losses": losses, "bytes": ledger.totals("bytes"),
           "wire": ledger.totals("wire_bytes"), "state": ledger.model_state_bytes}
    return {**out, "params": full_parameters(trainer)}


def _on_ranks(rt, base: list[str], layouts: list[list[str]], tmp: str) -> list[dict]:
    return [_train(rt, base + sets, f"{tmp}/{i}") for i, sets in enumerate(layouts)]


@pytest.fixture(scope="module")
def base(parity_overrides) -> list[str]:
    return parity_overrides + [f"train.steps={STEPS}"]


@pytest.mark.parametrize("group", ["sp", pytest.param("sp slow", marks=SLOW)])
def test_zero_bubble_layouts_match_one_process_and_the_ledger(group, base, tmp_path):
    """pp 2 x tp 2 with sequence parallelism: ZB-H1 (slow: ZB-V tied, DualPipe-V): losses,
    parameters and every rank's ledger."""
    world, layouts = 4, LAYOUTS[group]
    runs = run_on_ranks(_on_ranks, world, base, [s for s, _ in layouts], str(tmp_path),
                        timeout_s=2000)
    for i, (sets, label) in enumerate(layouts):
        same_model = [s for s in sets if s.startswith(("model.", "parallel.micro_batch"))]
        ref = _train(CPU, base + same_model, str(tmp_path / f"ref{i}"))
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
             for r in range(world)], (), label)


def test_weight_pass_regathers_each_region_once_and_the_input_pass_never(monkeypatch):
    """One rank, a sequence-parallel stage on a one-rank tp axis (2 blocks: 4 regions), 2
    micro-batches: 1F1B's backward re-gathers each region's input once per micro-batch (8);
    under ZB the I passes re-gather nothing and the W passes 8, and the gradients are 1F1B's
    to float rounding (rtol 1e-5)."""
    cfg = load_config(None, ["model.hidden=64", "model.heads=4", "model.kv_heads=2",
                             "model.ffn_hidden=96", "model.vocab=512", "model.seq_len=32",
                             "model.layers=2", "model.tied_embeddings=false",
                             "parallel.micro_batch=2"])
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    counts, phase = Counter(), ["outside"]
    gather = tensor_comm.gather_sequence

    def counted(x, axis, purpose):
        counts[phase[0], purpose] += 1
        return gather(x, axis, purpose)

    def in_phase(name, fn):
        def run(*args):
            phase[0] = name
            try:
                return fn(*args)
            finally:
                phase[0] = "outside"
        return run

    monkeypatch.setattr(tensor_comm, "gather_sequence", counted)
    monkeypatch.setattr(executor, "backward_input", in_phase("I", executor.backward_input))
    monkeypatch.setattr(executor, "backward_weight", in_phase("W", executor.backward_weight))
    grads = {}
    for name in ("1f1b", "zb"):
        counts.clear()
        ledger = Ledger()
        stage = build_pipeline_stage(cfg, plan_from_config(cfg, 1), 0, torch.device("cpu"))
        apply_tensor_parallel_to_stage(stage, C.Axis("tp", None, 1, 0, ledger), True)
        PipelineEngine(stage, build_schedule(name, 1, 2), C.Axis("pp", None, 1, 0, ledger)
                       ).train_step(tokens[:, :-1], tokens[:, 1:], 1e-2)
        grads[name] = {n: q.grad for n, q in stage.named_parameters()}
        regathers = {k[0]: n for k, n in counts.items() if k[1] == "sp_regather"}
        assert regathers == ({"outside": 8} if name == "1f1b" else {"W": 8}), (name, regathers)
    for name, g in grads["1f1b"].items():
        torch.testing.assert_close(grads["zb"][name], g, atol=1e-7, rtol=1e-5, msg=name)
