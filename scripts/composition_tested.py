"""The configurations each parity test trains, for scripts/composition_docs.py's matrix:
`TESTED` maps a test (file::function) to the (world size, `--set` overrides on top of the
docs script's tiny model) it runs, representative layouts of each parity test. Kept apart
from the renderer so that each file has one job; tests/test_compositions.py checks that
every configuration is accepted and every named test exists.
"""

from __future__ import annotations

PP2, TP2, SP = "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"
FP16 = "parallel.precision=fp16"
V2 = "parallel.vpp=2"  # the V schedules' two chunks per rank
FULL, SELECTIVE = "parallel.recompute=full", "parallel.recompute=selective"
TIED = "model.tied_embeddings=true"


def z(stage: int) -> str:
    return f"parallel.zero_stage={stage}"


MOE = ["model.moe.experts=4", "model.moe.expert_ffn_hidden=32"]


def EP(n: int) -> str:  # noqa: N802 (reads like the other layout constants)
    return f"parallel.ep={n}"


def micro(n: int) -> str:
    return f"parallel.micro_batch={n}"


def sched(name: str) -> str:
    return f"parallel.schedule={name}"


CPU_OFFLOAD = "parallel.offload=cpu"
NVME_OFFLOAD = ["parallel.offload=nvme", "parallel.offload_path=/tmp"]

