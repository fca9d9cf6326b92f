"""Optimizer offload (fivefold.memory.offload, fivefold.memory.nvme_store): the offloaded
step computes what the in-memory engine computes, the bytes land where the shared rule says,
and a crash in the middle of an nvme step never leaves a half-updated committed state.

Tolerances: against the in-memory run of the same layout, exact (bit for bit: the host's
foreach AdamW and the device's single-tensor AdamW agree on the CPU, the gradients are the
same reduced tensors, and each unit's update is independent of the others, so running them
on a background thread changes nothing). Against the one-process run, the data-parallel
tolerance of tests/test_data_parallel.py: losses rel 2e-5, parameters atol 1e-5 + rtol
1e-4 (layouts sum gradients in another order).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from parity import (CPU, STEPS, assert_params_close, full_parameters, resumed_losses,
                    train_steps)

from fivefold.config import load_config
from fivefold.memory.nvme_store import NvmeStore, read_committed, read_manifest
from fivefold.memory.offload import chunked_adamw_, cpu_adamw_, decay_ranges, ranges_within
from fivefold.parallel.plan import offloaded_unit_count
from fivefold.testing import run_on_ranks
from fivefold.train.checkpoint import latest_checkpoint, step_dir
from fivefold.train.trainer import Trainer

TESTS = Path(__file__).parent


def _sets(overrides, stage, offload="none", path=None, fraction=1.0, extra=()):
    sets = overrides + [f"parallel.zero_stage={stage}", f"train.steps={STEPS}",
                        f"parallel.offload={offload}", f"parallel.offload_fraction={fraction}",
                        *extra]
    if path is not None:
        sets.append(f"parallel.offload_path='{path}'")
    return sets


def _collectives(run) -> list[tuple]:
    return sorted(tuple(sorted(record.items())) for record in run.records)


def _same(run, ref) -> bool:
    return run.losses == ref.losses and run.params.keys() == ref.params.keys() and all(
        torch.equal(run.params[k], ref.params[k]) for k in ref.params)


def test_offloaded_units_are_the_shortest_prefix_reaching_the_fraction():
    assert offloaded_unit_count([10, 30, 30, 30], 1.0) == 4
    assert offloaded_unit_count([10, 30, 30, 30], 0.4) == 2  # 40 of 100 reached exactly
    assert offloaded_unit_count([10, 30, 30, 30], 0.41) == 3
    assert offloaded_unit_count([10, 30, 30, 30], 0.05) == 1


def test_nvme_store_streams_chunks_exactly_and_keeps_the_committed_version(tmp_path):
    """Three units of 2500, 1000 and 7 elements in chunks of 1000, random decay masks: two
    streamed steps equal two steps of the engine's in-memory update (masked decay, then
    torch's AdamW with weight decay 0) bit for bit, as does the cpu tier's chunked step; a
    step that fails after its first chunk (as a crash would leave it) leaves the manifest
    and the committed slot untouched."""
    from fivefold.config import TrainConfig
    train = TrainConfig(lr=1e-2, weight_decay=0.1)
    sizes = {"root": 2500, "layers.0": 1000, "layers.1": 7}
    store = NvmeStore(tmp_path / "rank0", list(sizes.items()), chunk_elements=1000)
    assert store.disk_bytes() == 16 * sum(sizes.values())
    gen = torch.Generator().manual_seed(0)
    masters = {n: torch.randn(k, generator=gen) for n, k in sizes.items()}
    masks = {n: torch.rand(k, generator=gen) > 0.5 for n, k in sizes.items()}
    ref = {n: torch.nn.Parameter(m.clone()) for n, m in masters.items()}
    adamw = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.0,
                              betas=(train.beta1, train.beta2), eps=train.eps)
    host = {n: (m.clone(), torch.zeros(k), torch.zeros(k)) for (n, k), m in
            zip(sizes.items(), masters.values())}
    for update in range(2):
        for name in sizes:
            grad = torch.randn(sizes[name], generator=gen)
            ref[name].grad = grad
            with torch.no_grad():
                ref[name].mul_(torch.where(masks[name], 1.0 - 1e-2 * 0.1, 1.0))
            ranges = decay_ranges(masks[name])
            chunked_adamw_(*host[name][:1], grad, *host[name][1:], update, 1e-2, train, ranges)

            def chunk(start, stop, exp_avg, exp_avg_sq, name=name, grad=grad, ranges=ranges):
                cpu_adamw_(masters[name][start:stop], grad[start:stop], exp_avg, exp_avg_sq,
                           update, 1e-2, train, ranges_within(ranges, start, stop))
            store.update_unit(name, chunk)
        adamw.step()
        store.commit(update + 1)
    for name in sizes:
        avg, avg_sq = read_committed(tmp_path / "rank0", name, sizes[name], 1000)
        want = adamw.state[ref[name]]
        for got in (masters[name], host[name][0]):
            assert torch.equal(got, ref[name].detach()), name
        for got in ((avg, avg_sq), host[name][1:]):
            assert torch.equal(got[0], want["exp_avg"]), name
            assert torch.equal(got[1], want["exp_avg_sq"]), name
    before = read_manifest(tmp_path / "rank0")
    assert before == {"slot": 0, "updates": 2}

    def fails_after_one_chunk(start, stop, exp_avg, exp_avg_sq):
        if start > 0:
            raise RuntimeError("crash")
        exp_avg.add_(1.0)
    with pytest.raises(RuntimeError):
        store.update_unit("root", fails_after_one_chunk)
    assert read_manifest(tmp_path / "rank0") == before
    avg, _ = store.read_unit("root")
    assert torch.equal(avg, adamw.state[ref["root"]]["exp_avg"])
    store.close()


ONE_RANK = [  # (zero stage, offload, fraction) against the in-memory run of its stage
    (0, "cpu", 1.0), (0, "nvme", 1.0), (1, "cpu", 1.0), (1, "nvme", 0.6), (2, "nvme", 1.0),
    (3, "cpu", 0.5), (3, "nvme", 1.0)]


def test_one_rank_offload_is_exact_and_records_its_bytes(parity_overrides, tmp_path):
    """One rank: each offloaded run equals the in-memory run of its ZeRO stage bit for bit
    (stage 0's in-memory run is the plain reference, whose gradient norm the engine
    reproduces by norming the same per-parameter tensors in the same order: norms of its
    flat units clipped step 5 by another coefficient, 1 ulp apart, on an AMD EPYC,
    fivefold.train.updaters.engine); the ledger's device rows keep no
    master or optimizer state for the offloaded units, "host" holds 16 B per offloaded
    element with cpu and 8 B with nvme, "disk" 16 B with nvme (two versions), and the
    memory report shows the two rows."""
    ref = {stage: train_steps(CPU, load_config(None, _sets(parity_overrides, stage)),
                              tmp_path / f"ref{stage}") for stage in range(4)}
    for stage, offload, fraction in ONE_RANK:
        label = (stage, offload, fraction)
        name = f"{stage}-{offload}-{fraction}"
        cfg = load_config(None, _sets(parity_overrides, stage, offload, tmp_path / f"nv{name}",
                                      fraction))
        trainer = Trainer(cfg, CPU, tmp_path / f"run{name}")
        losses = [trainer.train_step(s).loss for s in range(STEPS)]
        params = full_parameters(trainer)
        assert losses == ref[stage].losses, label
        assert params.keys() == ref[stage].params.keys(), label
        assert all(torch.equal(params[k], ref[stage].params[k]) for k in params), label
        engine, ledger = trainer.engine, trainer.ledger
        numels = [u.shard_numel for u in engine.units]
        k = offloaded_unit_count(numels, fraction)
        assert k == engine.offloaded and sum(numels[:k]) >= fraction * sum(numels), label
        assert sum(numels[:k - 1]) < fraction * sum(numels), label  # the shortest prefix
        states = ledger.model_state_bytes
        offloaded, rest = sum(numels[:k]), sum(numels[k:])
        assert states["optimizer"] == 8 * rest, label  # fp32: the master is the compute copy
        assert states["master"] == 0, label
        assert states["host"] == (16 if offload == "cpu" else 8) * offloaded, label
        assert states["disk"] == (16 * offloaded if offload == "nvme" else 0), label
        summary, lines = trainer.memory.report(trainer.model, states, [], None, 0, CPU.device)
        assert summary["measured"]["host"] == states["host"], label
        assert any("optimizer states, disk" in line for line in lines), label


def test_fused_kernel_stays_within_the_parity_tolerance(parity_overrides, tmp_path):
    """`parallel.offload_kernel = "fused"` (torch's fused CPU AdamW, which orders its float
    operations otherwise) against the in-memory ZeRO-1 run on one rank: losses rel 2e-5,
    parameters atol 1e-5 + rtol 1e-4, the data-parallel tolerance; and it is the other
    kernel: some parameter differs in its last bits."""
    ref = train_steps(CPU, load_config(None, _sets(parity_overrides, 1)), tmp_path / "ref")
    for offload in ("cpu", "nvme"):
        cfg = load_config(None, _sets(parity_overrides, 1, offload, tmp_path / "nv", 1.0,
                                      ["parallel.offload_kernel=fused"]))
        run = train_steps(CPU, cfg, tmp_path / offload)
        assert run.losses == pytest.approx(ref.losses, rel=2e-5), offload
        assert_params_close(run.params, ref.params, offload, atol=1e-5, rtol=1e-4)
        assert not all(torch.equal(run.params[k], ref.params[k]) for k in ref.params), offload


TP2 = ("parallel.tp=2",)
PP2 = ("parallel.pp=2", "parallel.micro_batch=2")
LAYOUTS_2 = [  # (zero stage, offload, fraction, other overrides)
    (0, "none", 1.0, ()), (0, "cpu", 1.0, ()), (1, "none", 1.0, ()), (1, "cpu", 1.0, ()),
    (1, "nvme", 1.0, ()), (2, "none", 1.0, ()), (2, "cpu", 0.5, ()), (2, "nvme", 1.0, ()),
    (3, "none", 1.0, ()), (3, "cpu", 1.0, ()), (3, "nvme", 0.5, ()),
    (0, "none", 1.0, TP2), (0, "cpu", 1.0, TP2), (3, "none", 1.0, PP2), (3, "nvme", 1.0, PP2)]
LAYOUTS_4 = [(0, "none", 1.0, ()), (0, "nvme", 1.0, ()), (1, "none", 1.0, ()),
             (1, "cpu", 1.0, ()), (2, "none", 1.0, ()), (2, "nvme", 1.0, ()),
             (3, "none", 1.0, ()), (3, "cpu", 0.5, ()), (3, "nvme", 1.0, ())]


def _offload_layouts(rt, overrides, layouts, tmp):
    """Every layout, then a cpu (stage 2) and an nvme (stage 1) run saved at step 2 and
    resumed to STEPS; rank 0 returns the runs and the resumed losses."""
    runs = [train_steps(rt, load_config(None, _sets(overrides, stage, offload, f"{tmp}/nv{i}",
                                                    fraction, extra)), f"{tmp}/run{i}")
            for i, (stage, offload, fraction, extra) in enumerate(layouts)]
    resumed = [resumed_losses(rt, load_config(None, _sets(overrides, stage, offload,
                                                          f"{tmp}/nvr{stage}")),
                              f"{tmp}/resume{stage}", 2, STEPS)[0]
               for stage, offload in ((2, "cpu"), (1, "nvme"))]
    return (runs, resumed) if rt.rank == 0 else None


def _check_layouts(world, layouts, runs, reference):
    in_memory = {(stage, extra): run for (stage, offload, _, extra), run in zip(layouts, runs)
                 if offload == "none"}
    for layout, run in zip(layouts, runs):
        label = f"world {world} layout {layout}"
        stage, _, _, extra = layout
        assert _same(run, in_memory[stage, extra]), label
        # the last step's collectives, in any order: ZeRO-1/2 all-gather an offloaded unit in
        # the next forward's pre-hook instead of in `step`, the same bytes one step later
        assert _collectives(run) == _collectives(in_memory[stage, extra]), label
        assert run.losses == pytest.approx(reference.losses, rel=2e-5), label
        held = ({k: reference.params[k] for k in run.params} if extra == PP2  # its stage
                else reference.params)
        assert_params_close(run.params, held, label, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def reference(parity_overrides, tmp_path_factory):
    return train_steps(CPU, load_config(None, _sets(parity_overrides, 0)),
                       tmp_path_factory.mktemp("ref"))


def test_offload_on_2_ranks_matches_in_memory_and_one_process(parity_overrides, reference,
                                                              tmp_path):
    """2 gloo ranks, ZeRO-0/1/2/3 with cpu and nvme offload (some at fraction 0.5), and cpu
    offload with tp 2, nvme with pp 2 (1F1B) at ZeRO-3: exact against the in-memory run of
    the same layout (losses, parameters, and the last step's collectives), within the parity tolerance against one process; a cpu and an nvme run
    resumed from a step-2 checkpoint continue with the same losses as uninterrupted
    (exactly). The nvme run's 2-rank ZeRO-1 checkpoint then resumes resharded on one rank at
    ZeRO-3 with nvme offload, within the parity tolerance."""
    runs, resumed = run_on_ranks(_offload_layouts, 2, parity_overrides, LAYOUTS_2,
                                 str(tmp_path), timeout_s=600)[0]
    _check_layouts(2, LAYOUTS_2, runs, reference)
    by_layout = dict(zip(LAYOUTS_2, runs))
    assert resumed[0] == by_layout[(2, "none", 1.0, ())].losses
    assert resumed[1] == by_layout[(1, "none", 1.0, ())].losses
    cfg = load_config(None, _sets(parity_overrides, 3, "nvme", tmp_path / "nv_one"))
    one = Trainer(cfg, CPU, tmp_path / "resume1")
    assert one._resume() == 2
    losses = [one.train_step(s).loss for s in range(2, STEPS)]
    assert losses == pytest.approx(reference.losses[2:], rel=2e-5)
    assert_params_close(full_parameters(one), reference.params, "resharded", 1e-5, 1e-4)


def test_offload_on_4_ranks_matches_in_memory_and_one_process(parity_overrides, reference,
                                                              tmp_path):
    """4 gloo ranks, ZeRO-0/1/2/3 with cpu and nvme: as on 2 ranks (and the same resumes)."""
    runs, resumed = run_on_ranks(_offload_layouts, 4, parity_overrides, LAYOUTS_4,
                                 str(tmp_path), timeout_s=900)[0]
    _check_layouts(4, LAYOUTS_4, runs, reference)
    by_layout = dict(zip(LAYOUTS_4, runs))
    assert resumed[0] == by_layout[(2, "none", 1.0, ())].losses
    assert resumed[1] == by_layout[(1, "none", 1.0, ())].losses


# ---------------------------------------------------------------- a crash mid-step

KILL_STEPS = 8
KILL_DURING_UPDATE = 6  # the kill falls in step 6's update; checkpoints every 2 steps
KILLER = """
import os, signal, sys
from fivefold.config import load_config
from fivefold.memory.nvme_store import NvmeStore
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer
import torch

sets, run_dir, during = sys.argv[1].split("\\n"), sys.argv[2], int(sys.argv[3])
real_write, units_written = NvmeStore._write_chunk, []

def write_then_die(self, name, slot, start, buf):
    real_write(self, name, slot, start, buf)
    if self.updates == during - 1:  # this step's update: die once a second unit began
        units_written.append(name)
        if len(set(units_written)) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

NvmeStore._write_chunk = write_then_die
Trainer(load_config(None, sets), Runtime(0, 1, 0, torch.device("cpu")), run_dir).run()
"""


def _checkpoint(path: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)


def test_sigkill_mid_nvme_step_leaves_a_consistent_state_and_resumes_exactly(
        parity_overrides, tmp_path):
    """One rank, nvme offload, checkpoints every 2 steps. A child process SIGKILLs itself in
    step 6's optimizer update, after the first unit's new moments are written and while the
    second unit's are being written. Then: the store's manifest still names the version
    after 5 updates, and that slot holds exactly the moments an uninterrupted cpu-offload
    run had after step 5 (nothing half-updated), while the other slot already holds step 6's
    moments of the first unit (the kill did fall mid-step); a resumed run continues from the
    step-4 checkpoint and ends with parameters, moments and per-step losses bit-identical
    to the uninterrupted cpu-offload run."""
    common = parity_overrides + [f"train.steps={KILL_STEPS}", "train.eval_every=100",
                                 "train.eval_batches=1", "train.keep_checkpoints=100"]
    straight = tmp_path / "straight"
    Trainer(load_config(None, common + ["parallel.offload=cpu", "train.checkpoint_every=1"]),
            CPU, straight).run()
    store_root = tmp_path / "store"
    nvme = common + ["parallel.offload=nvme", f"parallel.offload_path='{store_root}'",
                     "train.checkpoint_every=2"]
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLER, "\n".join(nvme), str(killed),
                           str(KILL_DURING_UPDATE)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr

    store = store_root / "rank0"
    assert read_manifest(store)["updates"] == KILL_DURING_UPDATE - 1
    after = {step: _checkpoint(step_dir(straight, step), tmp_path / f"s{step}.pt")
             for step in (KILL_DURING_UPDATE - 1, KILL_DURING_UPDATE)}
    slots = sorted(store.glob("*.slot0.bin"))  # one per unit: {unit}.slot0.bin, 8 B/element
    assert len(slots) == 3  # root, layers.0, layers.1
    uncommitted = 1 - read_manifest(store)["slot"]
    for path in slots:
        name, numel = path.name.removesuffix(".slot0.bin"), path.stat().st_size // 8
        tag = f"{name}.shard0of1"
        committed = read_committed(store, name, numel)
        assert torch.equal(committed[0], after[5][f"exp_avg.{tag}"]), name
        assert torch.equal(committed[1], after[5][f"exp_avg_sq.{tag}"]), name
        if name == "root":  # the unit written in full before the kill: step 6's version
            newer = read_committed(store, name, numel, slot=uncommitted)
            assert torch.equal(newer[0], after[6][f"exp_avg.{tag}"])
            assert not torch.equal(newer[0], committed[0])

    assert latest_checkpoint(killed) == step_dir(killed, 4)  # what the resume loads
    Trainer(load_config(None, nvme), CPU, killed).run()
    final = {name: _checkpoint(step_dir(run, KILL_STEPS), tmp_path / f"{name}.pt")
             for name, run in (("straight", straight), ("killed", killed))}
    assert final["straight"].keys() == final["killed"].keys()
    for key, value in final["straight"].items():
        assert torch.equal(value, final["killed"][key]), key
    records = {run: {r["step"]: r["loss"] for r in map(json.loads, (path / "metrics.jsonl")
                                                        .read_text().splitlines())}
               for run, path in (("straight", straight), ("killed", killed))}
    assert set(records["killed"]) == set(range(1, KILL_STEPS + 1))
    assert records["killed"] == records["straight"]


def test_next_forward_waits_per_unit_for_its_update(parity_overrides, tmp_path):
    """The overlap, shown by order rather than time: with the update of unit "layers.1"
    held back after step 1, step 2's forward runs the root and block 0 (whose updates are
    done) and then waits in block 1's pre-hook until that update is released and done."""
    cfg = load_config(None, _sets(parity_overrides, 0, "cpu"))
    trainer = Trainer(cfg, CPU, tmp_path / "run")
    host, events, gate = trainer.engine.host, [], threading.Event()
    real_update = host._update

    def held_update(unit, updates, lr):
        if unit.name == "layers.1" and updates == 0:
            assert gate.wait(timeout=120)
        real_update(unit, updates, lr)
        events.append(("updated", unit.name))
    host._update = held_update
    for i, block in enumerate(trainer.model.layers):  # after the engine's waiting pre-hook
        block.register_forward_pre_hook(
            lambda m, a, i=i: events.append(("forward", f"layers.{i}")))

    def release_once_block_0_runs(since: int):
        """Release once step 2 runs block 0 (step 1's forward events come before `since`)."""
        deadline = time.monotonic() + 120
        while ("forward", "layers.0") not in events[since:] and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()
    trainer.train_step(0)
    releaser = threading.Thread(target=release_once_block_0_runs, args=(len(events),))
    releaser.start()
    try:
        trainer.train_step(1)
    finally:
        gate.set()
        releaser.join()
    step_2 = events[events.index(("updated", "root")):]
    assert step_2.index(("forward", "layers.0")) < step_2.index(("updated", "layers.1")) \
        < step_2.index(("forward", "layers.1"))
