"""The planner's host and disk tiers (fivefold.planner.offload, fivefold.hardware.HostTier):
offloaded bytes by the shared rule, to the byte, against an independent count of the runtime's
units; the step-time terms' response to each bandwidth; `plan` choosing offload for a model
that does not fit one GPU; and the profile files that carry the tiers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fivefold.config import load_config
from fivefold.hardware import PROFILES, STREAM_EFF, HostTier, load_profile
from fivefold.models.llama import Transformer
from fivefold.parallel.data_parallel import split_units
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.offload import CHUNK_ELEMENTS, UnitWork, offload_times
from fivefold.planner.rank_memory import predicted_rank_memory
from fivefold.planner.report import plan_text
from fivefold.planner.search import search
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import prepare
from fivefold.testing import run_on_ranks

# vocab 501: the root unit holds an odd number of elements, so sharding pads it
SMALL = ["model.layers=3", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
         "model.ffn_hidden=48", "model.vocab=501", "model.seq_len=16",
         "parallel.precision='bf16'", "parallel.global_batch=4"]
H100 = PROFILES["H100-SXM"]


def independent_state(cfg, world: int, tier: str, fraction: float) -> dict[str, int]:
    """The shared rule counted from the runtime's own units (split_units of the real model),
    padded to the shard degree as FlatUnit pads them; bf16 compute and reduce dtypes."""
    stage = cfg.parallel.zero_stage
    n = world if stage >= 1 else 1
    numels = [sum(p.numel() for _, p in params) for _, params, _ in
              split_units(Transformer(cfg.model))]
    padded = [math.ceil(x / n) * n for x in numels]
    local = [x // n for x in padded]
    k, held = 0, 0
    while held < fraction * sum(local):  # the shortest prefix reaching the fraction
        held += local[k]
        k += 1
    off, kept = sum(local[:k]), sum(local[k:])
    host, disk = {"cpu": (16, 0), "nvme": (8, 16)}[tier]
    params = 2 * sum(padded)
    grads = 2 * (sum(local) if stage >= 2 else sum(padded))
    return {"params": params, "grads": grads, "master": 4 * kept, "optimizer": 8 * kept,
            "total": params + grads + 12 * kept, "host": host * off, "disk": disk * off}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("stage,world", [(0, 1), (2, 2)])
def test_offloaded_bytes_follow_the_shared_rule(tier, fraction, stage, world, tmp_path):
    """Device, host and disk bytes of rank 0 equal the independent count exactly; at 0.5 a
    strict prefix moves (some state stays on the device), at 1 nothing of it stays."""
    cfg = load_config(None, SMALL + [f"parallel.zero_stage={stage}",
                                     f"parallel.offload='{tier}'",
                                     f"parallel.offload_fraction={fraction}",
                                     f"parallel.offload_path='{tmp_path}'"])
    plan = plan_from_config(cfg, world)
    assert plan.update == "engine"  # offload always runs on the engine, also on one rank
    want = independent_state(cfg, world, tier, fraction)
    assert predict_ledger(cfg, plan, 0).model_state_bytes == want
    if fraction == 1.0:
        assert want["master"] == want["optimizer"] == 0
    else:
        assert want["optimizer"] > 0 and want["host"] > 0
    rows = predicted_rank_memory(cfg, plan, 0)
    assert (rows["optimizer"], rows["host"], rows["disk"]) == (
        want["master"] + want["optimizer"], want["host"], want["disk"])


def test_without_offload_nothing_is_on_host_or_disk():
    cfg = load_config(None, SMALL + ["parallel.zero_stage=1"])
    state = predict_ledger(cfg, plan_from_config(cfg, 2), 0).model_state_bytes
    assert state["host"] == state["disk"] == 0 and state["optimizer"] > 0


# ------------------------------------------------------------------ step time

WORK = [UnitWork(50_000_000, 0.02)] + [UnitWork(200_000_000, 0.05)] * 8


def exposed(tier: str, **host) -> float:
    tier_host = dataclasses.replace(H100.host, **host)
    return offload_times(WORK, tier, tier_host, 1, 2, 2, True).exposed_s


@pytest.mark.parametrize("tier,field", [("cpu", "link_GBps"), ("cpu", "adam_elems_per_s"),
                                        ("cpu", "memory_GBps"), ("nvme", "link_GBps"),
                                        ("nvme", "adam_elems_per_s"),
                                        ("nvme", "nvme_read_GBps"),
                                        ("nvme", "nvme_write_GBps")])
def test_exposed_time_falls_as_each_bandwidth_grows(tier, field):
    """Scaling one host figure up never lengthens the step; from 1/16 to four times the
    datasheet value the exposed time falls strictly (each term is on the critical path
    somewhere in that range: under nvme the H100 host's CPU step hides behind its drives
    until its rate drops below theirs)."""
    base = getattr(H100.host, field)
    times = [exposed(tier, **{field: base * s}) for s in (1 / 16, 1 / 4, 1 / 2, 1, 2, 4)]
    assert all(b <= a for a, b in zip(times, times[1:]))
    assert times[-1] < times[0]


def test_one_unit_waits_for_the_whole_chain_and_nvme_pipelines_disk_with_cpu():
    """One unit: the forward waits for the download, the host's clipping (12 B per element
    at the memory bandwidth's STREAM share), the CPU step and the upload. Under nvme the
    unit takes the larger of its disk and CPU time plus one chunk, never their sum."""
    host = H100.host
    n, g, p = 10**8, 2, 2
    one = [UnitWork(n, 0.01)]
    link = host.link_Bps
    cpu = n / host.adam_elems_per_s
    clip = n * 12 / (host.memory_GBps * 1e9 * STREAM_EFF)
    got = offload_times(one, "cpu", host, 1, g, p, True)
    assert got.exposed_s == pytest.approx(n * g / link + clip + cpu + n * p / link, rel=1e-12)
    assert offload_times(one, "cpu", host, 1, g, p, False).exposed_s == pytest.approx(
        got.exposed_s - clip, rel=1e-12)
    per = 8 / (host.nvme_read_GBps * 1e9) + 8 / (host.nvme_write_GBps * 1e9)
    nvme = offload_times(one, "nvme", host, 1, g, p, True)
    assert nvme.exposed_s == pytest.approx(
        n * g / link + clip + max(cpu, n * per) + (1 << 16) * per + n * p / link, rel=1e-12)
    assert nvme.exposed_s < got.exposed_s + n * per  # pipelined, not summed


def test_the_forward_hides_the_later_units_and_the_device_work():
    """Many units: the forward of the first ones runs while the thread steps the next, so
    less shows than the whole chain; time the training thread spends on the device's own
    step before the forward hides more of it (the downloads and clipping never hide)."""
    host = H100.host
    chain = offload_times(WORK, "cpu", host, 1, 2, 2, True)
    serial = chain.download_s + chain.clip_s + chain.cpu_s + chain.upload_s
    assert chain.download_s + chain.clip_s < chain.exposed_s < serial
    later = offload_times(WORK, "cpu", host, 1, 2, 2, True, device_s=0.5)
    assert chain.download_s + chain.clip_s <= later.exposed_s < chain.exposed_s


def test_ranks_sharing_a_host_share_its_cpu_and_drives():
    host = H100.host
    alone = offload_times(WORK, "nvme", host, 1, 2, 2, True)
    shared = offload_times(WORK, "nvme", host, 8, 2, 2, True)
    assert shared.cpu_s == pytest.approx(8 * alone.cpu_s, rel=1e-12)
    assert shared.exposed_s > alone.exposed_s


# ------------------------------------------------------------------ simulate and plan

def spec_8b(*sets):
    return prepare(load_config(None, ["model.preset='8B'", "cluster.gpus=1",
                                      "cluster.gpu='H100-SXM'", "parallel.global_batch=8",
                                      "parallel.micro_batch=1", "parallel.recompute='full'",
                                      *sets]))


def test_simulate_counts_the_cpu_step_and_the_host_fit():
    """8B on one 80 GB H100: it does not fit without offload, fits with cpu offload, whose
    exposed CPU step is optimizer time (breakdown still sums to the step); a host too small
    for the 16 B per element makes it not fit again."""
    none, cpu = simulate(spec_8b()), simulate(spec_8b("parallel.offload='cpu'"))
    assert not none.fits and cpu.fits
    o = cpu.to_json()["offload"]
    assert o["exposed_s"] > 0 and o["host_fits"] and o["disk_bytes_per_gpu"] == 0
    device_step = cpu.step_model.optimizer_s(0)  # nothing left but its launches
    assert device_step < 1e-3
    assert cpu.breakdown_s["optimizer"] == pytest.approx(device_step + o["exposed_s"], rel=1e-9)
    assert sum(cpu.breakdown_s.values()) == pytest.approx(cpu.step_time_s, rel=1e-9)
    assert cpu.memory_per_gpu_bytes["optimizer"] == 0
    assert o["host_bytes_per_gpu"] == 16 * sum(
        u.padded for u in cpu.step_model.rank_units(0))
    small_host = dataclasses.replace(H100, host=dataclasses.replace(
        H100.host, memory_bytes=o["host_bytes_per_gpu"] - 1))
    assert not simulate(spec_8b("parallel.offload='cpu'"), small_host).fits
    slow_link = dataclasses.replace(H100, host=dataclasses.replace(H100.host, link_GBps=4.0))
    assert simulate(spec_8b("parallel.offload='cpu'"), slow_link).step_time_s > cpu.step_time_s


def test_plan_fits_a_model_too_big_for_one_gpu_with_cpu_offload():
    """`plan` for 8B on one H100: no layout fits without offload, so the best one offloads to
    the CPU; its step time includes the exposed CPU step, and the text says so."""
    cfg = spec_8b()
    result = search(cfg, H100, top_k=3)
    assert result.best
    best = result.best[0]
    assert best.layout.offload == "cpu" and best.fits
    alone = simulate(cfg, H100, best.layout.replace(offload="none"))
    assert not alone.fits
    assert best.step_time_s == pytest.approx(
        alone.step_time_s - alone.breakdown_s["optimizer"] + best.breakdown_s["optimizer"],
        rel=1e-9)
    assert best.offload["exposed_s"] > 0
    text = plan_text(result, cfg, H100, "spec.toml")
    assert "it fits with cpu offload" in text and "--set parallel.offload=cpu" in text


def test_plan_takes_nvme_when_the_host_cannot_hold_the_cpu_tier():
    """A host with 100 GiB: 8B's 16 B per element (120 GiB) do not fit it, nvme's 8 B do, so
    the best layout offloads to nvme, and the command asks for its directory."""
    small_host = dataclasses.replace(H100, host=dataclasses.replace(
        H100.host, memory_bytes=100 * 2**30))
    cfg = spec_8b()
    result = search(cfg, small_host, top_k=1)
    best = result.best[0]
    assert best.layout.offload == "nvme" and best.fits
    assert best.offload["host_bytes_per_host"] <= 100 * 2**30 < 2 * best.offload[
        "host_bytes_per_host"]
    assert "--set parallel.offload_path=DIR" in plan_text(result, cfg, small_host, "s.toml")


def test_plan_keeps_offload_off_when_the_model_fits():
    cfg = prepare(load_config(None, ["model.preset='1B'", "cluster.gpus=1",
                                     "cluster.gpu='H100-SXM'", "parallel.global_batch=8"]))
    best = search(cfg, H100, top_k=1).best[0]
    assert best.layout.offload == "none" and best.offload is None


# ------------------------------------------------------------------ profiles

def test_profile_files_carry_the_host_tier(tmp_path):
    """A profile written with host figures reads back equal; one written before the tier
    existed reads with the generic defaults."""
    prof = dataclasses.replace(PROFILES["cpu"], host=HostTier(1.0, 1.0, 2**30, 10.0, 0.5,
                                                              0.25, 2, 1e8, "test"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert load_profile(str(path)) == prof
    old = prof.to_dict()
    del old["host"]
    path.write_text(json.dumps(old))
    assert load_profile(str(path)).host == HostTier()


def test_calibrate_measures_the_disk_and_the_cpu_adam(tmp_path):
    """The scratch file is written, read and removed; torch's foreach AdamW (offload's
    kernel) is timed, and a kernel torch lacks reads as None."""
    from fivefold.planner.calibrate import measure_cpu_adam, measure_storage

    write, read = measure_storage(str(tmp_path), 8 * 2**20)
    assert write > 0 and read > 0 and not list(tmp_path.iterdir())
    assert measure_cpu_adam(2, numel=2**16) > 0
    assert measure_cpu_adam(2, "no-such-kernel", numel=2**16) is None


def test_auto_writes_the_offload_tier_into_the_layout_it_trains():
    """parallel.auto's config for an offloaded layout spells the tier and fraction out (and
    its --set overrides), and its plan is the scored one again."""
    from fivefold.planner.auto import layout_config, layout_overrides

    cfg = load_config(None, SMALL[:-2] + ["parallel.global_batch=4"])
    lay = plan_from_config(cfg, 1, "fp32").replace(offload="cpu", offload_fraction=0.5)
    run_cfg = layout_config(cfg, lay)
    assert (run_cfg.parallel.offload, run_cfg.parallel.offload_fraction) == ("cpu", 0.5)
    assert {'parallel.offload="cpu"', "parallel.offload_fraction=0.5"} <= set(
        layout_overrides(run_cfg))
    assert plan_from_config(run_cfg, 1, "fp32") == lay


# ------------------------------------------------------------------ against the runtime

def _offload_states(rt, cases):
    """Per case: (the engine's recorded model-state bytes after two steps, the planner's)."""
    from fivefold.parallel.plan import training_plan
    from fivefold.train.trainer import Trainer

    out = []
    for sets in cases:
        cfg = load_config(None, sets)
        trainer = Trainer(cfg, rt, "unused")
        trainer.train_step(0)
        trainer.train_step(1)
        plan = training_plan(cfg, rt.world_size, "cpu")
        out.append((trainer.ledger.model_state_bytes,
                    predict_ledger(cfg, plan, rt.rank).model_state_bytes))
    return out


def test_predicted_tiers_equal_the_offload_runtime_record(parity_overrides, tmp_path):
    """Device, host and disk bytes predicted equal, to the byte, what the offload runtime's
    engine records on every rank: one rank at ZeRO 0 and two ranks at ZeRO 0-3, cpu and nvme,
    fractions 1 and 0.5 (one process start per world size)."""

    for world, stages in ((1, (0,)), (2, (0, 1, 2, 3))):
        cases = [parity_overrides + [
            f"parallel.zero_stage={stage}", f"parallel.offload='{tier}'",
            f"parallel.offload_fraction={fraction}",
            f"parallel.offload_path='{tmp_path}/{world}{tier}{fraction}{stage}'"]
            for tier in ("cpu", "nvme") for fraction in (1.0, 0.5) for stage in stages]
        for rank, results in enumerate(run_on_ranks(_offload_states, world, cases,
                                                     timeout_s=600)):
            for sets, (recorded, predicted) in zip(cases, results):
                assert recorded == predicted, (world, rank, sets[-4:])
                assert recorded["host"] > 0


def test_the_nvme_chunk_the_planner_streams_is_the_stores():
    """planner.offload keeps its own copy (the planner runs without torch)."""
    from fivefold.memory import nvme_store
    assert CHUNK_ELEMENTS == nvme_store.CHUNK_ELEMENTS
