"""The start-up line of a run: the model, and every degree of its layout.

It names each parallel degree (dp, tp, pp, cp, ep), the ZeRO stage and the micro-batches per
step, with the pipeline schedule and its virtual stages when pp > 1, so what trains is what
the user reads. A pure function of the config and the plan, testable without ranks.
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.models.flops import param_count
from fivefold.parallel.plan import ParallelPlan


def layout_text(plan: ParallelPlan) -> str:
    """E.g. "dp 2, tp 1, pp 1, cp 2, ep 1, ZeRO 0, 4 micro-batches of 1"."""
    pipeline = f" ({plan.schedule}, vpp {plan.vpp})" if plan.pp > 1 else ""
    return (f"dp {plan.dp}, tp {plan.tp}, pp {plan.pp}{pipeline}, cp {plan.cp}, ep {plan.ep}, "
            f"ZeRO {plan.zero_stage}, {plan.micro_batches} micro-batch"
            f"{'es' if plan.micro_batches != 1 else ''} of {plan.micro_batch}")


def start_line(cfg: Config, plan: ParallelPlan, device_type: str,
               model_name: str | None = None) -> str:
    """`model_name`: the preset, or where `--init-from` loaded the weights from."""
    m = cfg.model
    return (f"model {model_name or m.preset}: {param_count(m) / 1e6:.2f}M parameters, {m.layers} layers; "
            f"{plan.gpus} rank(s) ({layout_text(plan)}) on {device_type}, {plan.precision}; "
            f"global batch {plan.global_batch} x {m.seq_len} tokens")
