"""`fivefold plan` tries activation offload (fivefold.planner.search): a layout without
recomputation that does not fit is tried with the fewest blocks per stage whose saved
tensors, on the host, make it fit by the fast pass's count; the search's cheap filter of
where activation offload composes is the composition table's (fivefold.compositions). Under
virtual stages the count is per model chunk, as the runtime offloads (each chunk's first
blocks) and the fast pass prices it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fivefold.compositions import ANY_USE, REFUSALS, features_of
from fivefold.config import load_config
from fivefold.hardware import PROFILES
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.auto import plan_search
from fivefold.planner.report import plan_text, train_command
from fivefold.planner.search import FastScorer, search
from fivefold.planner.search_space import hosts_activations
from fivefold.planner.spec import prepare
from fivefold.planner.step import LayoutStep

H100 = PROFILES["H100-SXM"]
LONG = ["model.preset='8B'", "cluster.gpus=8", "cluster.gpu='H100-SXM'",
        "parallel.global_batch=8", "model.seq_len=32768"]


def _refused(cfg) -> bool:
    """Whether a row of the composition tables refuses cfg's activation offload."""
    have = features_of(cfg, 1)
    name = "offload_activations"
    return any((r.a == name and have & set(r.b) or name in r.b and r.a in have)
               and set(r.when) <= have for r in ANY_USE + REFUSALS)


@pytest.mark.parametrize("schedule, vpp", [
    ("1f1b", 1), ("gpipe", 1), ("zb", 1), ("interleaved", 2), ("terapipe", 1),
    ("pipedream-2bw", 1), ("zbv", 2), ("dualpipev", 2)])
def test_the_search_filter_is_the_composition_tables(schedule, vpp):
    for recompute in ("none", "selective", "full"):
        cfg = load_config(None, ["model.layers=8", "parallel.pp=2", "parallel.micro_batch=1",
                                 f"parallel.schedule='{schedule}'", f"parallel.vpp={vpp}",
                                 f"parallel.recompute='{recompute}'",
                                 "parallel.offload_activations=1"])
        assert hosts_activations(recompute, schedule) == (not _refused(cfg)), recompute
        assert _refused(cfg) == (recompute != "none" or schedule == "terapipe"), recompute


def test_hosted_variant_is_the_fewest_blocks_that_fit():
    """8B at 32k tokens on tp 4 x pp 2: without recomputation no layout of it fits an H100;
    the variant takes the fewest blocks per stage off the device that make the fast pass's
    peak fit, and one block fewer does not."""
    cfg = prepare(load_config(None, LONG + ["parallel.tp=4", "parallel.pp=2",
                                            "parallel.micro_batch=1"]))
    lay = plan_from_config(cfg, 8)
    scorer = FastScorer(cfg, H100)
    _, peak, _ = scorer.score(lay)
    assert peak > H100.memory_bytes
    hosted = scorer.hosted_activations(lay, peak)
    k = hosted.offload_activations
    assert 1 <= k <= math.ceil(cfg.model.layers / lay.pp)
    assert scorer.score(hosted)[1] <= H100.memory_bytes
    assert scorer.score(hosted.replace(offload_activations=k - 1))[1] > H100.memory_bytes
    assert scorer.hosted_activations(lay.replace(recompute="selective"), peak) is None
    assert scorer.hosted_activations(lay.replace(offload="cpu"), peak) is None


def test_plan_reports_and_runs_a_layout_that_offloads_activations():
    """With recomputation held off (the search's other answer to activations that do not
    fit) and tp at most 4 (tp 8 with sequence parallelism fits as it is), the 8B at 32k
    tokens fits 8 H100s only by offloading activations: `plan` finds such layouts, its exact
    simulation agrees they fit, and the text and the train command say how many blocks each
    stage offloads."""
    cfg = prepare(load_config(None, LONG))
    result = search(cfg, H100, top_k=3, exact=6,
                    accept=lambda lay: lay.recompute == "none" and lay.tp <= 4)
    assert result.best
    best = result.best[0]
    assert best.fits and best.layout.offload_activations >= 1
    assert best.activation_offload["host_fits"]
    text = plan_text(result, cfg, H100, "spec.toml")
    assert "it fits with its activations offloaded" in text
    assert (f"--set parallel.offload_activations={best.layout.offload_activations}"
            in train_command(best, cfg, "spec.toml"))


def test_fast_pass_refuses_a_variant_whose_host_cannot_hold_the_blocks():
    """The fast pass checks the host as the exact pass does: the hosted variant fits a host
    with room for its ranks' offloaded blocks, of every micro-batch in flight, and reads
    infinite on a host a byte short of them, where the exact simulation says it does not
    fit either."""
    cfg = prepare(load_config(None, LONG + ["parallel.tp=4", "parallel.pp=2",
                                            "parallel.micro_batch=1"]))
    lay = plan_from_config(cfg, 8)
    scorer = FastScorer(cfg, H100)
    hosted = scorer.hosted_activations(lay, scorer.score(lay)[1])
    step, peak, _ = scorer.score(hosted)
    assert step < math.inf and peak <= H100.memory_bytes
    exact = LayoutStep(cfg, H100, hosted, {}).estimate()  # the exact pass's host bytes
    need = exact.activation_offload["host_bytes_per_host"]
    for room, fits in ((need, True), (need - 1, False)):
        host = dataclasses.replace(H100.host, memory_bytes=room)
        small = dataclasses.replace(H100, host=host)
        assert (FastScorer(cfg, small).score(hosted)[0] < math.inf) is fits, room
        assert LayoutStep(cfg, small, hosted, {}).estimate().fits is fits, room


def test_plan_holds_a_specs_count_per_model_chunk_under_virtual_stages():
    """A spec that holds vpp 2 and offload_activations 2 is searched: every layout `plan`
    returns keeps both, its exact simulation fits device and host, and it offloads two
    blocks of each of a rank's chunks (the host's bytes are twice a chunk's count's)."""
    cfg = load_config(None, LONG[:-1] + ["parallel.pp=4", "parallel.vpp=2",
                                         "parallel.schedule='interleaved'",
                                         "parallel.offload_activations=2"])
    result = plan_search(cfg, H100, 2)
    assert result.best
    for est in result.best:
        lay = est.layout
        assert (lay.vpp, lay.offload_activations, lay.pp) == (2, 2, 4) and est.fits
        assert est.activation_offload["host_fits"]
        sm = est.step_model
        one = est.activation_offload["bytes_each_way_per_micro_batch"]
        assert one == max(sum(sm.block_saved_bytes(i) for i in (*sm.stage_ranges[r][:2],
                                                               *sm.stage_ranges[r + 4][:2]))
                          for r in range(4))
