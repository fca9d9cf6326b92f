"""The experts' rank grid and its checks: etp x ep x expert-data over a stage's ranks.

MoE Parallel Folding (Megatron-Core, arXiv 2504.14960, Sec. 3): the attention part of a
model keeps its tp x cp x dp grid, while the routed experts get a grid of their own over the
same ranks of a pipeline stage, outermost first

    edp x ep x etp = dp x cp x tp,

etp innermost (its ranks neighbours, like tp's). An expert's MLP is split over the etp ranks
as Megatron splits a dense MLP (w1 and w3 by output columns, w2 by input rows,
fivefold.parallel.expert_tensor), the experts are spread over the ep ranks, and each expert
is data-parallel over the edp ranks. `etp = 1` with `tp > 1` folds the tp ranks into ep or
expert-data. The MoE layer on a rank runs on tokens no other rank of the stage holds (with
tp > 1 the layer takes the rank's 1/tp share of its tp group's tokens,
fivefold.parallel.moe_tokens), so the grid can be cut independently of tp.

Torch-free: fivefold.validate, the plan and the planner read it.
"""

from __future__ import annotations

from fivefold.config import Config, ConfigError
from fivefold.models.validate_model import divisors


STAGE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")  # a pp stage's mesh axes, in order


def stage_ranks(dp: int, cp: int, tp: int) -> int:
    """The ranks of one pipeline stage, which both grids cover."""
    return dp * cp * tp


def expert_data_degree(dp: int, cp: int, tp: int, ep: int, etp: int) -> int:
    """Copies of each expert shard: the stage's ranks that ep and etp do not split."""
    return stage_ranks(dp, cp, tp) // (ep * etp)


def validate_expert_grid(cfg: Config, dp: int) -> None:
    """ConfigError naming the key unless `parallel.ep` and `parallel.etp` cut the stage's
    ranks and the experts evenly, and the MoE layer's tokens split over tp."""
    p, moe = cfg.parallel, cfg.model.moe
    if p.etp > 1 and moe is None:
        raise ConfigError("parallel.etp", "expert tensor parallelism needs model.moe (a dense "
                                          "model has no experts to split); set it to 1")
    stage = stage_ranks(dp, p.cp, p.tp)
    if stage % p.etp:
        raise ConfigError("parallel.etp", f"{p.etp} does not divide the dp x cp x tp = {stage} "
                                          "ranks of a stage the experts' grid folds onto; "
                                          f"choose one of {divisors(stage)}")
    if (stage // p.etp) % p.ep:
        raise ConfigError("parallel.ep", f"{p.ep} does not divide the dp x cp x tp / etp = "
                                         f"{stage // p.etp} ranks it folds onto (each expert is "
                                         "data-parallel over the rest); choose one of "
                                         f"{divisors(stage // p.etp)}")
    if moe is None:
        return
    group = (p.zero_group or dp) * p.cp * p.tp  # the stage's ranks of one zero group
    if p.zero_stage >= 1 and group % (p.ep * p.etp):
        raise ConfigError("parallel.zero_group", f"hierarchical sharding shards the experts "
                                                 f"inside each zero group, whose zero_group x "
                                                 f"cp x tp = {group} ranks must hold whole "
                                                 f"ep x etp = {p.ep * p.etp} expert grids; "
                                                 "choose a zero_group they divide, or drop it")
    ffn = moe.expert_ffn_hidden or cfg.model.ffn_hidden
    if ffn % p.etp:
        raise ConfigError("parallel.etp", f"{p.etp} does not divide the experts' width "
                                          f"{ffn} (model.moe.expert_ffn_hidden): each etp rank "
                                          f"holds whole columns; choose one of {divisors(ffn)}")
    local = cfg.model.seq_len // p.cp
    if p.tp > 1 and local % p.tp:
        raise ConfigError("parallel.tp", f"an MoE layer runs on its tp rank's share of the "
                                         f"{local} positions a rank holds (seq_len / cp); "
                                         f"tp = {p.tp} must divide them")
