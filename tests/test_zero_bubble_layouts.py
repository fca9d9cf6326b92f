"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipe-V) with sequence parallelism and with
activation recomputation, against one process and the ledger, on gloo ranks.

Each layout trains 3 optimizer steps of the tiny model (4 blocks) through `Trainer.train_step`
on global batches of 8 sequences, pp 2 x tp 2 on 4 ranks; the reference is the single-process
Trainer with the same micro-batches. Tolerances are tests/parity.py's fp32-on-CPU ones at lr
1e-3: losses rel 1e-5, every parameter (gathered over the stages and the tp ranks) atol 1e-5
+ rtol 1e-4: the split backward, the recomputed forward and the tensor-parallel sums only
change the order of float additions. On the same steps every rank's ledger equals
`predict_ledger` of the config exactly: the W pass re-gathers each sequence-parallel region's
input once per micro-batch, as a full backward does, and the I pass re-gathers nothing
(fivefold.parallel.tensor_comm); a recomputed block runs its forward, and its collectives,
once more, in I, and W reuses that recomputation (fivefold.parallel.pipeline.split_backward).
One-rank checks count the re-gathers and the recomputed forwards per pass. The ranks start
once per group; the default suite runs one layout (25 s measured on 2 shared CPU cores), the
rest are marked slow (2 to 12 minutes each group there, depending on the load)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fivefold.comm import collectives as C
from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.memory.recompute import apply_full_recompute, apply_selective_recompute
from fivefold.parallel import tensor_comm
from fivefold.parallel.pipeline import executor
from fivefold.parallel.pipeline.build import build_pipeline_stage
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.tensor_stage import apply_tensor_parallel_to_stage
from fivefold.parallel.plan import plan_from_config
from parity import assert_layouts_match_one_process

STEPS = 3
PP_TP = ["parallel.pp=2", "parallel.tp=2", "model.layers=4"]
SP = PP_TP + ["parallel.sequence_parallel=true"]
V = ["parallel.vpp=2"]
PP_DP = ["parallel.pp=2", "model.layers=4"]  # dp 2: the rest of the 4 ranks
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01"]
FULL, SELECTIVE = "parallel.recompute=full", "parallel.recompute=selective"
TIED = "model.tied_embeddings=true"


def zb(name: str, *sets: str, micro: int = 2) -> list[str]:
    return [f"parallel.schedule={name}", f"parallel.micro_batch={micro}", *sets]


LAYOUTS = {  # group -> [(overrides, label)], all on 4 ranks
    "4": [(zb("zb", *SP, FULL), "zb pp2 x tp2 sp, full recompute")],
    "4 slow": [
        (zb("zb", *SP), "zb pp2 x tp2 sp"),
        (zb("zbv", *SP, *V, TIED, FULL), "zbv pp2 x tp2 sp tied, full recompute"),
        (zb("dualpipev", *SP, *V, SELECTIVE), "dualpipev pp2 x tp2 sp, selective recompute"),
        (zb("zbv", *PP_TP, *V, TIED, SELECTIVE), "zbv pp2 x tp2 tied, selective recompute"),
        (zb("dualpipev", *PP_TP, *V, FULL), "dualpipev pp2 x tp2, full recompute"),
        (zb("zb", *PP_TP, SELECTIVE), "zb pp2 x tp2, selective recompute")],
    "4 zero": [  # pp 2 x dp 2: ZeRO-2/3 reduce-scatter a unit once per pass that adds to it
        (zb("zbv", *PP_DP, *V, TIED, "parallel.zero_stage=2", micro=1),
         "zbv pp2 x dp2 tied, ZeRO-2, 4 micro-batches"),
        (zb("dualpipev", *PP_DP, *V, "parallel.zero_stage=3", micro=1),
         "dualpipev pp2 x dp2, ZeRO-3, 4 micro-batches"),
        (zb("zb", *PP_DP, *MOE, "parallel.zero_stage=2"), "zb pp2 x dp2 MoE, ZeRO-2"),
        (zb("zb", *PP_DP, *MOE, "parallel.zero_stage=3", micro=1),
         "zb pp2 x dp2 MoE, ZeRO-3, 4 micro-batches")],
}
SLOW = [pytest.mark.slow, pytest.mark.timeout(2400)]  # minutes on 2 shared cores


@pytest.fixture(scope="module")
def base(parity_overrides) -> list[str]:
    return parity_overrides + [f"train.steps={STEPS}"]


@pytest.mark.parametrize("group", ["4", pytest.param("4 slow", marks=SLOW),
                                   pytest.param("4 zero", marks=SLOW)])
def test_zero_bubble_layouts_match_one_process_and_the_ledger(group, base, tmp_path):
    """pp 2 x tp 2: ZB-H1 with sequence parallelism and full recomputation (slow: every
    zero-bubble schedule with sequence parallelism, and with full and selective
    recomputation; pp 2 x dp 2: the V schedules with ZeRO-2 and ZeRO-3, ZB-H1 with MoE and
    ZeRO-2 and ZeRO-3): losses, parameters and every rank's ledger."""
    assert_layouts_match_one_process(4, base, LAYOUTS[group], tmp_path, STEPS, routed=())


TINY = ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=96",
        "model.vocab=512", "model.seq_len=32", "model.layers=2", "model.tied_embeddings=false",
        "parallel.micro_batch=2"]


