"""Activation offload under virtual pipeline stages (vpp > 1): `parallel.offload_activations
= N` offloads the first N blocks of each of a rank's model chunks
(fivefold.parallel.parallelize.offloaded_blocks), and the planner prices the same blocks.

On 2 gloo ranks, pp 2 x vpp 2 with 4 micro-batches of 2 (a multiple of pp, as the
interleaved schedule needs): the interleaved schedule with 4 blocks (one per chunk: N = 1
offloads every block of the rank, two chunks' worth) and with 8 (two per chunk: N = 1
offloads the first block of each of the rank's two chunks, not their second), and the V
schedules zbv and dualpipev with 4 blocks (rank 0 holds the first and the last chunk):

* parity, exact: losses and parameters with N = 1 equal the run without, bit for bit
  (tolerance 0 on the CPU, as tests/test_activation_offload.py's layouts);
* bytes: each rank copied to the host exactly STEPS x micro-batches x the planner's
  "activations_host" row (fivefold.planner.rank_memory: one micro-batch through all of the
  rank's chunks), and the planner's device row drops by that row. Exact, because the
  planner predicts a plain fp32 pipeline stage's block bytes to the byte (the pp 2 1F1B
  layouts of the other tests); the count is off by a chunk's worth if either side takes
  the rank's first N blocks instead (checked by running the old runtime: half the bytes);
* the simulator (fp32 on an H100 profile, the same blocks) reports the same bytes each way
  per micro-batch, a host peak of the rank's most (chunk, micro-batch) units in flight
  times one chunk's offloaded bytes (equal in every chunk here), and less device
  activation memory than without.

One process start for the four layouts (about 9 s on 2 cores). A count above a chunk's
blocks offloads all of them, as a stage with fewer blocks does.
"""

from __future__ import annotations

import pytest

from fivefold.config import load_config
from fivefold.planner.schedules import peak_in_flight
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare
from fivefold.testing import run_on_ranks
from fivefold.validate import validate_for_training
from test_activation_offload import OFF, STEPS, _assert_same_run
from test_activation_offload_layouts import _counted

VPP = ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule='interleaved'",
       "parallel.micro_batch=2"]
LAYOUTS = [("4 blocks", ["model.layers=4"]), ("8 blocks", ["model.layers=8"]),
           ("zbv", ["model.layers=4", "parallel.schedule='zbv'"]),
           ("dualpipev", ["model.layers=4", "parallel.schedule='dualpipev'"])]
MICRO_BATCHES = 4  # global batch 8 / micro-batch 2 on one pipeline (dp 1)


def _both_layouts(rt, base, run_dir):
    return [_counted(rt, base + sets, f"{run_dir}/{label.replace(' ', '')}")
            for label, sets in LAYOUTS]


def test_virtual_stages_are_bit_identical_and_move_each_chunks_first_block(
        parity_overrides, tmp_path):
    base = parity_overrides + VPP
    runs = run_on_ranks(_both_layouts, 2, base, str(tmp_path), timeout_s=300)
    for k, (label, sets) in enumerate(LAYOUTS):
        per_micro_batch = []
        for rank, per_layout in enumerate(runs):
            plain, off, copied = per_layout[k]
            where = f"{label} rank {rank}"
            _assert_same_run(off, plain, where)
            host = off[5]  # the planner's offloaded bytes of one micro-batch on this rank
            assert host > 0 and plain[5] == 0, where
            assert copied == STEPS * MICRO_BATCHES * host, (where, copied, host)
            assert plain[4] - off[4] == host, where
            per_micro_batch.append(copied // (STEPS * MICRO_BATCHES))
            print(f"{where}: {copied} bytes to the host in {STEPS} steps, {host} per "
                  "micro-batch as predicted")
        plain_sim, off_sim = (simulate(_spec(base + sets + extra)) for extra in ([], [OFF]))
        a = off_sim.activation_offload
        assert a["bytes_each_way_per_micro_batch"] == max(per_micro_batch), label
        # every chunk here offloads the same bytes: the host's peak is the rank's peak count
        # of (chunk, micro-batch) units in flight times one chunk's share
        schedule = off_sim.layout.schedule
        units = [peak_in_flight(schedule, 2, MICRO_BATCHES, r, 2) for r in range(2)]
        assert a["host_bytes_per_gpu"] == max(k * b / 2 for k, b in
                                              zip(units, per_micro_batch)), label
        assert min(units) > 2, label  # more than one micro-batch's chunks on the host
        assert (off_sim.memory_per_gpu_bytes["activations"]
                < plain_sim.memory_per_gpu_bytes["activations"]), label


def _spec(sets):
    return prepare(load_config(None, sets + ["cluster.gpus=2", "cluster.gpu='H100-SXM'",
                                             "parallel.precision='fp32'"]))


def test_a_count_above_a_chunks_blocks_offloads_all_of_them(parity_overrides):
    """As a stage with fewer blocks than the count does: 4 blocks in 4 chunks of one, a count
    of 2 is accepted and moves what a count of 1 does (the planner's host bytes)."""
    sets = parity_overrides + VPP + ["model.layers=4"]
    validate_for_training(load_config(None, sets + ["parallel.offload_activations=2"]), 2)
    one, two = (simulate(_spec(sets + [f"parallel.offload_activations={n}"])
                         ).activation_offload for n in (1, 2))
    assert one["host_bytes_per_gpu"] == two["host_bytes_per_gpu"] > 0
