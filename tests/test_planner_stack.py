"""train.stack, the software switches, the fitted constants and the cross-validation.

Fast: single simulations and one fit iteration over three rows; the full
`plan validate --cross` (minutes) is docs/planner.md's table, not a test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.config import ConfigError, load_config
from fivefold.hardware import PROFILES
from fivefold.kernel_tables import FLASH2_RATE_H100, attention_rate
from fivefold.planner import activations as A
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.fitted import BOUNDS, FITTED, Fitted, in_training
from fivefold.planner.search import FastScorer
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import spec_config
from fivefold.planner.stack import FIVEFOLD, STACKS, stack_of
from fivefold.planner.validation import (SOURCES, cross_report, fit_constants, read_runs,
                                         source_of)
from fivefold.validate import STACKS as STACK_NAMES
from fivefold.validate import validate, validate_for_training


def _spec(stack: str, **parallel) -> dict:
    return {"model": {"preset": "8B"}, "cluster": {"gpu": "H100-SXM", "gpus": 64},
            "parallel": {"global_batch": 128, "tp": 2, "sequence_parallel": True,
                         "zero_stage": 1, "micro_batch": 2, **parallel},
            "train": {"stack": stack}}


def test_every_stack_is_a_config_value_and_unknown_ones_name_the_key():
    assert set(STACKS) == set(STACK_NAMES)
    with pytest.raises(ConfigError, match="train.stack"):
        validate(load_config(None, ["train.stack='nemo'"]))


def test_fivefold_train_runs_only_its_own_stack():
    validate_for_training(load_config(None, []), 1)
    with pytest.raises(ConfigError, match="train.stack"):
        validate_for_training(load_config(None, ["train.stack='megatron'"]), 1)


def test_fivefold_stack_keeps_fivefolds_own_activation_count():
    m = load_config(None, ["model.preset='tiny'"]).model
    for rec in ("none", "full", "selective"):
        assert (A.block_saved_bytes(m, 512, 2, 1, False, rec, 0, FIVEFOLD)
                == A.block_saved_bytes(m, 512, 2, 1, False, rec, 0))
    assert A.root_saved_bytes(m, 512, 2, stack=FIVEFOLD) == A.root_saved_bytes(m, 512, 2)


def test_megatron_stack_holds_less_and_hides_its_collectives():
    mine = simulate(spec_config(_spec("fivefold", precision="fp8")))
    meg = simulate(spec_config(_spec("megatron", precision="fp8")))
    # fp8-saved linear inputs, GQA not repeated, no fp32 logits
    assert meg.memory_per_gpu_bytes["activations"] < mine.memory_per_gpu_bytes["activations"]
    assert meg.memory_per_gpu_bytes["other"] < mine.memory_per_gpu_bytes["other"]
    # fused element-wise kernels and fused casts, TP and parameter gathers overlapped
    assert meg.breakdown_s["compute"] < mine.breakdown_s["compute"]
    assert meg.breakdown_s["exposed_comm"] < mine.breakdown_s["exposed_comm"]


def test_megatron_hides_tensor_parallel_collectives_only_with_sequence_parallelism():
    """Megatron-LM refuses tp_comm_overlap without sequence parallelism (stack.py,
    tp_overlap): without it the same layout's all-reduces are exposed, as under a release
    before the overlap."""
    meg = stack_of("megatron", "2025-09")
    assert meg.overlaps_tp_collectives(2, True)
    assert not meg.overlaps_tp_collectives(2, False) and not meg.overlaps_tp_collectives(1, True)
    assert not stack_of("megatron", "2023-01").overlaps_tp_collectives(2, True)
    no_sp = {"sequence_parallel": False, "recompute": "selective"}
    newer = simulate(spec_config(_spec("megatron", **no_sp)
                                 | {"train": {"stack": "megatron", "stack_release": "2025-09"}}))
    older = simulate(spec_config(_spec("megatron", **no_sp)
                                 | {"train": {"stack": "megatron", "stack_release": "2023-04"}}))
    assert newer.breakdown_s["exposed_comm"] == pytest.approx(older.breakdown_s["exposed_comm"],
                                                              rel=1e-9)


def test_megatron_issues_backward_tensor_parallel_collectives_beside_the_weight_gradients():
    """From 2021-09 Megatron-LM all-reduces a column-parallel linear's input gradient beside
    its weight-gradient GEMM (stack.py, tp_async_grad_since); the forward's stay exposed."""
    assert not stack_of("megatron", "2021-04").async_tp_grads
    assert stack_of("megatron", "2022-05").async_tp_grads and not FIVEFOLD.async_tp_grads
    plain = {"sequence_parallel": False, "recompute": "full"}
    runs = {r: simulate(spec_config(_spec("megatron", **plain)
                                    | {"train": {"stack": "megatron", "stack_release": r}}))
            for r in ("2021-04", "2022-05")}
    assert runs["2022-05"].breakdown_s["exposed_comm"] < runs["2021-04"].breakdown_s["exposed_comm"]


