"""Hierarchical sharding and ZeRO++ on the experts' grid and over cp, against one process.

The tiny MoE of tests/test_zeropp_expert.py (8 experts, top-2, dropless, the load-balancing
loss on) trains 5 steps in each layout, on gloo ranks, one process start per world size:

- hierarchical sharding (MiCS, arXiv 2205.00119; `parallel.zero_group`) with ep or etp > 1:
  the routed experts' units shard over the part of their edp group inside one zero group
  ("edp_shard") and all-reduce that shard across the others ("edp_replicate",
  fivefold.parallel.mesh.Mesh.expert_zero_axes);
- ZeRO++ (arXiv 2306.10209) with etp > 1: the expert units' hpZ and qgZ node groups cut
  from their edp (or edp_shard) group, whose members are ep x etp ranks apart;
- ZeRO++ with cp > 1: the dense shard group is dp_shard x cp (cp ranks hold the same
  weights and see other tokens), its node groups cut from it, tp ranks apart.

Tolerances as tests/test_zeropp_expert.py states them: a layout without qwZ or qgZ changes
no arithmetic but the order of sums (losses rtol 1e-5, parameters tests/parity.py's fp32
tolerance, atol 1e-5 + rtol 1e-4); qwZ and qgZ send int8 weights and gradients on purpose
(losses within rtol 1e-2 of one process, every parameter within 10% relative, L2 of the
difference over L2 of the reference). Every rank's ledger of the first step equals
`predict_ledger` (the routing-sized rows summed over the ranks).
"""

from __future__ import annotations

import pytest

from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import training_plan
from fivefold.comm.quantize import BLOCK
from fivefold.planner.comm import Group
from fivefold.planner.expert_cost import expert_groups
from fivefold.planner.memory import stage_units
from fivefold.planner.stack import stack_of
from parity import assert_moe_layouts_match
from test_zeropp_expert import ALL3, MOE

Z3, GPN2, GPN4 = "parallel.zero_stage=3", "cluster.gpus_per_node=2", "cluster.gpus_per_node=4"
# (overrides, label, quantized, ledger dimensions the layout must have used)
LAYOUTS_4 = [
    (["parallel.ep=2", Z3, "parallel.zero_group=2", "parallel.hpz=true", GPN2],
     "ep2 ZeRO-3 zero_group 2 hpZ", False, ("edp_replicate", "dp_shard.intra")),
    (["parallel.cp=2", "parallel.etp=2", Z3, *ALL3, GPN2], "cp2 etp2 ZeRO-3 qwZ hpZ qgZ",
     True, ("dp_shard+cp.inter", "edp.inter")),
]
LAYOUTS_8 = [
    (["parallel.ep=2", Z3, "parallel.zero_group=4", *ALL3, GPN2, "parallel.micro_batch=1"],
     "ep2 ZeRO-3 zero_group 4 qwZ hpZ qgZ", True, ("edp_shard.inter", "edp_replicate")),
    (["parallel.etp=2", "parallel.zero_stage=2", "parallel.zero_group=4", "parallel.qgz=true",
      GPN4, "parallel.micro_batch=1"], "etp2 ZeRO-2 zero_group 4 qgZ", True,
     ("edp_shard.intra", "edp_replicate")),
    (["parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=1", "parallel.zero_group=2"],
     "ep2 tp2 ZeRO-1 zero_group 2", False, ("edp_shard", "edp_replicate")),
    (["parallel.cp=2", Z3, "parallel.zero_group=2", *ALL3, GPN2],
     "cp2 ZeRO-3 zero_group 2 qwZ hpZ qgZ", True, ("dp_shard+cp.intra", "dp_replicate")),
]


def _check(world: int, layouts: list, base: list[str]) -> None:
    per_rank = assert_moe_layouts_match(world, base, [layout[:3] for layout in layouts],
                                        timeout_s=900)
    for i, (_, label, _, dims) in enumerate(layouts):
        used = {d for rank in per_rank for _, d, _ in rank[i]["ledger"][0]}
        assert set(dims) <= used, (label, used)


def test_hierarchical_and_zeropp_groups_on_4_ranks(parity_overrides):
    _check(4, LAYOUTS_4, parity_overrides + MOE)


@pytest.mark.slow
def test_hierarchical_and_zeropp_groups_on_8_ranks(parity_overrides):
    _check(8, LAYOUTS_8, parity_overrides + MOE)


def test_a_zero_group_must_hold_whole_expert_grids(tiny_overrides):
    """ep 4 on 8 data-parallel ranks with zero_group 2: each zero group would hold half of an
    ep grid, so no edp rank's part of a zero group exists: refused naming zero_group."""
    cfg = load_config(None, tiny_overrides + MOE + [
        "parallel.ep=4", "parallel.zero_stage=1", "parallel.zero_group=2",
        "parallel.global_batch=8", "parallel.micro_batch=1"])
    with pytest.raises(ConfigError, match="whole") as err:
        training_plan(cfg, 8, "cpu")
    assert err.value.key == "parallel.zero_group"


def test_the_planner_shards_hierarchical_experts_over_their_zero_groups_part(tiny_overrides):
    """ep 2 on 8 ranks, zero_group 4: each edp group of 4 is 2 ranks in each of the 2 zero
    groups; the memory model shards an expert unit over those 2 and the simulator syncs it
    over a group of 2, ep ranks apart (the runtime's edp_shard, checked by the 8-rank run)."""
    cfg = load_config(None, tiny_overrides + MOE + [
        "parallel.ep=2", Z3, "parallel.zero_group=4", "parallel.global_batch=8",
        "parallel.micro_batch=1", "cluster.gpus_per_node=8"])
    plan = training_plan(cfg, 8, "cpu")
    assert plan.expert_shard_axis == ("edp_shard", 2)
    *_, edp = expert_groups(stack_of("fivefold"), plan, Group.strided(4, 1, 8), 8)
    assert (edp.size, edp.per_node) == (2, 2)
    units = stage_units(cfg.model, plan, list(range(cfg.model.layers)), True, True, BLOCK,
                        etp=plan.etp)
    assert {u.shard for u in units if u.expert} == {2}
