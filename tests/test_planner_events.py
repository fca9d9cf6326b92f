"""The planner's discrete-event scheduler (fivefold.planner.events) on schedules worked out
by hand; tolerance 1e-12 s (exact arithmetic up to float rounding)."""

import pytest

from fivefold.planner.events import Op, exposed, schedule

H = 0.5  # overlap_eff


def test_stream_runs_its_ops_in_order_and_waits_serialise():
    ops = [Op("f1", "compute", 2.0), Op("ar", "tp", 1.0, after=(0,)),
           Op("f2", "compute", 3.0, after=(1,))]
    t = schedule(ops, H)
    assert t.start == (0.0, 2.0, 3.0) and t.end == (2.0, 3.0, 6.0)


def test_hidden_collective_slows_compute_by_one_minus_overlap_eff_of_its_time():
    # 1 s gather beside 4 s compute: both at rate 1/(2 - H) = 2/3 until the gather ends at
    # 1.5 s, having moved the compute 1 s; the other 3 s at full rate: 4.5 s
    t = schedule([Op("fwd", "compute", 4.0), Op("ag", "dp", 1.0)], H)
    assert t.end[1] == pytest.approx(1.5, abs=1e-12)
    assert t.end[0] == pytest.approx(4.5, abs=1e-12)
    assert t.makespan - 4.0 == pytest.approx(exposed(1.0, 4.0, H), abs=1e-12)


def test_longer_collective_shows_its_excess():
    # 3 s gather beside 1 s compute: shared until the compute ends at 1.5 s (the gather did
    # 1 s), then the gather's last 2 s alone: 3.5 s = max + (1 - H) min
    t = schedule([Op("fwd", "compute", 1.0), Op("ag", "dp", 3.0)], H)
    assert t.end == pytest.approx((1.5, 3.5), abs=1e-12)
    assert t.makespan - 1.0 == pytest.approx(exposed(3.0, 1.0, H), abs=1e-12)


def test_two_hidden_collectives_add_their_slowdowns():
    # 1 s and 2 s beside 10 s of compute: (1 - H) * 3 s = 1.5 s more
    ops = [Op("bwd", "compute", 10.0), Op("rs", "dp", 1.0), Op("ring", "cp", 2.0)]
    assert schedule(ops, H).makespan == pytest.approx(11.5, abs=1e-12)
    # by hand: three ops at 1/2 until rs ends at 2 s (compute 1 s done, ring 1 s done), then
    # two at 2/3 until the ring ends at 3.5 s (compute 2 s done), then compute alone: 11.5 s
    t = schedule(ops, H)
    assert t.end[1:] == pytest.approx((2.0, 3.5), abs=1e-12)


def test_collectives_without_compute_and_host_copies_do_not_contend():
    t = schedule([Op("a", "tp", 1.0), Op("b", "dp", 2.0), Op("copy", "host", 3.0)], 0.0)
    assert t.end == pytest.approx((1.0, 2.0, 3.0))
    # overlap_eff 0 beside compute: three ops at 1/3 until a ends at 3 s, then b and the
    # compute at 1/2 until b ends at 5 s, then the compute's last second; the copy untouched
    t = schedule([Op("a", "tp", 1.0), Op("b", "dp", 2.0), Op("copy", "host", 3.0),
                  Op("k", "compute", 3.0)], 0.0)
    assert t.end == pytest.approx((3.0, 5.0, 3.0, 6.0))


def test_full_overlap_and_none():
    ops = [Op("c", "compute", 2.0), Op("x", "dp", 1.0)]
    assert schedule(ops, 1.0).makespan == pytest.approx(2.0)
    assert schedule(ops, 0.0).makespan == pytest.approx(3.0)  # serialised