def _rate(stack, gpu: str) -> float:
    prof = PROFILES[gpu]
    return attention_rate(prof.attention_generations, stack.attention_generation(prof.architecture))


def test_torchtitan_runs_a_flash2_class_kernel_on_hopper():
    tt = STACKS["torchtitan"]
    assert tt.attention_generation("hopper") == "fa2"
    assert _rate(tt, "H100-SXM") == FLASH2_RATE_H100
    assert _rate(tt, "A100-80GB") == 1.0  # FlashAttention-2 is Ampere's own measured kernel
    assert _rate(FIVEFOLD, "H200") == 1.0
    # the published kernel ratio (arXiv 2407.08608 Figs. 5-6), not a fitted constant
    assert FLASH2_RATE_H100 == pytest.approx(0.565, abs=5e-4)
    assert "flash2_rate" not in BOUNDS


def test_the_stack_reads_the_architecture_field_not_the_profile_name():
    """A profile named like nothing the stack knows still gets its architecture's kernel; a
    Hopper-named profile of another architecture does not get Hopper's."""
    import dataclasses
    tt = STACKS["torchtitan"]
    odd = dataclasses.replace(PROFILES["H100-SXM"], name="my-node")
    assert _rate_of(tt, odd) == FLASH2_RATE_H100
    fake = dataclasses.replace(PROFILES["A100-80GB"], name="H100-lookalike")
    assert _rate_of(tt, fake) == 1.0
    import fivefold.planner.stack as stack_module
    assert not hasattr(stack_module, "HOPPER") and not hasattr(stack_module, "BLACKWELL")


def _rate_of(stack, prof) -> float:
    return attention_rate(prof.attention_generations, stack.attention_generation(prof.architecture))


def test_megatron_attention_follows_its_release_per_architecture():
    meg = stack_of("megatron", "2024-03")
    assert meg.attention_generation("hopper") == "fa2"
    assert stack_of("megatron", "2024-07").attention_generation("hopper") == "fa3"
    assert stack_of("megatron").attention_generation("hopper") == "fa3"  # the newest
    assert _rate(meg, "H100-SXM") == FLASH2_RATE_H100
    assert _rate(stack_of("megatron", "2024-07"), "H100-SXM") == 1.0
    # before Megatron-LM's FlashAttention merge (2023-01) the attention is unfused, on any
    # architecture; DeepSpeed's 2021 runs ran the same Megatron model code
    assert stack_of("megatron", "2021-04").attention_generation("ampere") == "unfused"
    assert stack_of("megatron", "2022-12").attention_generation("hopper") == "unfused"
    assert stack_of("megatron", "2023-01").attention_generation("ampere") == "fa2"
    assert stack_of("deepspeed", "2021-04").attention_generation("ampere") == "unfused"
    # Blackwell has no FlashAttention-2-class figure: both sides of 2025-09 run at one rate
    for release in ("2025-07", "2025-09"):
        assert _rate(stack_of("megatron", release), "GB200") == 1.0
    old = _spec("megatron")
    old["model"]["seq_len"] = 32768
    new = json.loads(json.dumps(old))
    old["train"]["stack_release"], new["train"]["stack_release"] = "2024-03", "2025-11"
    assert (simulate(spec_config(old)).breakdown_s["compute"]
            > simulate(spec_config(new)).breakdown_s["compute"])


@pytest.mark.parametrize("release", ["2025", "25.11", "2025-13", "2025/11", 202511])
def test_a_bad_stack_release_names_the_key(release):
    with pytest.raises(ConfigError, match="train.stack_release"):
        validate(load_config(None, ["train.stack='megatron'",
                                    f"train.stack_release={json.dumps(release)}"]))


def test_stack_release_is_refused_for_fivefold_itself():
    with pytest.raises(ConfigError, match="train.stack_release"):
        validate(load_config(None, ["train.stack_release='2025-11'"]))


def test_fitted_constants_leave_cpu_profiles_as_measured():
    assert in_training(PROFILES["cpu"]) is PROFILES["cpu"]
    h = in_training(PROFILES["H200"])
    assert h.eff.gemm_eff == pytest.approx(PROFILES["H200"].eff.gemm_eff * FITTED.sustained)
    for k, (lo, hi) in BOUNDS.items():
        assert lo <= getattr(FITTED, k) <= hi, k


