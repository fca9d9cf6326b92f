"""Activation offload with the features beyond tests/test_activation_offload.py's: expert
layers, fp16 loss scaling, fp8 (emulated), LOMO, GaLore, nvme optimizer offload, ZeRO-3 and
ZeRO++, context parallelism (ring and Ulysses), the split-backward and asynchronous pipeline
schedules (zero-bubble, PipeDream-2BW) and torch.compile. TeraPipe is refused
(fivefold.compositions): its token slices call a block's attention and MLP directly, so the
wrapped block forward never runs and nothing would be offloaded (a run here copied 0 bytes).

Parity, exact (tolerance 0, on the CPU): the pack hook copies each saved storage's bytes to
the host and the unpack hook rebuilds every view over them, so however a layout orders its
forwards and backwards (ZB's later weight pass, 2BW's weight versions, ZeRO-3's gathers,
fp16's scaled backward) it reads the same bytes: each layout's losses and parameters with
`parallel.offload_activations = 1` equal its run without, bit for bit.

Bytes moved: each offloaded run counts what it copies to the host
(fivefold.memory.activation_offload.observe_offloaded_saves), > 0 for every layout. Where the
trainer measures activations (every layout but the pipelines, whose forwards run in the
schedule) the plain run's host row is 0 and the offloaded run's device bytes drop by exactly
its host row, less, under cp, the rotary rows of the rank's tokens: gathered once per
micro-batch outside the blocks and saved by each, they are copied with block 0's saves and
stay on the device for block 1 (1 KiB here). Where the planner predicts the plain run's
activations exactly, it predicts both rows exactly too (those layouts are marked; cp's
rotary rows, fp16's autocast on fp32 weights and fp8's fp32 base dtype on the CPU are
counted, fivefold.planner.rank_memory). The others are off by what the planner's activation
model misses without offload: ep 2's uneven dispatch (it prices a balanced one: the
received copies follow the router's choices on the batch) and compile's fused graphs, which
save fewer tensors.
"""

from __future__ import annotations

import pytest

from fivefold.memory.activation_offload import observe_offloaded_saves
from fivefold.testing import run_on_ranks
from parity import CPU
from test_activation_offload import OFF, _assert_same_run, _run

MOE = ["model.moe.experts=4", "model.moe.expert_ffn_hidden=32", "parallel.micro_batch=2"]
ZB = ["parallel.pp=2", "parallel.micro_batch=2"]
ROPE_ROWS = 2 * 16 * 8 * 4  # cp 2's cos and sin rows: 16 positions x 8 frequencies, fp32

# (label, overrides, whether the planner predicts its activations exactly)
ONE_PROCESS = [
    ("moe", MOE, True),
    ("fp16", ["parallel.precision='fp16'"], True),
    ("fp8", ["parallel.precision='fp8'"], True),
    ("lomo", ["train.optimizer='lomo'"], True),
    ("galore", ["train.optimizer='galore'", "parallel.micro_batch=2"], True),
    ("nvme", ["parallel.offload='nvme'", "parallel.zero_stage=1"], True),
]
TWO_RANKS = [
    ("ep2", [*MOE, "parallel.ep=2"], False),
    ("zero3", ["parallel.zero_stage=3", "parallel.micro_batch=2"], True),
    ("zero++", ["parallel.zero_stage=3", "parallel.qwz=true", "parallel.hpz=true",
                "parallel.qgz=true", "cluster.gpus_per_node=1"], True),
    ("ring", ["parallel.cp=2", "parallel.cp_mode='ring'"], True),
    ("ulysses", ["parallel.cp=2", "parallel.cp_mode='ulysses'"], True),
    ("zb", [*ZB, "parallel.schedule='zb'"], True),
]
TWO_RANKS_SLOW = [
    ("2bw", [*ZB, "parallel.schedule='pipedream-2bw'"], True),
]


def _counted(rt, sets, run_dir):
    """The plain run, the offloaded run, and the bytes the offloaded run copied to the host."""
    copied = []
    plain = _run(rt, sets, f"{run_dir}/plain{rt.rank}")
    with observe_offloaded_saves(lambda t: copied.append(t.untyped_storage().nbytes())):
        off = _run(rt, sets + [OFF], f"{run_dir}/off{rt.rank}")
    return plain, off, sum(copied)


def _layouts(rt, base, layouts, run_dir):
    return [_counted(rt, base + sets, f"{run_dir}/{label}") for label, sets, _ in layouts]


def _check(label, plain, off, copied, exact):
    _assert_same_run(off, plain, label)
    assert copied > 0, label
    device, host, want_device, want_host = off[2:]
    shared = ROPE_ROWS if label.startswith(("ring", "ulysses")) else 0
    if device is not None:  # the trainer measured it (not under a pipeline schedule)
        assert plain[3] == 0 and host > 0 and plain[2] - device == host - shared, label
    if exact:
        assert plain[4] - want_device == want_host - shared, label
        if device is not None:
            assert (host, device) == (want_host, want_device), label


def _check_all(layouts, runs_by_rank):
    for rank, runs in enumerate(runs_by_rank):
        for (label, _, exact), run in zip(layouts, runs):
            _check(f"{label} rank {rank}", *run, exact)


def test_one_process_layouts_are_bit_identical(parity_overrides, tmp_path):
    """Expert layers, fp16, fp8 (emulated), LOMO, GaLore and nvme optimizer offload."""
    nvme = [f"parallel.offload_path='{tmp_path / 'nvme'}'"]
    _check_all(ONE_PROCESS, [_layouts(CPU, parity_overrides + nvme, ONE_PROCESS,
                                      str(tmp_path))])


def test_two_rank_layouts_are_bit_identical(parity_overrides, tmp_path):
    """ep 2, ZeRO-3, ZeRO-3 with ZeRO++ (qwz, hpz, qgz), cp 2 ring and Ulysses, and pp 2
    under the zero-bubble schedule: one process start for all."""
    runs = run_on_ranks(_layouts, 2, parity_overrides, TWO_RANKS, str(tmp_path),
                        timeout_s=600)
    _check_all(TWO_RANKS, runs)


@pytest.mark.slow
def test_pipedream_2bw_and_compile_are_bit_identical(parity_overrides, tmp_path):
    """PipeDream-2BW on pp 2, and torch.compile on one process (slow: its
    compilation takes most of a minute on the CPU)."""
    _check_all(TWO_RANKS_SLOW, run_on_ranks(_layouts, 2, parity_overrides, TWO_RANKS_SLOW,
                                            str(tmp_path), timeout_s=600))
    compiled = [("compile", ["train.compile=true"], False)]
    _check_all(compiled, [_layouts(CPU, parity_overrides, compiled, str(tmp_path))])
