"""The seconds an MoE layer spends communicating on one rank and micro-batch, per direction.

Torch-free; fivefold.planner.block_cost lists them as a block's "ep" and "tp" ops beside its
tensor-, context- and data-parallel collectives. Two layouts of the layer, by the stack
(fivefold.planner.stack `experts_follow_tp`):

  external stack  the MLP a tp region like a dense one (its all-reduce, or sequence
                  parallelism's two halves); ep's dispatch and combine all-to-alls of the
                  rank's routed rows (its 1/tp of them where sp and the stack's folding hand
                  each tp rank its sequence shard), and the int64 count exchange forward.
  experts' grid   fivefold's runtime (fivefold.expert_grid): no tp region; without sequence
                  parallelism one all-gather of the layer's output over tp forward and of
                  its input gradient backward (fivefold.parallel.moe_tokens); the ep
                  all-to-alls of the rank's 1/tp of the rows over ep groups etp apart; with
                  etp > 1 the etp group's rows gathered and their partial outputs scattered
                  back (etp x the rows, fivefold.parallel.expert_tensor) and the rows per
                  expert all-gathered forward.

Rows are at the busiest ep rank's load (`Shard.expert_load`).
"""

from __future__ import annotations

from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.comm import Group
from fivefold.planner.stack import Stack


def expert_groups(stack: Stack, lay: ParallelPlan, shard_group: Group, gpn: int
                  ) -> tuple[int | None, Group, Group, Group]:
    """(etp as planner.params.block_params takes it: the layout's on the experts' grid, None
    under an external stack; the etp, ep and edp groups). The grid's are etp neighbours, ep
    groups of them etp apart, and the edp ranks ep x etp apart (ZeRO: the part of them that
    shards the experts, ParallelPlan.expert_shard_axis); an external stack's ep group
    is ep data ranks tp apart, or adjacent under its folding (expert_group_stride_1), and
    its edp the ZeRO group's ranks ep groups apart (Megatron-Core's expert data
    parallelism)."""
    if not stack.experts_follow_tp:
        return (lay.etp, Group.strided(lay.etp, 1, gpn), Group.strided(lay.ep, lay.etp, gpn),
                Group.strided(lay.expert_shard_axis[1] if lay.zero_stage >= 1
                              else lay.expert_data_parallel, lay.ep * lay.etp, gpn))
    ep_stride = 1 if stack.expert_group_stride_1 else lay.tp
    edp = (Group.strided(max(1, shard_group.size // lay.ep), lay.ep * ep_stride, gpn)
           if lay.ep > 1 else shard_group)
    return None, Group(1, 1), Group.strided(lay.ep, ep_stride, gpn), edp


def moe_comm_s(sm, act: float) -> tuple[float | None, float, float]:
    """(the MLP side's tp seconds per direction, None where it is a dense tp region; the
    all-to-all seconds per direction; the forward-only count exchanges) of BlockCosts `sm`'s
    MoE block, `act` the bytes of one full-width activation of the rank's micro-batch."""
    lay, m, sh = sm.lay, sm.model, sm.shard
    tokens = sh.tokens / sm.stack.moe_token_share(lay.tp, lay.sequence_parallel)
    routed = tokens * m.moe.top_k * m.hidden * sm.a * sh.expert_load
    a2a = counts = 0.0
    if lay.ep > 1:
        a2a = 2 * sm._coll("all_to_all", routed, sm.ep_group)  # dispatch and combine
        counts = sm._coll("all_to_all", m.moe.experts * 8, sm.ep_group)  # latency-bound
    if sm.etp is None:
        return None, a2a, counts
    tp_mlp = (sm._coll("all_gather", act, sm.tp_group)
              if lay.tp > 1 and not lay.sequence_parallel else 0.0)
    if lay.etp > 1:
        a2a += 2 * sm._coll("all_to_all", lay.etp * routed, sm.etp_group)
        counts += sm._coll("all_gather", lay.etp * m.moe.experts // lay.ep * 8, sm.etp_group)
    return tp_mlp, a2a, counts
