"""What was chosen by reading published rows: each stack switch, release boundary or profile
constant introduced or placed after the rows of calibration_runs.json it changes were read
and their misses studied, with those rows. Cross-validation refits only the constants of
fivefold.planner.fitted and cannot see these choices, so `fivefold plan validate` prints
them next to its figures (the brief's `fitted_to`).
"""

from __future__ import annotations

_MEGATRON_ROWS = "the megatron rows (megatron21, nemo, bridge, mcore sources)"
_TORCHTITAN_ROWS = "the torchtitan rows (Dec 2024 tables, H200 community runs)"
_DEEPSPEED_ROWS = "arXiv 2104.04473 Table 2's six ZeRO-3 rows (megatron21)"
# Each stack switch, release boundary or profile constant that was introduced or placed after
# reading published rows: (stack or "hardware", name) -> the rows it was chosen on. Its
# citation is in fivefold.planner.stack's docstring (hardware: fivefold.hardware).
FITTED_TO: dict[tuple[str, str], str] = {
    **{("megatron", k): _MEGATRON_ROWS for k in (
        "fused_eltwise", "flash2_attention", "loss_logit_bytes", "loss_saves_fp32",
        "tp_overlap", "tp_overlap_since", "dp_overlap", "fp8_fused_casts", "fp8_saved_inputs",
        "expert_group_stride_1", "selective_modules", "fp8_param_gather_since",
        "fp8_sp_gather")},
    ("megatron", "fa3_since hopper 2024-07"): "placed so that the nemo 24.03 long-context "
                                              "rows run at the FlashAttention-2-class rate",
    ("megatron", "fa3_since blackwell 2025-09"): "placed between the nemo 25.02-25.07 "
                                                 "Blackwell rows and the bridge 25.11 and "
                                                 "mcore ModelZoo rows (it prices nothing "
                                                 "while Blackwell profiles have one "
                                                 "attention generation)",
    ("megatron", "tp_overlap needs sequence parallelism"):
        "megascale_t2_mcore_* (tp > 1 without sequence parallelism on a release with "
        "tp_overlap; the rule was looked up after reading their misses)",
    ("megatron", "tp_async_grad_since 2021-09"):
        "the korthikanti rows (behaviour and commit looked up after reading their misses; "
        "in-sample it fits the 140 rows worse, 10.20% -> 10.40%)",
    ("megatron", "tp_overlap_chunks"): "one launch per chunk, chosen over one per GEMM "
                                       "because it fitted " + _MEGATRON_ROWS + " better",
    **{("torchtitan", k): _TORCHTITAN_ROWS for k in (
        "flash2_attention", "loss_logit_bytes", "cp_kv_exchange", "sdpa_repeats_kv",
        "zero3_pp_unsharded", "fp8_sp_gather", "fp8_shard_casts")},
    **{("deepspeed", k): _DEEPSPEED_ROWS for k in (
        "zero3_recompute_gathers", "zero3_live_params", "zero3_overlap",
        "zero3_persist_numel", "zero3_list_gather")},
}


def fitted_to_lines() -> list[str]:
    """What `fivefold plan validate` prints about the choices made by reading rows."""
    by_rows: dict[str, list[str]] = {}
    for (owner, name), rows in FITTED_TO.items():
        by_rows.setdefault(rows, []).append(f"{owner}.{name}")
    lines = [f"chosen by reading published rows (fitted_to, fivefold.planner.fitted_to."
             f"FITTED_TO): {len(FITTED_TO)} switches, placements and profile constants, "
             "outside the fitted constants and unseen by cross-validation:"]
    for rows, names in by_rows.items():
        lines.append(f"  {rows}: {', '.join(names)}")
    return lines