def test_every_calibration_row_has_a_source_family_and_a_stack():
    runs = read_runs()
    assert len(runs) == 140
    assert {source_of(r) for r in runs} == set(SOURCES)
    assert all(r["spec"]["train"]["stack"] in STACKS for r in runs)


def test_packaged_runs_keep_the_shared_rows():
    shared = Path(__file__).resolve().parents[2] / "shared/reference/calibration_runs.json"
    if not shared.is_file():
        pytest.skip("shared/reference is not next to this checkout")
    ours = {r["id"]: r for r in read_runs()}
    for row in json.loads(shared.read_text())["runs"]:
        mine = ours[row["id"]]
        assert mine["published"] == row["published"] and mine["source"] == row["source"]
        assert mine["spec"]["model"] == row["spec"]["model"]
        # a packaged row may correct keys from a named source; it lists them
        corrected = {k.split(".", 1)[1] for k in mine.get("corrected", [])
                     if k.startswith("parallel.")}
        theirs, ours_par = row["spec"]["parallel"], mine["spec"]["parallel"]
        differ = {k for k in set(theirs) | set(ours_par) if theirs.get(k) != ours_par.get(k)}
        assert differ == corrected, row["id"]
        assert mine["assumption_notes"].startswith(row["assumption_notes"])


def test_fit_lowers_the_loss_within_bounds():
    runs = [r for r in read_runs() if r["id"] in ("torchtitan_t1_1", "megatron21_t1_1.7B",
                                                 "nemo2403_longctx_LLAMA2-7B_4k_4gpu_cp1")]
    configs = [spec_config(r["spec"]) for r in runs]
    published = [r["published"]["step_time_s"] for r in runs]
    start = Fitted()
    result = fit_constants(configs, published, start, iterations=1)
    import math
    start_loss = sum(abs(math.log(simulate(c, fit=start).step_time_s / p))
                     for c, p in zip(configs, published)) / len(runs)
    assert result.loss <= start_loss
    for k, (lo, hi) in BOUNDS.items():
        assert lo <= getattr(result.fit, k) <= hi


def test_cross_report_names_sources_constants_and_bounds():
    from fivefold.planner.validation import CrossValidation, FitResult, RunCheck

    a = RunCheck("r1", "H200", 8, 1.1, 1.0, ("torchtitan",))
    b = RunCheck("r1", "H200", 8, 1.2, 1.0, ("torchtitan",))
    fr = FitResult(FITTED, 0.1, ("overlap_eff",))
    text = cross_report(CrossValidation([a], fr, [b], {"torchtitan": fr}, {"r1": "torchtitan"}))
    assert "held-out MAPE" in text and "+20.0%" in text
    assert f"fitted constants: {len(BOUNDS)}" in text
    assert "at their bounds (in-sample): overlap_eff" in text


