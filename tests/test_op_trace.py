"""The planner's op trace against the runtime's ops: the ledger's promise extended to compute.

For every layout in `QUICK` and `SLOW`, one `Trainer.train_step` runs on gloo CPU ranks under
tests/op_recorder.py's dispatch mode, which records every matrix product (mm, addmm, bmm,
baddbmm: linear and matmul decompose into them), every grouped expert product
(torch._grouped_mm) and every SDPA kernel call, forward and backward, with its shape and
dtype. `fivefold.planner.op_trace.rank_trace` of the same config must list, on every rank,
exactly those kernels: kind, shape, dtype and count equal (`compute_counts`), recomputation's
repeats and ring attention's blockwise GEMMs included. The one exception is the expert
GEMMs' routed dimension under expert parallelism (rows an expert rank receives, or the rows
a weight gradient sums over): the router decides it, so per rank the kernels are compared
with that dimension left out, and the dimension itself summed over the ranks (exact, since
the routing is dropless), as tests/test_planner_ledger.py does for the routed all-to-alls.

The trace's collectives and sends/receives must equal the runtime's ledger: bytes per (op,
mesh axis, purpose) on every rank (routed expert exchanges summed over the ranks).

The optimizer's work (AdamW's elements on the device and, under offload, on the host) must
equal the runtime's: its optimizer-state bytes over AdamW's 8 per element, its host bytes
over offload's per element. Activation offload's copies (the trace's "host_copy" per
offloaded block and micro-batch, each way) must carry, each way, exactly the bytes of the
storages the runtime copied to the host in the step (observe_offloaded_saves).

Not compared: element-wise ops (the trace carries one estimated op per block and pass with
its HBM bytes; eager torch dispatches dozens of small kernels whose count no fused stack
shares), the optimizer's bytes and optimizer offload's copies (derived from the same
elements), and the dependencies.

Layouts (30): ZeRO 0-3, tp 2 with sequence parallelism, every synchronous pipeline schedule
(GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipe-V, TeraPipe with uneven token slices), cp 2
ring and Ulysses and the 2 x 2 hybrid, MoE with ep 2 and 4 and without ep, full and
selective recomputation, CPU offload, activation offload (pp 2 1F1B, ZeRO-2 with
accumulation), pp x tp with sp (with and without full recomputation),
tp with sp x ZeRO-3, ep with a shared expert under full recomputation, and in bf16: cp ring
(its blocks in fp32) with selective recomputation, tp with sp x ZeRO-1, ep 2 (the router in
fp32). The default suite runs `QUICK` (8 of them, one start of 2 ranks); the rest is marked
slow. Ranks start once per world size group.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fivefold.config import load_config
from fivefold.memory.activation_offload import observe_offloaded_saves
from fivefold.models.expert_matmul import grouped_mm_runs
from fivefold.parallel.plan import training_plan
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.memory import offload_bytes
from fivefold.planner.op_comm import PASS_PURPOSES
from fivefold.planner.op_trace import compute_counts, rank_trace
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from op_recorder import RecordOps

MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01"]
PP = ["parallel.pp=2", "parallel.micro_batch=2"]
V = PP + ["parallel.vpp=2", "model.layers=4"]
QUICK = [  # (overrides, label), on 2 ranks
    (["parallel.zero_stage=0"], "ddp"),
    (["parallel.zero_stage=3", "parallel.micro_batch=2"], "zero3 accumulate 2"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "tp2 sp"),
    (PP, "pp2 1f1b"),
    (["parallel.cp=2"], "cp2 ring"),
    (["parallel.recompute='selective'", "parallel.zero_stage=1"], "selective recompute zero1"),
    (V + ["parallel.schedule='zbv'"], "pp2 zbv"),
    (PP + ["parallel.offload_activations=1"], "pp2 1f1b, activation offload 1"),
]
SLOW = {  # world size: [(overrides, label)]
    2: [(["parallel.zero_stage=1"], "zero1"),
        (["parallel.zero_stage=2", "parallel.micro_batch=2"], "zero2 accumulate 2"),
        (PP + ["parallel.schedule='gpipe'"], "pp2 gpipe"),
        (V + ["parallel.schedule='interleaved'"], "pp2 interleaved vpp2"),
        (PP + ["parallel.schedule='zb'"], "pp2 zb-h1"),
        (V + ["parallel.schedule='dualpipev'"], "pp2 dualpipev"),
        (["parallel.pp=2", "parallel.schedule='terapipe'", "parallel.micro_batch=4",
          "parallel.token_slices=3"], "pp2 terapipe, 3 uneven token slices"),
        (["parallel.cp=2", "parallel.cp_mode='ulysses'"], "cp2 ulysses"),
        (["parallel.recompute='full'", "parallel.zero_stage=2"], "full recompute zero2"),
        (["parallel.offload='cpu'", "parallel.zero_stage=1"], "cpu offload zero1"),
        (["parallel.offload_activations=1", "parallel.zero_stage=2", "parallel.micro_batch=2"],
         "zero2 accumulate 2, activation offload 1"),
        (["parallel.cp=2", "parallel.precision='bf16'", "parallel.recompute='selective'"],
         "cp2 ring bf16 (fp32 blocks), selective recompute"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.precision='bf16'",
          "parallel.zero_stage=1"], "tp2 sp bf16 zero1")],
    4: [(["parallel.cp=4", "parallel.cp_mode='hybrid'", "parallel.cp_ulysses=2"],
         "cp4 hybrid 2 x 2"),
        (MOE + ["parallel.ep=2"], "ep2 over dp4"),
        (MOE + ["parallel.ep=4", "parallel.zero_stage=1"], "ep4 zero1"),
        (MOE + ["parallel.recompute='selective'"], "MoE without ep, selective recompute"),
        (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
          "parallel.micro_batch=2"], "pp2 x tp2 sp"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=3"],
         "tp2 sp x zero3"),
        (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
          "parallel.recompute='full'", "parallel.micro_batch=2"],
         "pp2 x tp2 sp full recompute"),
        (MOE + ["parallel.ep=2", "parallel.recompute='full'", "model.moe.shared_experts=1"],
         "ep2 full recompute, a shared expert"),
        (MOE + ["parallel.ep=2", "parallel.precision='bf16'"], "ep2 bf16 (fp32 router)")],
}
ROUTED = ("moe_combine", "moe_dispatch_backward")  # sizes the routing decides


@pytest.fixture(scope="module")
def overrides(parity_overrides):
    return parity_overrides


def _record(rt, overrides, cases):
    """Per case: the recorded kernel counts and the ledger's bytes per (op, axis, purpose).
    Under offload the second step is recorded: ZeRO-1/2 re-gather a unit in the forward
    after its host update (fivefold.memory.offload), so the first step has no gathers."""
    for dtype in (torch.float32, torch.bfloat16):  # the probe runs once per process and
        grouped_mm_runs("cpu", dtype)  # dtype: not the step's work
    out = []
    for sets in cases:
        cfg = load_config(None, overrides + sets)
        trainer = Trainer(cfg, rt, "unused")
        if cfg.parallel.offload != "none":  # the gathers of an update run in the next step
            trainer.train_step(0)
        hosted = []  # the storages activation offload copies to the host
        with RecordOps() as ops, observe_offloaded_saves(
                lambda t: hosted.append(t.untyped_storage().nbytes())):
            trainer.train_step(int(cfg.parallel.offload != "none"))
        out.append((dict(ops.ops), dict(trainer.ledger.totals("bytes")),
                    dict(trainer.ledger.model_state_bytes), sum(hosted)))
    return out


def _without_routed_dim(counts: dict) -> tuple[Counter, Counter]:
    """(counts with the routed dimension of grouped GEMMs blanked, that dimension x count
    summed per blanked key)."""
    kept, routed = Counter(), Counter()
    for key, n in counts.items():
        if key[0] == "grouped_gemm":
            at = 1 if key[-1] == "M" else 3
            blank = key[:at] + (None,) + key[at + 1:]
            kept[blank] += n
            routed[blank] += key[at] * n
        else:
            kept[key] += n
    return kept, routed


def _trace_ledger(ops) -> dict:
    out = Counter()
    for op in ops:
        if op.kind in ("collective", "send", "recv"):
            out[op.kernel, op.axis, op.purpose] += op.bytes
    return dict(out)


def _check(world: int, cases: list, recorded: list, overrides: list[str]) -> None:
    for i, (sets, label) in enumerate(cases):
        cfg = load_config(None, overrides + sets)
        lay = training_plan(cfg, world, "cpu")
        expert = lay.ep > 1
        routed_want, routed_have = Counter(), Counter()
        for rank in range(world):
            where = f"{label}, rank {rank}"
            ops = rank_trace(cfg, lay, rank)
            got_counts, got_ledger, got_state, got_hosted = recorded[rank][i]
            assert not [k for k in got_counts if k[0] == "unknown"], (where, got_counts)
            want, have = compute_counts(ops), got_counts
            if expert:
                (want, w_routed), (have, h_routed) = (_without_routed_dim(want),
                                                      _without_routed_dim(have))
                routed_want += w_routed
                routed_have += h_routed
            assert dict(want) == dict(have), where
            work = {op.stream: op.shape[0] for op in ops if op.kind == "optimizer"}
            assert work.get("compute", 0) * 8 == got_state["optimizer"], where  # AdamW
            assert work.get("host", 0) * offload_bytes(lay.offload, 8)[0] == got_state["host"]
            copies = Counter()  # activation offload's, each way
            for op in ops:
                if op.kind == "host_copy" and op.phase != "step":
                    copies[op.phase == "forward"] += op.bytes
            assert copies[True] == copies[False] == got_hosted, where
            assert got_hosted or not lay.offload_activations, where
            traced = _trace_ledger(ops)
            assert traced == predict_ledger(cfg, lay, rank=rank).totals("bytes"), where
            assert traced.keys() == got_ledger.keys(), where
            for key, nbytes in traced.items():
                if key[2] in ROUTED:
                    routed_want[key] += nbytes
                    routed_have[key] += got_ledger[key]
                else:
                    assert got_ledger[key] == nbytes, (where, key)
        assert routed_want == routed_have, label
        assert routed_want or not expert, label


def test_op_trace_equals_runtime_quick(overrides):
    recorded = run_on_ranks(_record, 2, overrides, [s for s, _ in QUICK], timeout_s=600)
    _check(2, QUICK, recorded, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW))
def test_op_trace_equals_runtime(world, overrides):
    cases = SLOW[world]
    recorded = run_on_ranks(_record, world, overrides, [s for s, _ in cases], timeout_s=900)
    _check(world, cases, recorded, overrides)


def test_trace_places_every_per_pass_collective(overrides):
    """On every rank of every layout (from the config alone): each op waits only for earlier
    ops, and each tensor-, sequence-, context- or expert-parallel exchange sits inside a pass
    (op_comm's rules leave none for the step's end), waiting for the compute op before it or
    the pipeline receive that brought its pass's input."""
    for world, sets, label in [(2, s, l) for s, l in QUICK] + [
            (w, s, l) for w, cases in SLOW.items() for s, l in cases]:
        cfg = load_config(None, overrides + sets)
        lay = training_plan(cfg, world, "cpu")
        for rank in range(world):
            ops = rank_trace(cfg, lay, rank)
            for i, op in enumerate(ops):
                assert all(d < i for d in op.deps), (label, rank, i)
                if op.purpose in PASS_PURPOSES:
                    assert op.phase == "pass", (label, rank, op)
                    assert any(ops[d].stream == "compute" or ops[d].kind == "recv"
                               for d in op.deps), (label, rank, op)


def test_layouts_span_the_issue():
    """ZeRO 0-3, tp with sp, each synchronous schedule, cp ring/Ulysses/hybrid, ep,
    recomputation, offload: at least 20 layouts."""
    every = QUICK + [c for cases in SLOW.values() for c in cases]
    sets = [" ".join(s) for s, _ in every]
    assert len(every) >= 20
    for want in [f"zero_stage={z}" for z in range(4)] + [
            "sequence_parallel=true", "schedule='gpipe'", "parallel.pp=2", "'interleaved'",
            "'zb'", "'zbv'", "'dualpipev'", "'terapipe'", "cp=2", "'ulysses'", "'hybrid'", "ep=2",
            "recompute='full'", "recompute='selective'", "offload='cpu'",
            "offload_activations="]:
        assert any(want in s for s in sets), want
