"""The start-up line of a run: the model, and every degree of its layout.

It names each parallel degree (dp, tp, pp, cp, ep), the ZeRO stage and the micro-batches per
step, with the pipeline schedule and its virtual stages when pp > 1, so what trains is what
the user reads, and a note when that layout has a pipeline that cannot pipeline. Pure
functions of the config and the plan, testable without ranks.
"""

from __future__ import annotations

from fivefold.batch_shares import shares_text
from fivefold.config import Config
from fivefold.models.flops import param_count
from fivefold.parallel.plan import ParallelPlan


def layout_text(plan: ParallelPlan) -> str:
    """E.g. "dp 2, tp 1, pp 1, cp 2, ep 1, ZeRO 0, 4 micro-batches of 1"."""
    pipeline = f" ({plan.schedule}, vpp {plan.vpp})" if plan.pp > 1 else ""
    etp = f", etp {plan.etp}" if plan.etp > 1 else ""
    batches = (shares_text(plan) if plan.dp_batch_shares else f"{plan.micro_batches} micro-"
               f"batch{'es' if plan.micro_batches != 1 else ''} of {plan.micro_batch}")
    return (f"dp {plan.dp}, tp {plan.tp}, pp {plan.pp}{pipeline}, cp {plan.cp}, "
            f"ep {plan.ep}{etp}, ZeRO {plan.zero_stage}, {batches}")


def start_line(cfg: Config, plan: ParallelPlan, device_type: str,
               model_name: str | None = None) -> str:
    """`model_name`: the preset, or where `--init-from` loaded the weights from."""
    m = cfg.model
    return (f"model {model_name or m.preset}: {param_count(m) / 1e6:.2f}M parameters, {m.layers} layers; "
            f"{plan.gpus} rank(s) ({layout_text(plan)}) on {device_type}, {plan.precision}; "
            f"global batch {plan.global_batch} x {m.seq_len} tokens")


def pipeline_note(plan: ParallelPlan) -> str | None:
    """A warning when pp > 1 runs one micro-batch per step, not cut into token slices: the
    stages then take turns and each idles (pp - 1) / pp of the step (GPipe's bubble with
    m = 1, Huang et al., arXiv 1811.06965, Sec. 2.2). None otherwise."""
    if plan.pp == 1 or plan.micro_batches > 1 or plan.slices > 1:
        return None
    per_rank = plan.per_rank_batch
    fits = [d for d in range(per_rank - 1, 0, -1) if per_rank % d == 0 and per_rank // d >= plan.pp]
    fix = (f"set parallel.micro_batch = {fits[0]} ({per_rank // fits[0]} micro-batches)" if fits
           else f"raise parallel.global_batch to at least {plan.pp * plan.dp} and set "
                "parallel.micro_batch")
    return (f"warning: pp {plan.pp} with one micro-batch per step does not pipeline: each stage "
            f"idles {plan.pp - 1} of {plan.pp} turns; {fix}")


def balance_note(cfg: Config) -> str | None:
    """A warning when an MoE model trains with no load balancing at all: neither the
    balancing loss (Switch Transformer, arXiv 2101.03961 Sec. 2.2; GShard) nor DeepSeek-V3's
    auxiliary-loss-free bias (arXiv 2412.19437 Sec. 2.1.2). The router then tends to send
    most tokens to a few experts (the tiny preset reaches the top_k / experts bound within 20
    steps). The defaults stay off so that an imported or published configuration trains as
    stated; the warning says what to set. None otherwise."""
    moe = cfg.model.moe
    if moe is None or moe.aux_loss_weight or moe.bias_update_rate:
        return None
    return ("warning: this MoE model trains with no load balancing, so its experts tend to "
            "collapse onto a few; set model.moe.aux_loss_weight = 0.01 (Switch/GShard) or "
            "model.moe.bias_update_rate = 0.001 (DeepSeek-V3)")