@pytest.fixture
def phase(monkeypatch) -> list[str]:
    """phase[0] is "I" inside the executor's I passes, "W" inside its W passes, else
    "outside"."""
    now = ["outside"]

    def during(name, fn):
        def run(*args):
            now[0] = name
            try:
                return fn(*args)
            finally:
                now[0] = "outside"
        return run

    monkeypatch.setattr(executor, "backward_input", during("I", executor.backward_input))
    monkeypatch.setattr(executor, "backward_weight", during("W", executor.backward_weight))
    return now


def _one_rank_step(stage, schedule: str, ledger: Ledger) -> dict[str, torch.Tensor]:
    """One step of 2 micro-batches (4 sequences) on a one-rank pipeline: the gradients."""
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    PipelineEngine(stage, build_schedule(schedule, 1, 2), C.Axis("pp", None, 1, 0, ledger)
                   ).train_step(tokens[:, :-1], tokens[:, 1:], 1e-2)
    return {n: q.grad for n, q in stage.named_parameters()}


def _stage(cfg=None):
    cfg = cfg or load_config(None, TINY)
    return build_pipeline_stage(cfg, plan_from_config(cfg, 1), 0, torch.device("cpu"))


def test_weight_pass_regathers_each_region_once_and_the_input_pass_never(monkeypatch, phase):
    """A sequence-parallel stage on a one-rank tp axis (2 blocks: 4 regions), 2 micro-batches:
    1F1B's backward re-gathers each region's input once per micro-batch (8); under ZB the I
    passes re-gather nothing and the W passes 8, and the gradients are 1F1B's to float
    rounding (rtol 1e-5)."""
    counts = Counter()
    gather = tensor_comm.gather_sequence

    def counted(x, axis, purpose):
        counts[phase[0], purpose] += 1
        return gather(x, axis, purpose)

    monkeypatch.setattr(tensor_comm, "gather_sequence", counted)
    grads = {}
    for name in ("1f1b", "zb"):
        counts.clear()
        ledger, stage = Ledger(), _stage()
        apply_tensor_parallel_to_stage(stage, C.Axis("tp", None, 1, 0, ledger), True)
        grads[name] = _one_rank_step(stage, name, ledger)
        regathers = {k[0]: n for k, n in counts.items() if k[1] == "sp_regather"}
        assert regathers == ({"outside": 8} if name == "1f1b" else {"W": 8}), (name, regathers)
    for name, g in grads["1f1b"].items():
        torch.testing.assert_close(grads["zb"][name], g, atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.parametrize("recompute", [apply_full_recompute, apply_selective_recompute])
def test_recomputed_blocks_run_their_forward_once_more_and_w_reuses_it(recompute, phase):
    """2 blocks, 2 micro-batches, ZB with recomputation against 1F1B without: each block's
    MLP runs twice per micro-batch (the forward, and the recomputation in I, run whole),
    never in W, and the gradients are the plain run's (rtol 1e-5)."""
    runs = Counter()
    grads = {}
    for name in ("1f1b", "zb"):
        runs.clear()
        stage = _stage()
        if name == "zb":
            recompute(stage.layers)
        for block in stage.layers:
            block.mlp.register_forward_pre_hook(lambda module, args: runs.update([phase[0]]))
        grads[name] = _one_rank_step(stage, name, Ledger())
        assert runs == ({"outside": 4} if name == "1f1b" else {"outside": 4, "I": 4}), runs
    for name, g in grads["1f1b"].items():
        torch.testing.assert_close(grads["zb"][name], g, atol=1e-7, rtol=1e-5, msg=name)


def test_zero2_reduces_a_moe_block_after_each_of_its_two_passes(monkeypatch):
    """ZeRO-2 on one rank, 2 MoE blocks, 2 micro-batches: under 1F1B each unit is
    reduce-scattered once per micro-batch; under ZB each block's unit twice (after I, which
    computes the MoE layer's weights, and after W, the rest), the root once, and the reduced
    gradients are 1F1B's (rtol 1e-5). Before, a unit that no single pass finished was never
    reduced."""
    from fivefold.parallel import grad_sync
    from fivefold.parallel.data_parallel import DataParallelEngine
    from fivefold.parallel.mesh import Mesh

    cfg = load_config(None, TINY + MOE)
    calls = Counter()
    scatter = grad_sync.AllReduceSync._reduce_scatter

    def counted(self, out, full, i):
        calls[i] += 1
        return scatter(self, out, full, i)

    monkeypatch.setattr(grad_sync.AllReduceSync, "_reduce_scatter", counted)
    grads = {}
    for name in ("1f1b", "zb"):
        calls.clear()
        ledger, stage = Ledger(), _stage(cfg)
        mesh = Mesh({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}, "cpu", ledger)
        engine = DataParallelEngine(stage, 2, mesh, cfg.train, torch.device("cpu"))
        tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
        PipelineEngine(stage, build_schedule(name, 1, 2), C.Axis("pp", None, 1, 0, ledger),
                       grad_sync=engine).train_step(tokens[:, :-1], tokens[:, 1:], 1e-2)
        grads[name] = [m.grad.clone() for m in engine.masters]
        per_unit = [2] + [2 * (2 if name == "zb" else 1)] * 2  # root, then the 2 blocks
        assert [calls[i] for i in range(3)] == per_unit, (name, calls)
    for i, g in enumerate(grads["1f1b"]):
        torch.testing.assert_close(grads["zb"][i], g, atol=1e-7, rtol=1e-5, msg=str(i))