def test_not_before_and_dependency_chain():
    # a bucket reduced after its block's backward slice, the slices at the replay's clock
    ops = [Op("b1", "compute", 1.0, not_before=5.0), Op("r1", "dp", 2.0, after=(0,)),
           Op("b0", "compute", 1.0, after=(0,), not_before=7.0), Op("r0", "dp", 2.0, after=(2,))]
    t = schedule(ops, 1.0)
    assert t.start == pytest.approx((5.0, 6.0, 7.0, 8.0))
    assert t.makespan == pytest.approx(10.0)


def test_zero_second_ops_and_bad_waits():
    t = schedule([Op("nothing", "tp", 0.0), Op("c", "compute", 1.0, after=(0,))], H)
    assert t.end == (0.0, 1.0)
    with pytest.raises(ValueError, match="not listed before"):
        schedule([Op("a", "compute", 1.0, after=(1,)), Op("b", "tp", 1.0)], H)


def test_trace_draws_each_blocks_scheduled_ops_inside_its_action(tmp_path):
    """`fivefold simulate --trace`: one thread per stream; every block op lies inside the
    replayed action it belongs to (tolerance 1e-6 us), ring sends on the cp thread."""
    import json

    from fivefold.planner.simulate import simulate
    from fivefold.planner.spec import spec_config
    from fivefold.planner.trace import STREAMS, write_trace

    cfg = spec_config({"model": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2,
                                 "ffn_hidden": 512, "vocab": 1024, "seq_len": 4096},
                       "cluster": {"gpu": "H100-SXM", "gpus": 16, "gpus_per_node": 8},
                       "parallel": {"global_batch": 8, "micro_batch": 1, "pp": 2, "tp": 2,
                                    "sequence_parallel": True, "cp": 2, "zero_stage": 1}})
    est = simulate(cfg, keep_events=True)
    path = tmp_path / "trace.json"
    write_trace(est, path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    actions = [e for e in events if e.get("cat") == "action"]
    assert len(actions) == 2 * 2 * 4  # F and B, 2 stages, 4 micro-batches
    inside = [e for e in events if "(block" in e["name"]]
    assert {e["name"].split(" (")[0] for e in inside if e["tid"] == STREAMS.index("cp")} == {
        "ring sends"}
    for e in inside:
        owner = next(a for a in actions if a["name"] == e["args"]["action"]
                     and a["pid"] == e["pid"])
        assert owner["ts"] - 1e-6 <= e["ts"] <= e["ts"] + e["dur"] <= (
            owner["ts"] + owner["dur"] + 1e-6)


def test_block_ops_overlap_follows_the_waits():
    """fivefold.planner.block_ops on hand-set seconds (overlap_eff 0.5): ring sends beside
    attention show their excess; the ZeRO-3 prefetch runs through the forward's compute and
    its waits for tp collectives; tp collectives the compute waits for are all exposed."""
    from fivefold.planner.block_ops import BlockComm, Compute, block_seconds

    t = Compute(fwd=10.0, attn_f=4.0, bwd=20.0, attn_b=8.0, wgrad=6.0, recompute=0.0,
                full_recompute=False)
    f, b = block_seconds(BlockComm(tp_f=1.0, tp_b=2.0), t, H)
    assert (f, b) == pytest.approx((11.0, 22.0))
    # ring: 3 sends of 2 s beside 4 s of attention: 6 + 0.5 * 4 = 8 s instead of 4
    f, _ = block_seconds(BlockComm(cp_mode="ring", cp=4, cp_step=2.0), t, H)
    assert f == pytest.approx(10.0 + exposed(6.0, 4.0, H))
    # a 10.5 s prefetch beside 10 s of compute and a 1 s tp wait: shared until the compute
    # ends, alone during the wait, then the compute's rest; by hand with overlap_eff 1:
    # the prefetch ends at 10.5 s, inside the forward's 11 s
    f, _ = block_seconds(BlockComm(tp_f=1.0, dp_prefetch_f=10.5), t, 1.0)
    assert f == pytest.approx(11.0)
    assert 10.0 + 1.0 + exposed(10.5, 10.0, 1.0) == pytest.approx(11.5)  # the old rule's