# test -> the (world size, overrides) it trains; representative layouts of each parity test
FP8 = "parallel.precision=fp8"
GALORE, LOMO, SGD = "train.optimizer=galore", "train.optimizer=lomo", "train.optimizer=sgd"
MUON = "train.optimizer=muon"
ZPP = ["parallel.qwz=true", "parallel.hpz=true", "parallel.qgz=true"]  # ZeRO++'s three
TESTED: dict[str, list[tuple[int, list[str]]]] = {
    "tests/test_data_parallel.py::test_parity_with_one_process": [
        (2, [z(0), micro(1)]), (2, [z(1), micro(1)]), (2, [z(2), micro(1)]),
        (2, [z(3), micro(1)]), (4, [z(1), "parallel.zero_group=2"]),
        (4, [z(2), "parallel.zero_group=2", micro(1)]), (4, [z(3), "parallel.zero_group=2"]),
        (4, [z(3), "parallel.hpz=true", "cluster.gpus_per_node=2", micro(1)])],
    "tests/test_data_parallel.py::test_muon_matches_one_process": [
        (2, ["train.optimizer=muon", micro(1)]), (4, ["train.optimizer=muon", PP2])],
    "tests/test_muon_sharded.py::test_zero3_sp_and_expert_parallel_match_one_process": [
        (2, [MUON, z(3)]), (2, [MUON, TP2, SP]),
        (2, [MUON, *MOE, "parallel.ep=2", z(1), micro(2)])],
    "tests/test_muon_sharded.py::test_every_layout_on_two_ranks_matches_one_process": [
        (2, [MUON, z(1)]), (2, [MUON, z(2), micro(2)]), (2, [MUON, TP2]),
        (2, [MUON, PP2, z(1), micro(1)]), (2, [MUON, *MOE, "parallel.ep=2", micro(2)]),
        (2, [MUON, *MOE, "parallel.ep=2", z(3), micro(2)])],
    "tests/test_muon_sharded.py::test_four_ranks_match_one_process": [
        (4, [MUON, z(1), TP2, SP]), (4, [MUON, z(3), "parallel.zero_group=2"]),
        (4, [MUON, PP2, TP2, z(2), micro(2)]),
        (4, [MUON, *MOE, "parallel.ep=2", z(2), micro(2)]),
        (4, [MUON, *MOE, "parallel.ep=2", TP2, micro(2)])],
    "tests/test_data_parallel.py::test_recompute_matches_one_process": [
        (world, [f"parallel.recompute={mode}", *sets]) for mode in ("full", "selective")
        for world, sets in [(2, [micro(1)]), (2, [z(2)]), (2, [z(3), micro(1)]),
                            (2, [PP2, micro(1)]), (2, [PP2, sched("gpipe"), micro(2)]),
                            (2, [PP2, sched("interleaved"), "parallel.vpp=2", micro(2)]),
                            (2, [TP2]), (2, [TP2, SP, micro(1)]), (4, [PP2, z(3), micro(1)])]],
    "tests/test_train.py::test_recompute_changes_nothing_but_memory": [
        (1, ["parallel.recompute=selective", micro(2)])],
    "tests/test_zero_ledger.py::test_communication_bytes_match_the_analytic_volume": [
        (4, [z(0), "parallel.precision=bf16"]), (4, [z(1), "parallel.precision=bf16"]),
        (4, [z(3), "parallel.precision=bf16"])],
    "tests/test_zero_ledger.py::test_zeropp_validation_loss_within_2_percent": [
        (4, [z(3), "cluster.gpus_per_node=2", "parallel.qwz=true", "parallel.hpz=true",
             "parallel.qgz=true"])],
    "tests/test_tensor_parallel.py::test_parity_with_one_process": [
        (2, [TP2]), (2, [TP2, SP, micro(2)]), (4, ["parallel.tp=4", "model.kv_heads=4", SP]),
        (4, [TP2, z(1)]), (4, [TP2, SP, z(3)]), (4, [TP2, SP, z(1), micro(2)])],
    "tests/test_pipeline_trainer.py::test_trainer_matches_one_process": [
        (2, [PP2, sched("1f1b"), micro(1)]),
        (2, [PP2, sched("interleaved"), "parallel.vpp=2", micro(2)]),
        (2, [PP2, sched("zb"), micro(2)]), (4, [PP2, sched("1f1b"), micro(1), z(1)]),
        (4, [PP2, sched("zb"), micro(2), TP2]), (4, [PP2, sched("gpipe"), micro(2), TP2, SP]),
        (4, [PP2, sched("1f1b"), micro(1), z(3)]), (4, [PP2, sched("gpipe"), micro(2), z(3)]),
        (4, [PP2, sched("interleaved"), "parallel.vpp=2", micro(2), z(3)]),
        (4, [PP2, sched("zb"), micro(1), z(3)]),
        (8, [PP2, sched("1f1b"), micro(1), TP2, SP, z(1)]),
        (8, [PP2, sched("1f1b"), micro(1), TP2, SP, z(3)])],
    "tests/test_v_schedule_parity.py::test_v_schedules_match_one_process_and_the_ledger": [
        (2, [PP2, V2, sched("zbv"), micro(1)]), (2, [PP2, V2, sched("dualpipev"), micro(1)]),
        (2, [*MOE, PP2, V2, sched("zbv"), micro(2)]),
        (4, ["parallel.pp=4", "model.layers=8", V2, sched("zbv"), micro(1)]),
        (4, [*MOE, EP(2), PP2, V2, sched("zbv"), z(1), micro(1)]),
        (4, [*MOE, EP(2), PP2, V2, sched("dualpipev"), z(0), micro(1)])],
    "tests/test_zero_bubble_layouts.py::test_zero_bubble_layouts_match_one_process_and_the_ledger": [
        (4, [PP2, TP2, SP, sched("zb"), micro(2), FULL]),
        (4, [PP2, TP2, SP, sched("zb"), micro(2)]),
        (4, [PP2, TP2, SP, V2, sched("zbv"), micro(2), TIED, FULL]),
        (4, [PP2, TP2, SP, V2, sched("dualpipev"), micro(2), SELECTIVE]),
        (4, [PP2, TP2, V2, sched("zbv"), micro(2), TIED, SELECTIVE]),
        (4, [PP2, TP2, V2, sched("dualpipev"), micro(2), FULL]),
        (4, [PP2, TP2, sched("zb"), micro(2), SELECTIVE]),
        (4, [PP2, V2, sched("zbv"), micro(1), TIED, z(2)]),
        (4, [PP2, V2, sched("dualpipev"), micro(1), z(3)]),
        (4, [*MOE, PP2, sched("zb"), micro(2), z(2)]),
        (4, [*MOE, PP2, sched("zb"), micro(1), z(3)])],
    "tests/test_pipeline_trainer.py::test_pipedream_2bw_runs_in_the_trainer": [
        (2, [PP2, sched("pipedream-2bw"), micro(2)])],
    "tests/test_pipeline_trainer.py::test_pipedream_2bw_resumes_exactly": [
        (2, [PP2, sched("pipedream-2bw"), micro(2), "parallel.global_batch=4",
             "train.optimizer=muon"])],
    "tests/test_pipeline_hpz.py::test_pp2_dp2_zero3_hpz_matches_one_process": [
        (4, [PP2, z(3), "parallel.hpz=true", "cluster.gpus_per_node=2", micro(1),
             sched("interleaved"), V2])],
    "tests/test_pipeline_hpz.py::test_pp2_dp2_zero3_hpz_other_schedules_match_one_process": [
        (4, [PP2, z(3), "parallel.hpz=true", "cluster.gpus_per_node=2", micro(1), *sets])
        for sets in ([sched("1f1b")], [sched("zb")], [sched("gpipe")],
                     [sched("1f1b"), "parallel.recompute=full"])],
    "tests/test_pipeline_parity.py::test_parity_with_one_process": [
        (2, ["model.layers=7", PP2, sched("terapipe"), micro(4)])],
    "tests/test_context_parallel.py::test_parity_with_one_process": [
        (2, ["parallel.cp=2", "parallel.cp_mode=ring", micro(2)]),
        (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
        (4, ["parallel.cp=2", z(3)]), (4, ["parallel.cp=2", z(1)]),
        (4, ["parallel.cp=2", z(2), micro(2)]), (4, ["parallel.cp=2", TP2, SP]),
        (4, ["parallel.cp=2", PP2, micro(2)]),
        (4, ["parallel.cp=2", PP2, sched("gpipe"), z(1), micro(2)]),
        (8, ["parallel.cp=8", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2", z(3)])],
    "tests/test_train.py::test_resume_is_bit_identical": [
        (1, [micro(2), "train.optimizer=muon"]), (1, [micro(2), "train.optimizer=galore"])],
    "tests/test_train.py::test_lomo_is_sgd_fused_into_backward": [
        (1, ["train.optimizer=lomo", "train.grad_clip=0"]),
        (1, ["train.optimizer=sgd", "train.grad_clip=0"])],
    "tests/test_galore_dp.py::test_data_parallel_galore_and_lomo_match_one_process": [
        (2, [GALORE, z(0)]), (2, [GALORE, z(1)]), (2, [GALORE, z(2), micro(1)]),
        (2, [GALORE, z(2), *MOE]),
        (2, [GALORE, "train.galore_reduce=projected", "train.grad_clip=0", z(1)]),
        (4, [GALORE, z(1), micro(1)]), (4, [GALORE, z(2)]), (2, [LOMO]),
        (2, [LOMO, "train.grad_clip=0"]), (4, [LOMO])],
    "tests/test_galore_layouts.py::test_galore_tp_pp_zero3_match_one_process": [
        (2, [GALORE, TP2]), (2, [GALORE, PP2, sched("1f1b")]), (2, [GALORE, z(3), micro(1)]),
        (2, [GALORE, TP2, SP]), (2, [GALORE, TP2, SP, *MOE]),
        (4, [GALORE, TP2, PP2, sched("1f1b")]),
        (4, [GALORE, TP2, z(3), micro(1)])],
    "tests/test_galore_fp8.py::test_galore_fp8_layouts_match_one_process": [
        (2, [GALORE, FP8, "parallel.dp=2", micro(4)]), (2, [GALORE, FP8, TP2]),
        (2, [GALORE, FP8, PP2, sched("1f1b")]), (2, [GALORE, FP8, z(3), micro(1)])],
    "tests/test_sgd_layouts.py::test_sgd_on_every_layout_matches_one_process_and_the_ledger": [
        (2, [SGD, z(0)]), (2, [SGD, z(1), micro(1)]), (2, [SGD, z(2)]),
        (2, [SGD, z(3), micro(1)]), (2, [SGD, TP2, SP]), (2, [SGD, PP2, micro(1)]),
        (2, [SGD, "parallel.cp=2"])],
    "tests/test_lomo_zero.py::test_lomo_with_zero_matches_one_process_and_the_ledger": [
        (2, [LOMO, z(1)]), (2, [LOMO, z(2), "train.grad_clip=0"])],
    "tests/test_lomo_fp16.py::test_fp16_lomo_is_fp16_sgd_fused_into_backward": [
        (1, [LOMO, FP16]), (1, [SGD, FP16, "train.beta1=0"])],
    "tests/test_lomo_fp16.py::test_fp16_lomo_on_2_ranks_matches_one_process": [
        (2, [LOMO, FP16]), (2, [LOMO, FP16, z(1)]), (2, [LOMO, FP16, z(2)])],
    "tests/test_reliability.py::test_lomo_skips_before_its_applying_pass": [
        (1, ["train.optimizer=lomo", "train.on_nonfinite=skip"])],
    "tests/test_reliability.py::test_nonfinite_guard_agrees_across_ranks": [
        (2, [z(1), micro(2), "train.on_nonfinite=skip"]),
        (2, [PP2, sched("1f1b"), micro(2), "train.on_nonfinite=skip"]),
        (2, [GALORE, z(2), micro(2), "train.on_nonfinite=skip"])],
    "tests/test_context_recompute.py::test_ring_recompute_matches_one_process_and_the_ledger": [
        (2, ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.recompute=full"])],
    "tests/test_context_recompute.py::"
    "test_ulysses_hybrid_sp_and_pipeline_recompute_match_one_process_and_the_ledger": [
        (4, ["parallel.cp=4", "parallel.cp_mode=ulysses", "parallel.recompute=selective"]),
        (4, ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2",
             "parallel.recompute=full"]),
        (4, ["parallel.cp=2", TP2, SP, "parallel.recompute=selective"]),
        (4, ["parallel.cp=2", "parallel.cp_mode=ulysses", PP2, micro(2),
             "parallel.recompute=full"])],
    "tests/test_fp16_layouts.py::test_fp16_layouts_match_one_process": [
        (2, [FP16, micro(2)]), (2, [FP16, z(1)]), (2, [FP16, z(2)]),
        (2, [FP16, z(3), micro(2)]), (2, [FP16, TP2]), (2, [FP16, "parallel.cp=2"]),
        (2, [FP16, PP2, micro(2)])],
    "tests/test_fp16_moe.py::test_fp16_router_gradient_carries_the_scaled_aux_losses": [
        (1, [FP16, *MOE, micro(2)])],
    "tests/test_fp16_moe.py::test_fp16_moe_layouts_match_one_process": [
        (2, [FP16, *MOE, EP(2), micro(2)]), (2, [FP16, *MOE, TP2, micro(2)])],
    "tests/test_fp16_layouts.py::test_fp16_offload_matches_one_process": [
        (1, [FP16, z(1), "parallel.offload=cpu"])],
    "tests/test_restart.py::test_sigkilled_rank_restarts_and_ends_bit_identical": [
        (2, [z(0)])],
    "tests/test_expert_parallel.py::test_ep4_and_ep2_with_zero_stages_match_one_process": [
        (4, [*MOE, EP(4), micro(2)]), (4, [*MOE, EP(2), z(1), micro(2)]),
        (4, [*MOE, EP(2), z(2), micro(2)]), (4, [*MOE, EP(2), z(3), micro(2)])],
    "tests/test_expert_parallel.py::test_ep2_dropless_and_capacity_match_one_process_and_the_ledger": [
        (2, [*MOE, EP(2), micro(2)])],
    "tests/test_expert_parallel.py::test_ep2_with_pp2_and_with_tp2_match_one_process": [
        (4, [*MOE, EP(2), PP2, micro(2)]), (4, [*MOE, EP(2), TP2, micro(2)])],
    "tests/test_expert_tensor.py::test_tp2_folds_into_ep_and_etp_on_2_ranks": [
        (2, [*MOE, TP2, EP(2), micro(2)]), (2, [*MOE, TP2, SP, "parallel.etp=2", micro(2)])],
    "tests/test_expert_tensor.py::test_etp2_by_ep2_on_4_ranks_halves_expert_memory_and_flops": [
        (4, [*MOE, TP2, z(1), "parallel.etp=2", EP(2), micro(2)]),
        (4, [*MOE, "parallel.etp=2", EP(2), micro(2)])],
    "tests/test_expert_tensor.py::test_pp2_by_ep2_by_etp2_on_8_ranks": [
        (8, [*MOE, PP2, TP2, "parallel.etp=2", EP(2), micro(2)])],
    "tests/test_zeropp_expert.py::test_zeropp_with_ep2_matches_one_process_and_the_ledger": [
        (4, [*MOE, EP(2), z(3), micro(2), "parallel.hpz=true", "cluster.gpus_per_node=4"]),
        (4, [*MOE, EP(2), z(3), micro(2), "parallel.qwz=true", "parallel.hpz=true",
             "parallel.qgz=true", "cluster.gpus_per_node=2"])],
    "tests/test_zeropp_groups.py::test_hierarchical_and_zeropp_groups_on_4_ranks": [
        (4, [*MOE, EP(2), z(3), micro(2), "parallel.zero_group=2", "parallel.hpz=true",
             "cluster.gpus_per_node=2"]),
        (4, [*MOE, "parallel.cp=2", "parallel.etp=2", z(3), micro(2), *ZPP,
             "cluster.gpus_per_node=2"])],
    "tests/test_zeropp_groups.py::test_hierarchical_and_zeropp_groups_on_8_ranks": [
        (8, [*MOE, EP(2), z(3), micro(1), "parallel.zero_group=4", *ZPP,
             "cluster.gpus_per_node=2"]),
        (8, [*MOE, "parallel.etp=2", z(2), micro(1), "parallel.zero_group=4",
             "parallel.qgz=true", "cluster.gpus_per_node=4"]),
        (8, [*MOE, EP(2), TP2, z(1), micro(2), "parallel.zero_group=2"]),
        (8, [*MOE, "parallel.cp=2", z(3), micro(2), "parallel.zero_group=2", *ZPP,
             "cluster.gpus_per_node=2"])],
    "tests/test_moe.py::test_moe_run_logs_load_statistics": [(1, [*MOE])],
    "tests/test_moe_token_split.py::"
    "test_moe_on_sequence_and_context_shards_matches_one_process": [
        (2, [*MOE, TP2, SP, micro(2)]), (2, [*MOE, "parallel.cp=2", micro(2)]),
        (2, [*MOE, "parallel.cp=2", "parallel.cp_mode=ulysses", micro(2)]),
        (2, [*MOE, "parallel.cp=2", EP(2), micro(2)])],
    "tests/test_moe_token_split.py::"
    "test_moe_with_sequence_parallel_and_ep_or_cp_on_4_ranks_matches_one_process": [
        (4, [*MOE, TP2, SP, EP(2), micro(2)]), (4, [*MOE, "parallel.cp=2", TP2, SP, micro(2)]),
        (4, [*MOE, "parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2",
             micro(2)])],
    "tests/test_fp8.py::test_fp8_layouts_match_the_one_process_fp8_run": [
        (2, [FP8, micro(4)]), (2, [FP8, z(3), micro(2)]), (2, [FP8, PP2, micro(2)]),
        (2, [FP8, TP2]), (2, [FP8, TP2, "parallel.fp8_recipe=rowwise"])],
    "tests/test_fp8_split_tokens.py::test_fp8_sp_and_cp_match_the_one_process_fp8_run": [
        (2, [FP8, TP2, SP]), (2, [FP8, "parallel.cp=2"]),
        (2, [FP8, "parallel.cp=2", "parallel.fp8_recipe=rowwise"]),
        (2, [FP8, "parallel.cp=2", "parallel.recompute=selective"]),
        (2, [FP8, "parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.fp8_recipe=rowwise"])],
    "tests/test_fp8_moe.py::test_fp8_moe_layouts_match_the_one_process_fp8_run": [
        (2, [FP8, *MOE, EP(2), micro(2)]), (2, [FP8, *MOE, TP2, micro(2)]),
        (2, [FP8, *MOE, TP2, SP, micro(2)]), (2, [FP8, *MOE, "parallel.cp=2", micro(2)]),
        (2, [FP8, *MOE, "parallel.cp=2", "parallel.fp8_recipe=rowwise", micro(2)])],
    "tests/test_offload.py::test_offload_on_2_ranks_matches_in_memory_and_one_process": [
        *((2, [z(stage), CPU_OFFLOAD]) for stage in (0, 1, 3)),
        (2, [z(2), CPU_OFFLOAD, "parallel.offload_fraction=0.5"]),
        (2, [z(1), *NVME_OFFLOAD]), (2, [z(2), *NVME_OFFLOAD]),
        (2, [z(3), *NVME_OFFLOAD, "parallel.offload_fraction=0.5"]), (2, [TP2, CPU_OFFLOAD]),
        (2, [PP2, micro(2), z(3), *NVME_OFFLOAD])],
    "tests/test_offload.py::test_offload_on_4_ranks_matches_in_memory_and_one_process": [
        (4, [z(0), *NVME_OFFLOAD]), (4, [z(1), CPU_OFFLOAD]), (4, [z(2), *NVME_OFFLOAD]),
        (4, [z(3), CPU_OFFLOAD, "parallel.offload_fraction=0.5"]), (4, [z(3), *NVME_OFFLOAD])],
    "tests/test_offload.py::test_sigkill_mid_nvme_step_leaves_a_consistent_state_and_resumes_exactly": [
        (1, [*NVME_OFFLOAD])],
    "tests/test_batch_shares.py::test_batch_shares_match_one_process": [
        (3, ["parallel.dp_batch_shares=[2, 1, 1]", z(0), micro(2)]),
        (3, ["parallel.dp_batch_shares=[2, 1, 1]", z(2)])],
    "tests/test_batch_shares.py::test_more_batch_shares_match_one_process": [
        (3, ["parallel.dp_batch_shares=[1, 2, 1]", z(3)]),
        (3, ["parallel.dp_batch_shares=[2, 1, 1]", z(1), micro(1)])],
    "tests/test_batch_shares_pipeline.py::"
    "test_pipeline_with_batch_shares_matches_one_process_and_the_ledger": [
        (4, [PP2, sched("1f1b"), micro(1), "parallel.dp_batch_shares=[3, 1]", z(0)])],
    "tests/test_batch_shares_pipeline.py::"
    "test_pipeline_with_batch_shares_under_zero1_matches_one_process": [
        (4, [PP2, sched("1f1b"), micro(1), "parallel.dp_batch_shares=[1, 3]", z(1)])],
    "tests/test_offload_sgd.py::test_one_rank_sgd_offload_is_exact_and_records_its_bytes": [
        (1, [SGD, z(0), CPU_OFFLOAD]), (1, [SGD, z(1), *NVME_OFFLOAD]),
        (1, [SGD, z(2), CPU_OFFLOAD, "parallel.offload_fraction=0.5"]),
        (1, [SGD, z(3), *NVME_OFFLOAD, "parallel.offload_fraction=0.5"])],
    "tests/test_offload_sgd.py::test_sgd_offload_on_2_ranks_zero1_matches_in_memory_and_one_process": [
        (2, [SGD, z(1), CPU_OFFLOAD]), (2, [SGD, z(1), *NVME_OFFLOAD])],
}

ACTS = "parallel.offload_activations=1"
TESTED.update({
    "tests/test_activation_offload.py::test_one_process_is_bit_identical_and_moves_block_0_to_host":
        [(1, [ACTS, *s]) for s in ([], [micro(2), SGD], [MUON], [CPU_OFFLOAD],
                                   ["parallel.precision=bf16"])],
    "tests/test_activation_offload.py::"
    "test_two_ranks_are_bit_identical_and_each_rank_moves_its_share":
        [(2, [ACTS, TP2, SP]), (2, [ACTS, z(2), micro(2)])],
    "tests/test_activation_offload.py::test_pp2_is_bit_identical":
        [(2, [ACTS, PP2, sched(s), micro(2)]) for s in ("1f1b", "gpipe")],
    "tests/test_activation_offload_layouts.py::test_one_process_layouts_are_bit_identical":
        [(1, [ACTS, *s]) for s in ([*MOE, micro(2)], [FP16], [FP8], [LOMO], [GALORE, micro(2)],
                                   [z(1), *NVME_OFFLOAD])],
    "tests/test_activation_offload_layouts.py::test_two_rank_layouts_are_bit_identical":
        [(2, [ACTS, *s]) for s in ([*MOE, EP(2), micro(2)], [z(3), micro(2)],
                                   [z(3), *ZPP, "cluster.gpus_per_node=1"],
                                   ["parallel.cp=2", "parallel.cp_mode=ring"],
                                   ["parallel.cp=2", "parallel.cp_mode=ulysses"],
                                   [PP2, sched("zb"), micro(2)])],
    "tests/test_activation_offload_layouts.py::test_pipedream_2bw_and_compile_are_bit_identical":
        [(2, [ACTS, PP2, sched("pipedream-2bw"), micro(2)])],
    "tests/test_activation_offload_vpp.py::"
    "test_virtual_stages_are_bit_identical_and_move_each_chunks_first_block":
        [(2, [ACTS, PP2, V2, sched(s), micro(2)]) for s in ("interleaved", "zbv", "dualpipev")]
        + [(2, [ACTS, PP2, V2, sched("interleaved"), micro(2), "model.layers=8"])],
})
