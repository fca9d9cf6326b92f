"""Activation offload (`parallel.offload_activations`, fivefold.memory.activation_offload).

Parity, exact: the offloaded blocks' saved tensors go to host memory and come back byte for
byte (every view rebuilt over the copied storage), so a run with offload produces the same
losses and parameters as the run without it, bit for bit (tolerance 0, on the CPU): on one
process (fp32 AdamW; SGD with accumulation; Muon; AdamW with CPU optimizer offload; bf16), and on 2
gloo ranks under tp 2 with sequence parallelism, dp 2 with ZeRO-2, and pp 2 (1F1B and
GPipe).

The ledger, exact: the first micro-batch's device activation bytes the trainer records drop
by exactly the bytes its host row records, those are the offloaded block's own saved bytes
(the plain run's count of that block), and both equal the planner's prediction
(fivefold.planner.rank_memory) to the byte (the existing activation tests' bound is 5%;
these agree exactly). The simulator on an H100 predicts less device activation memory, a
host row and no shorter step. Bad values and the refused combinations (recomputation,
TeraPipe: fivefold.compositions) raise one ConfigError naming the key before any rank
starts; the other features train with it in tests/test_activation_offload_layouts.py, and
virtual stages (each chunk's first blocks) in tests/test_activation_offload_vpp.py.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import plan_from_config, training_plan
from fivefold.hardware import PROFILES
from fivefold.planner.activations import block_saved_bytes
from fivefold.planner.activations_autocast import autocast_block_bytes
from fivefold.planner.rank_memory import predicted_rank_memory
from fivefold.planner.search import FastScorer, exact_estimate
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare
from fivefold.planner.step import LayoutStep
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from fivefold.validate import validate_for_training
from parity import CPU, full_parameters

STEPS = 3
OFF = "parallel.offload_activations=1"  # the first block of each stage (of 2 per model)


def _run(rt, sets, run_dir):
    """STEPS steps: (losses, parameters by name, measured device and host activation bytes of
    the first micro-batch, the planner's prediction of both)."""
    cfg = load_config(None, sets)
    plan = training_plan(cfg, rt.world_size, "cpu")
    trainer = Trainer(cfg, rt, run_dir, plan=plan)
    losses = [trainer.train_step(s).loss for s in range(STEPS)]
    params = full_parameters(trainer)  # the engine's (an offloaded step may be in flight)
    predicted = predicted_rank_memory(cfg, plan, rt.rank, rt.device.type)
    return (losses, params, trainer.memory.activations, trainer.memory.activations_host,
            predicted["activations_per_micro_batch"], predicted["activations_host"])


def _assert_same_run(off, plain, label):
    assert off[0] == plain[0], label  # bit for bit
    assert off[1].keys() == plain[1].keys(), label
    for name, p in plain[1].items():
        assert torch.equal(off[1][name], p), (label, name)


def _assert_ledger(off, plain, layer_bytes, label):
    device, host, want_device, want_host = off[2:]
    assert host == layer_bytes == want_host, label
    assert plain[3] == 0 and plain[2] - device == host, label
    assert device == want_device and plain[2] == plain[4], label


ONE_PROCESS = [  # (overrides, the compute dtype's bytes)
    ([], 4),
    (["parallel.micro_batch=2", "train.optimizer='sgd'"], 4),
    (["train.optimizer='muon'"], 4),
    (["parallel.offload='cpu'"], 4),
    (["parallel.precision='bf16'"], 2),  # the plain path: fp32 weights under autocast
]


@pytest.mark.parametrize("sets, a", ONE_PROCESS)
def test_one_process_is_bit_identical_and_moves_block_0_to_host(sets, a,
                                                                parity_overrides, tmp_path):
    sets = parity_overrides + sets
    plain = _run(CPU, sets, str(tmp_path / "plain"))
    off = _run(CPU, sets + [OFF], str(tmp_path / "off"))
    _assert_same_run(off, plain, "one process")
    cfg = load_config(None, sets)
    tokens = training_plan(cfg, 1, "cpu").micro_batch * cfg.model.seq_len
    layer = block_saved_bytes(cfg.model, tokens, a, layer=0)
    if a < 4:  # the casts and fp32 tensors of autocast on fp32 weights
        layer += autocast_block_bytes(cfg.model, tokens, a, layer=0)
    _assert_ledger(off, plain, layer, "one process")
    print(f"{sets[len(parity_overrides):]}: {_mib(off[3])} MiB of block 0 to the host and "
          f"back per micro-batch; device activations {_mib(plain[2])} -> {_mib(off[2])} MiB")


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.3f}"


def _both(rt, sets, run_dir):
    return (_run(rt, sets, f"{run_dir}/plain{rt.rank}"),
            _run(rt, sets + [OFF], f"{run_dir}/off{rt.rank}"))


@pytest.mark.parametrize("sets, tp", [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2),
    (["parallel.zero_stage=2", "parallel.micro_batch=2"], 1)])
