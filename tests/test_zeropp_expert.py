"""ZeRO++ (arXiv 2306.10209) with expert parallelism against one process, on 4 gloo ranks.

The tiny MoE (8 experts, top-2, dropless, the load-balancing loss on) trains 5 steps at ZeRO-3
with ep 2 x edp 2; the routed experts' units shard over their edp group, whose hpZ and qgZ
node subgroups the engine builds from every edp group on every rank (fivefold.comm.zeropp).
`cluster.gpus_per_node` = 4 puts both edp ranks of an expert on one node (edp.intra of 2),
= 2 puts them on two nodes (edp.inter of 2), while the dense units' groups split 4 x 1 and
2 x 2 (hpZ alone: with edp in a node). hpZ alone changes no arithmetic: losses rtol 1e-5,
parameters tests/parity.py's fp32 tolerance (atol 1e-5 + rtol 1e-4). qwZ and qgZ send int8
weights and gradients on purpose: losses within rtol 1e-2 of one process (measured 1e-4),
and every parameter within 10% relative (L2 of the difference over L2 of the reference;
measured 4.9% and 4.5% worst after 5 steps). Every rank's ledger of the first
step equals
`predict_ledger`, as tests/test_planner_ledger.py checks MoE (routing-sized rows summed over
the ranks).
"""

from __future__ import annotations


from parity import assert_moe_layouts_match

WORLD = 4
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01", "parallel.micro_batch=2"]
EP_ZERO3 = ["parallel.ep=2", "parallel.zero_stage=3"]
ALL3 = ["parallel.qwz=true", "parallel.hpz=true", "parallel.qgz=true"]
LAYOUTS = [  # (overrides, label, quantized)
    (EP_ZERO3 + ["parallel.hpz=true", "cluster.gpus_per_node=4"], "hpZ, edp in a node", False),
    (EP_ZERO3 + ALL3 + ["cluster.gpus_per_node=4"], "qwZ hpZ qgZ, edp in a node", True),
    (EP_ZERO3 + ALL3 + ["cluster.gpus_per_node=2"], "qwZ hpZ qgZ, edp over nodes", True),
]


def test_zeropp_with_ep2_matches_one_process_and_the_ledger(parity_overrides):
    per_rank = assert_moe_layouts_match(WORLD, parity_overrides + MOE, LAYOUTS)
    ledger = per_rank[0][1]["ledger"][0]  # the expert units' ZeRO++ subgroups were used
    assert any(dim == "edp.intra" for _, dim, _ in ledger)
    assert any(dim == "edp.inter" for _, dim, _ in per_rank[0][2]["ledger"][0])
