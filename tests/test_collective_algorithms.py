"""Collective algorithms and synthesized schedules (docs/collectives.md).

Torch-free checks: every fixed algorithm's schedule replays correctly for 1-8 ranks and
every node size; the alpha-beta price and the bandwidth bound match closed forms; the
synthesized all-gather of the three documented topologies is no slower (modeled) than ring
and hierarchical and within 10% of the bound; bad topologies, sketches, schedules and configs
fail with one ConfigError naming the key; the planner's hook prices the same schedule.

On gloo ranks (one start of 8 ranks; groups of 2..8 ranks inside it): every algorithm and
every synthesized schedule gives exactly the builtin collective's result on random integers,
with sizes that do not divide evenly into chunks and uneven all-to-all splits; the ledger holds
the schedule's point-to-point messages; the mesh hook (`Mesh.use_algorithms`) routes
`collectives.all_gather` through the executor while the default path records as before.
No timing is asserted (bench/collectives.py measures).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from fivefold.comm.algorithms.registry import BUILDERS, schedule_for
from fivefold.comm.bound import all_gather_bound
from fivefold.comm.choice import CommAlgorithms, algorithm_table, ranks_per_node
from fivefold.comm.schedule import (Schedule, Transfer, all_reduce_of, load_schedule, make,
                                    modeled_time_s, send_bytes)
from fivefold.comm.synthesize import Sketch, load_sketch, synthesize, synthesize_all_gather
from fivefold.comm.topology import load_topology, two_level
from fivefold.config import ConfigError, load_config
from fivefold.validate import validate

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "comm"
TOPOLOGIES = ("2x4", "4x2", "2x2_slow")
MiB64 = 64 * 2 ** 20


@lru_cache(maxsize=None)
def documented(name: str) -> tuple:
    """(topology, synthesized all-gather) of a configs/comm topology and its sketch."""
    topo = load_topology(CONFIGS / f"{name}.topology.toml")
    return topo, synthesize_all_gather(topo, load_sketch(CONFIGS / f"{name}.sketch.toml"))


@lru_cache(maxsize=None)
def documented_reduce_scatter(name: str) -> Schedule:
    """The synthesized reduce-scatter: the dual of the all-gather on the transposed topology."""
    topo = documented(name)[0]
    return synthesize("reduce_scatter", topo, load_sketch(CONFIGS / f"{name}.sketch.toml"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- torch-free

def test_every_fixed_schedule_replays_correctly():
    count = 0
    for n in range(1, 9):
        for g in divisors(n):
            for algorithm, table in BUILDERS.items():
                for collective in table:
                    schedule_for(collective, algorithm, n, g).check()
                    count += 1
    assert count == 20 * 10  # 20 (ranks, per_node) pairs, 10 algorithm-collective pairs


def test_price_matches_closed_forms():
    n, bw, lat = 8, 10e9, 2e-6
    topo = two_level(1, n, bw / 1e9, 1.0, latency_intra_us=lat * 1e6)
    ring = schedule_for("all_gather", "ring", n)
    assert modeled_time_s(ring, topo, MiB64) == pytest.approx((n - 1) * (lat + MiB64 / n / bw))
    tree = schedule_for("all_reduce", "tree", n)  # halving then doubling: 2 log2 n steps
    expected = 2 * sum(lat + MiB64 / 2 ** (s + 1) / bw for s in range(3))
    assert modeled_time_s(tree, topo, MiB64) == pytest.approx(expected)
    # a rank sends (n-1)/n of the buffer in the ring all-gather, as the ledger's ring volume
    assert send_bytes(ring, 3, MiB64) == pytest.approx(MiB64 * (n - 1) / n)


def test_bound_matches_the_cut_bounds():
    e = 12.5e9
    two_by_four = all_gather_bound(two_level(2, 4, 50, 12.5), MiB64)
    assert two_by_four.bandwidth_s == pytest.approx(MiB64 / 2 / (4 * e))  # half over 4 rails
    four_by_two = all_gather_bound(two_level(4, 2, 50, 12.5), MiB64)
    assert four_by_two.bandwidth_s == pytest.approx(MiB64 * 3 / 4 / (2 * e))
    slow = all_gather_bound(documented("2x2_slow")[0], MiB64)
    assert slow.bandwidth_s == pytest.approx(MiB64 / 2 / (e + e / 4))
    ring8 = all_gather_bound(two_level(1, 8, 10, 1, intra="ring"), MiB64)
    assert ring8.bandwidth_s == pytest.approx(MiB64 * 7 / 8 / 2 / 10e9)  # two in-links each


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_synthesized_all_gather_beats_ring_and_hierarchical_near_the_bound(name):
    topo, synth = documented(name)
    t = {alg: modeled_time_s(schedule_for("all_gather", alg, topo.ranks, topo.per_node), topo,
                             MiB64) for alg in ("ring", "hierarchical")}
    t["synthesized"] = modeled_time_s(synth, topo, MiB64)
    bound = all_gather_bound(topo, MiB64).bound_s
    assert t["synthesized"] <= min(t["ring"], t["hierarchical"])
    assert t["synthesized"] <= 1.10 * bound, (t, bound)
    assert synth.meta["objective_s"] == pytest.approx(t["synthesized"], rel=1e-6)


def test_reduce_scatter_and_all_reduce_synthesize_as_duals():
    topo = documented("4x2")[0]  # rail links run one way round: the dual needs the transpose
    rs = documented_reduce_scatter("4x2").check()
    assert modeled_time_s(rs, topo, MiB64) <= modeled_time_s(
        schedule_for("reduce_scatter", "hierarchical", 8, 2), topo, MiB64)
    small = two_level(1, 3, 10, 1)
    assert synthesize("all_reduce", small, Sketch(chunks_per_rank=2)).check().steps


def test_bad_input_gives_one_clear_message(tmp_path):
    cut = tmp_path / "cut.toml"
    cut.write_text('nodes = 2\ndevices_per_node = 2\n[intra]\nbandwidth_GBps = 10\n'
                   '[inter]\nlinks = "none"\n')
    with pytest.raises(ConfigError, match=r"comm.topology.*do not connect all 4 ranks: rank 2 "
                                          r"cannot be reached from rank 0"):
        load_topology(cut)
    topo = documented("2x2_slow")[0]
    with pytest.raises(ConfigError, match=r"comm.sketch.*unreachable from rank 0"):
        synthesize_all_gather(topo, Sketch(links="intra"))
    with pytest.raises(ConfigError, match=r"steps = 1 is too few.*needs 2 hops"):
        synthesize_all_gather(topo, Sketch(steps=1))
    with pytest.raises(ConfigError, match=r"not one of the allowed links.*drop that symmetry"):
        synthesize_all_gather(topo, Sketch(symmetry=("device_rotation",)))
    ring = schedule_for("all_gather", "ring", 4)
    partial = make("all_gather", 4, 1, ring.steps[:-1], "partial")
    path = tmp_path / "partial.json"
    path.write_text(partial.to_json())
    with pytest.raises(ConfigError, match=r"comm.schedule.*does not cover every chunk: rank \d "
                                          r"ends without chunk \d"):
        load_schedule(path)
    double = make("reduce_scatter", 2, 1, [[Transfer(0, 1, 1, True)], [Transfer(0, 1, 1, True)]])
    with pytest.raises(ConfigError, match="twice"):
        double.check()
    early = make("all_gather", 3, 1, [[Transfer(1, 2, 0)]])
    with pytest.raises(ConfigError, match="rank 1 sends chunk 0 before it holds it"):
        early.check()
    (tmp_path / "junk.json").write_text('{"ranks": 2}')
    with pytest.raises(ConfigError, match="is not a schedule file"):
        load_schedule(tmp_path / "junk.json")


def test_comm_config_section(tmp_path):
    assert algorithm_table("ring")["all_to_all"] == "builtin"
    assert algorithm_table({"all_gather": "synthesized"}) == {
        "all_gather": "synthesized", "reduce_scatter": "builtin", "all_reduce": "builtin",
        "all_to_all": "builtin"}
    cfg = load_config(None, ['comm.algorithm.all_gather="synthesized"',
                             f'comm.topology="{CONFIGS / "2x4.topology.toml"}"',
                             f'comm.sketch="{CONFIGS / "2x4.sketch.toml"}"'])
    validate(cfg)
    assert CommAlgorithms.from_config(load_config(None, [])) is None  # default: all builtin
    choice = CommAlgorithms.from_config(cfg)
    assert choice.schedule("all_reduce", 8, 4) is None
    with pytest.raises(ConfigError, match="the topology has 8 ranks but all_gather runs over 4"):
        choice.schedule("all_gather", 4, 2)
    bad = {'comm.algorithm="fastest"': r"comm.algorithm`: 'fastest' is not one of",
           'comm.algorithm.all_to_all="tree"': r"comm.algorithm.all_to_all`: 'tree'",
           'comm.algorithm.broadcast="ring"': r"comm.algorithm.broadcast`: not a collective",
           'comm.algorithm="synthesized"': r"needs comm.topology",
           'comm.sketch="nowhere.toml"': r"comm.sketch`: file 'nowhere.toml' does not exist",
           "comm.algorithm=3": r"comm.algorithm`: expected str"}
    for assignment, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, [assignment]))
    with pytest.raises(ConfigError, match="unknown section; sections are .* comm"):
        load_config(None, ["network.x=1"])


def test_planner_prices_the_runtime_schedules():
    from fivefold.planner.comm import Group, Links, collective_time

    links = Links(50e9, 12.5e9, 1e-6, 5e-6, 4)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for alg in ("ring", "tree", "hierarchical"):
            topo = two_level(2, 4, 50, 12.5, inter="rail_all")
            expected = modeled_time_s(schedule_for(op, alg, 8, 4), topo, MiB64)
            got = collective_time(op, MiB64, Group(8, 4), links, algorithm=alg)
            assert got == pytest.approx(expected)
    builtin = collective_time("all_gather", MiB64, Group(8, 4), links)
    assert builtin == collective_time("all_gather", MiB64, Group(8, 4), links, "builtin")


def test_ranks_per_node():
    assert ranks_per_node(list(range(8)), 4) == 4
    assert ranks_per_node([0, 2, 4, 6, 8, 10, 12, 14], 8) == 4
    assert ranks_per_node([0, 8, 1, 9], 8) == 1  # not grouped by node
    assert ranks_per_node([0, 1, 2], 8) == 3


# ---------------------------------------------------------------- on gloo ranks

def _cases() -> list[tuple[int, Schedule]]:
    """(group size, schedule) for every algorithm, node size and synthesized schedule."""
    cases = []
    for n in range(2, 9):
        for algorithm, table in BUILDERS.items():
            for collective in table:
                proper = [g for g in divisors(n) if 1 < g < n]  # g = 1 or n is the ring
                sizes = (proper or [1]) if algorithm == "hierarchical" else [1]
                cases += [(n, schedule_for(collective, algorithm, n, g)) for g in sizes]
    small = two_level(1, 3, 10, 1)  # one more world size, synthesized with the default sketch
    cases += [(3, synthesize(op, small, Sketch(chunks_per_rank=2)))
              for op in ("all_gather", "reduce_scatter", "all_reduce")]
    for name in TOPOLOGIES:
        topo, ag = documented(name)
        rs = documented_reduce_scatter(name)
        cases += [(topo.ranks, ag), (topo.ranks, rs),
                  (topo.ranks, all_reduce_of(rs, ag, "synthesized"))]
    return cases


def _compare_on_ranks(rt, cases):
    """Run every case and its builtin counterpart on random integers; return mismatches."""
    import torch
    import torch.distributed as dist

    from fivefold.comm import collectives as C
    from fivefold.comm import executor
    from fivefold.comm.ledger import Ledger
    from fivefold.parallel.mesh import Mesh

    me, world = dist.get_rank(), dist.get_world_size()
    groups = {n: (dist.new_group(list(range(n))) if n < world else None)
              for n in range(2, world + 1)}
    gen = torch.Generator().manual_seed(1000 + me)
    bad = []

    def rand(numel):
        return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=torch.int64)

    for index, (n, schedule) in enumerate(cases):
        if me >= n:
            continue
        ledger = Ledger()
        axis = C.Axis(f"g{n}", groups[n], n, me, ledger)
        op = schedule.collective
        for numel in (1, 4 * schedule.chunks + 3):
            if op == "all_gather":
                inp = rand(numel)
                want, got = torch.empty(numel * n, dtype=inp.dtype), torch.zeros(numel * n,
                                                                                 dtype=inp.dtype)
                C.all_gather(want, inp, axis, "ref")
                executor.all_gather(got, inp, axis, "test", schedule)
            elif op == "reduce_scatter":
                inp = rand(numel * n)
                want, got = torch.empty(numel, dtype=inp.dtype), torch.zeros(numel,
                                                                             dtype=inp.dtype)
                C.reduce_scatter(want, inp, axis, "ref")
                executor.reduce_scatter(got, inp, axis, "test", schedule)
            elif op == "all_reduce":
                want = rand(numel)
                got = want.clone()
                C.all_reduce(want, axis, "ref")
                executor.all_reduce(got, axis, "test", schedule)
            else:  # uneven splits: rank s sends (s + d + numel) % 5 elements to rank d
                send = [(me + d + numel) % 5 for d in range(n)]
                recv = [(s + me + numel) % 5 for s in range(n)]
                inp = rand(sum(send))
                want, got = torch.empty(sum(recv), dtype=inp.dtype), torch.zeros(
                    sum(recv), dtype=inp.dtype)
                C.all_to_all(want, inp, axis, "ref", recv, send)
                executor.all_to_all(got, inp, axis, "test", schedule, recv, send)
            if not torch.equal(want, got):
                bad.append(f"case {index}: {schedule.name} {op} on {n} ranks, numel {numel}")
        ops = {r.op for r in ledger.records if r.purpose == "test"}  # uneven all-to-all splits
        if not ops <= {"send", "recv"} | ({"all_gather"} if op == "all_to_all" else set()):
            bad.append(f"case {index}: the ledger holds {ops} for a schedule")

    # the mesh hook: all_gather by the hierarchical schedule, the rest builtin, as configured
    ledger = Ledger()
    mesh = Mesh({"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1}, "cpu", ledger)
    choice = CommAlgorithms({"all_gather": "hierarchical"})
    axis = mesh.use_algorithms(choice, gpus_per_node=4).axis("dp_shard")
    inp = rand(5)
    out = torch.empty(5 * world, dtype=inp.dtype)
    ref = torch.empty_like(out)
    C.all_gather(out, inp, axis, "params")
    C.all_gather(ref, inp, C.Axis("w", None, world, me, Ledger()), "params")
    grads = rand(6)
    C.all_reduce(grads, axis, "grads")
    sends = [r for r in ledger.records if r.op == "send"]
    expected_sends = sum(1 for step in choice.schedule("all_gather", world, 4).steps
                         for x in step if x.src == me)
    plain = Mesh({"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1}, "cpu",
                 Ledger()).axis("dp_shard")
    return {"bad": bad, "mesh_equal": torch.equal(out, ref), "per_node": axis.per_node,
            "mesh_ops": sorted({(r.op, r.purpose) for r in ledger.records}),
            "sends": (len(sends), expected_sends), "plain_algorithms": plain.algorithms}


def test_every_schedule_matches_the_builtin_collective_on_gloo_ranks():
    from fivefold.testing import run_on_ranks

    results = run_on_ranks(_compare_on_ranks, 8, _cases(), timeout_s=240)
    for rank, res in enumerate(results):
        assert res["bad"] == [], (rank, res["bad"][:5])
        assert res["mesh_equal"] and res["per_node"] == 4
        assert res["mesh_ops"] == [("all_reduce", "grads"), ("recv", "params"),
                                   ("send", "params")]
        assert res["sends"][0] == res["sends"][1]
        assert res["plain_algorithms"] is None


@pytest.mark.slow
def test_measured_order_on_slowed_links_follows_the_model(tmp_path):
    """bench/collectives.py --measure on the 2x2 topology with the slow rail: ring,
    hierarchical and synthesized, timed with delayed sends, rank as modeled (slow: timing)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "measured.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "collectives.py"), "--measure",
                           "--only", "2x2_slow", "--json", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())["measured"]
    assert row["order_measured"] == row["order_modeled"] == ["synthesized", "hierarchical",
                                                             "ring"]