def test_fivefold_runs_moe_layers_on_the_experts_grid_megatron_splits_them_over_tp():
    """Under tp 2 the fivefold stack holds an MoE block's experts on their own grid, as its
    runtime does (tests/test_planner_ledger.py holds those bytes against the runtime's):
    with etp 1 whole on each rank, their GEMMs at full width on the rank's half of the
    tokens; with etp 2 split like Megatron's, whose expert tensor parallelism follows tp."""
    from fivefold.parallel.plan import plan_from_config
    from fivefold.planner.compute import block_gemms
    from fivefold.planner.step import LayoutStep

    def step_model(stack, etp=1):
        spec = {"model": {"preset": "mixtral-8x7B"}, "cluster": {"gpu": "H100-SXM", "gpus": 64},
                "parallel": {"global_batch": 64, "tp": 2, "ep": 8, "etp": etp,
                             "micro_batch": 1, "zero_stage": 1}, "train": {"stack": stack}}
        cfg = spec_config(spec)
        return LayoutStep(cfg, PROFILES["H100-SXM"], plan_from_config(cfg, 64))

    mine, meg, split = step_model("fivefold"), step_model("megatron"), step_model("fivefold", 2)
    experts = [sm.block_numel(True) - sm.block_numel(True, dense_only=True)
               for sm in (mine, meg, split)]
    assert experts[0] == 2 * experts[1] == 2 * experts[2]
    assert mine.block_numel(True, dense_only=True) == meg.block_numel(True, dense_only=True)
    gemms = [{g.name: g for g in block_gemms(sm.model, sm.shard, True)[1]}["expert.w1"]
             for sm in (mine, meg, split)]
    F = mine.model.moe.expert_ffn_hidden
    assert [g.n for g in gemms] == [F, F // 2, F // 2]
    # the rank routes half the tokens; with etp 2 it computes its etp pair's rows
    assert gemms[0].m * 2 == gemms[1].m == gemms[2].m


def test_fp8_weights_are_counted_at_the_bytes_the_stack_keeps_them_in():
    """Megatron from its fp8_param_gather release keeps the blocks' linear weights as fp8
    (Stack.fp8_weight_bytes): on Blackwell one byte each, so the 8B model's parameters drop by
    one byte per linear weight element the rank holds, exact to the byte (ZeRO-1: all 32
    blocks'; ZeRO-3 over 8 ranks: an eighth of them, and the two gathered blocks' copies);
    on Hopper TE also keeps each fp8 weight's transpose: two bytes, as bf16. Gradients,
    master and optimizer states and activations do not move; before the release and under
    the fivefold stack (memory equal to its runtime's) nothing does."""
    linear = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336  # one 8B block's linears

    def mem(gpu: str, zero: int, stack: str = "megatron", **train) -> dict:
        spec = {"model": {"preset": "8B"}, "cluster": {"gpu": gpu, "gpus": 8},
                "parallel": {"global_batch": 8, "micro_batch": 1, "precision": "fp8",
                             "zero_stage": zero}, "train": {"stack": stack, **train}}
        return simulate(spec_config(spec)).memory_per_gpu_bytes

    for zero, held, gathered in ((1, 32 * linear, 0), (3, 32 * linear // 8, 2 * linear)):
        new = mem("B200", zero, stack_release="2025-11")
        old = mem("B200", zero, stack_release="2024-03")  # before fp8_param_gather_since
        assert (old["params"] - new["params"], old["other"] - new["other"]) == (held, gathered)
        assert all(new[k] == old[k] for k in ("grads", "optimizer", "activations"))
        hopper = [mem("H100-SXM", zero, stack_release=r) for r in ("2025-11", "2024-03")]
        assert [(m["params"], m["other"]) for m in hopper] == [(hopper[1]["params"],
                                                                 hopper[1]["other"])] * 2
        ours = mem("B200", zero, "fivefold")
        assert ours["params"] == old["params"]


def test_the_search_fast_pass_counts_fp8_weights_as_the_simulation_does():
    """`plan`'s fast pass (planner.search.FastScorer) holds the same one-byte fp8 weights on
    Blackwell: its peak drops by one byte per linear weight element the rank holds (ZeRO-1,
    all 32 blocks of the 8B model on one pipeline rank; float rounding: 1 byte)."""
    linear = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336  # one 8B block's linears
    peaks = []
    for release in ("2025-11", "2024-03"):
        cfg = spec_config({"model": {"preset": "8B"}, "cluster": {"gpu": "B200", "gpus": 8},
                           "parallel": {"global_batch": 8, "micro_batch": 1,
                                        "precision": "fp8", "zero_stage": 1},
                           "train": {"stack": "megatron", "stack_release": release}})
        peaks.append(FastScorer(cfg, PROFILES["B200"]).score(plan_from_config(cfg, 8))[1])
    assert peaks[1] - peaks[0] == pytest.approx(32 * linear, abs=1)


def test_activation_offload_copies_queue_with_compute_under_the_fivefold_stack():
    """fivefold's runtime issues activation offload's copies on the compute stream and each
    return when backward unpacks it (Stack.offload_copies_inline): each pass of a micro-batch
    pays one direction of the copies in full. Megatron-Core's side-stream copies cost the
    forward nothing, and its backward waits only for what its compute has not covered."""
    def run(stack: str):
        return simulate(spec_config(_spec(stack, offload_activations=8)))

    ours, megatron = run("fivefold"), run("megatron")
    a, m = ours.activation_offload, megatron.activation_offload
    assert a["forward_copy_s_per_micro_batch"] == pytest.approx(
        a["copy_s_each_way_per_micro_batch"], rel=1e-12)
    assert a["backward_wait_s_per_micro_batch"] == a["forward_copy_s_per_micro_batch"]
    assert m["forward_copy_s_per_micro_batch"] == 0.0
    assert m["backward_wait_s_per_micro_batch"] < m["copy_s_each_way_per_micro_batch"]
    plain = simulate(spec_config(_spec("fivefold")))
    passes = 2 * a["copy_s_each_way_per_micro_batch"] * ours.layout.micro_batches
    assert ours.step_time_s == pytest.approx(plain.step_time_s + passes, rel=0.02)