def test_two_ranks_are_bit_identical_and_each_rank_moves_its_share(sets, tp, parity_overrides,
                                                                   tmp_path):
    """tp 2 with sequence parallelism (each rank's share of block 0), and dp 2 under ZeRO-2
    with accumulation."""
    sets = parity_overrides + sets
    runs = run_on_ranks(_both, 2, sets, str(tmp_path), timeout_s=300)
    cfg = load_config(None, sets)
    tokens = training_plan(cfg, 2, "cpu").micro_batch * cfg.model.seq_len
    layer = block_saved_bytes(cfg.model, tokens, 4, tp=tp, sp=tp > 1, layer=0)
    for rank, (plain, off) in enumerate(runs):
        _assert_same_run(off, plain, f"{sets[-1]} rank {rank}")
        _assert_ledger(off, plain, layer, f"{sets[-1]} rank {rank}")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_is_bit_identical(schedule, parity_overrides, tmp_path):
    """Each stage offloads its first block; the pipeline's forwards run inside the schedule,
    which the trainer's activation probe does not count (fivefold.train.memory_report), so
    only the prediction's split is checked: one block per stage on the host."""
    sets = parity_overrides + ["parallel.pp=2", "parallel.micro_batch=2",
                               f"parallel.schedule='{schedule}'"]
    runs = run_on_ranks(_both, 2, sets, str(tmp_path), timeout_s=300)
    cfg = load_config(None, sets)
    tokens = 2 * cfg.model.seq_len
    for rank, (plain, off) in enumerate(runs):
        _assert_same_run(off, plain, f"pp2 {schedule} rank {rank}")
        assert off[5] == block_saved_bytes(cfg.model, tokens, 4, layer=rank), rank
        assert plain[4] - off[4] == off[5], rank


def _spec(*sets):
    return prepare(load_config(None, ["model.preset='8B'", "cluster.gpus=8",
                                      "cluster.gpu='H100-SXM'", "parallel.tp=8",
                                      "parallel.global_batch=8", "parallel.micro_batch=1",
                                      *sets]))


def test_simulate_moves_activations_to_the_host_and_adds_no_negative_time():
    """8B on 8 H100s (tp 8): offloading 8 of 32 blocks takes their saved bytes off the device
    (exactly a quarter of the blocks' share), into the host row, and the step is no shorter."""
    plain, off = simulate(_spec()), simulate(_spec("parallel.offload_activations=8"))
    a = off.activation_offload
    assert plain.activation_offload is None and a["blocks_per_stage"] == 8
    drop = plain.memory_per_gpu_bytes["activations"] - off.memory_per_gpu_bytes["activations"]
    sm = off.step_model
    assert drop == pytest.approx(sum(sm.block_saved_bytes(i) for i in range(8)), abs=1)
    assert a["host_bytes_per_gpu"] == pytest.approx(drop, abs=1)
    assert a["backward_wait_s_per_micro_batch"] >= 0
    assert off.step_time_s >= plain.step_time_s
    assert a["copy_s_each_way_per_micro_batch"] == pytest.approx(
        a["bytes_each_way_per_micro_batch"] / sm.prof.host.link_Bps)
    assert "activation_offload" in off.to_json()


def test_plan_scores_the_offloaded_layout_by_its_device_bytes():
    """The search's fast pass keeps the offloaded blocks' saved bytes off the device as the
    exact simulation does: offloading 8 of 32 blocks lowers its peak by exactly their bytes
    (float rounding: 1 byte); and the stage partition counts each stage's first blocks off
    the device: at 32k tokens on tp 4 x pp 2 no split fits without offload, one does with 12
    blocks of each stage offloaded."""
    h100 = PROFILES["H100-SXM"]
    plain_cfg, off_cfg = _spec(), _spec("parallel.offload_activations=8")
    plain_lay, off_lay = plan_from_config(plain_cfg, 8), plan_from_config(off_cfg, 8)
    sm = LayoutStep(off_cfg, h100, off_lay)
    drop = sum(sm.block_saved_bytes(i) for i in range(8))
    assert (FastScorer(plain_cfg, h100).score(plain_lay)[1]
            - FastScorer(off_cfg, h100).score(off_lay)[1]) == pytest.approx(drop, abs=1)
    long = ("parallel.tp=4", "parallel.pp=2", "model.seq_len=32768")
    piped = [_spec(*long, f"parallel.offload_activations={k}") for k in (0, 12)]
    on_device, hosted = (exact_estimate(c, h100, plan_from_config(c, 8), {}) for c in piped)
    assert on_device is None  # no split of 32 blocks fits 80 GB with every block's activations
    assert hosted.fits and hosted.activation_offload["blocks_per_stage"] == 12


@pytest.mark.parametrize("sets, message", [
    (["parallel.offload_activations=-1"], "not a block count"),
    (["parallel.offload_activations=3"], "not a block count"),  # the model has 2
    ([OFF, "parallel.recompute='full'"], "recompute"),
    ([OFF, "parallel.pp=2", "parallel.schedule='terapipe'", "parallel.global_batch=4"],
     "TeraPipe"),
])
def test_bad_values_and_refused_combinations_name_the_key(sets, message, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["parallel.global_batch=8"] + sets)
    with pytest.raises(ConfigError) as err:
        validate_for_training(cfg, 2)
    assert err.value.key == "parallel.offload_activations" and message in str(err.value)
