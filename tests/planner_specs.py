"""What the planner tests share: a run spec on 64 H100s with sections overridden, and the
fields run_spec.md lists for `simulate --json` and `plan --json`."""

from __future__ import annotations

# run_spec.md, "Output of --json": exactly these fields, and these sub-tables
# the CLI's --json adds the cross-validated band (fivefold.planner.bands) to run_spec.md's fields
BAND_FIELDS = {"step_time_band_s", "step_time_band_rows"}
OUTPUT_FIELDS = {"step_time_s", "tokens_per_s", "model_tflops_per_gpu",
                 "hardware_tflops_per_gpu", "mfu", "hfu", "memory_per_gpu_bytes", "fits",
                 "breakdown_s", "parallel"}
CONTEXT_FIELDS = {"stack", "profile"}  # what simulate/plan --json add to each estimate
# what plan --json adds: fivefold.planner.objective.scored_json
OBJECTIVE_FIELDS = {"placement", "cost", "goodput", "productive_tokens_per_s", "train"}
MEMORY_FIELDS = {"params", "grads", "optimizer", "activations", "other", "total"}
BREAKDOWN_FIELDS = {"compute", "exposed_comm", "bubble", "optimizer"}


def spec(**sections) -> dict:
    base = {"model": {"preset": "8B"}, "cluster": {"gpu": "H100-SXM", "gpus": 64},
            "parallel": {"global_batch": 128}}
    for name, table in sections.items():
        base[name] = {**base.get(name, {}), **table}
    return base