def _train_under(rt, sets, tmp):
    from fivefold.config import load_config
    from fivefold.train.trainer import Trainer

    out = {}
    for algorithm in ("builtin", "ring", "tree"):
        trainer = Trainer(load_config(None, sets + [f"comm.algorithm={algorithm}"]), rt,
                          f"{tmp}/{algorithm}")
        out[algorithm] = ([trainer.train_step(s).loss for s in range(3)],
                          {r["op"] for r in trainer.ledger.as_dicts()})
    return out


def test_the_trainer_runs_its_collectives_by_comm_algorithm(parity_overrides, tmp_path):
    """`comm.algorithm` reaches the trainer's mesh: ZeRO-2 on 4 ranks trains the same losses
    (rel 1e-6: the schedules sum the same fp32 values in another order) with
    ring and recursive-doubling schedules as with torch's collectives, and the ledger then
    records the schedules' sends and receives instead of collective calls."""
    from fivefold.testing import run_on_ranks

    sets = parity_overrides + ["parallel.zero_stage=2"]
    runs = run_on_ranks(_train_under, 4, sets, str(tmp_path), timeout_s=300)[0]
    builtin_losses, builtin_ops = runs["builtin"]
    assert "reduce_scatter" in builtin_ops and "send" not in builtin_ops
    for algorithm in ("ring", "tree"):
        losses, ops = runs[algorithm]
        assert losses == pytest.approx(builtin_losses, rel=1e-6), algorithm
        assert {"send", "recv"} <= ops and "reduce_scatter" not in ops, algorithm
