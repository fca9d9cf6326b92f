"""Where in a pass the ledger's per-pass collectives run: the op trace's placement rules.

fivefold.planner.ledger_model predicts every collective of a step byte for byte, but as a
per-step list; the op trace (fivefold.planner.op_trace) needs each one next to the compute
op whose output it carries. `CommPool` holds the ledger's per-pass records (tensor, sequence,
context and expert parallelism's exchanges, ZeRO-3's gathers, ZeRO-2/3's per-pass gradient
reduce-scatters, and under offload ZeRO-1/2's parameter gathers, which the engine issues in
the next forward's pre-hooks: fivefold.memory.offload) and hands them out by (op, purpose)
at the places the runtime issues them (fivefold.parallel.tensor_comm, .context, .expert,
.data_parallel):

  forward    before wq: sequence parallelism's all-gather of the region input; after wv:
             Ulysses' q, k, v all-to-alls (ring: the core's kv sends and receives, one pair
             per ring step but the last); after the core: Ulysses' output all-to-all; after
             wo and after the MLP's last GEMM: tp's all-reduce or sp's reduce-scatter; before
             w1: sp's all-gather; around an MoE layer's experts: the count and dispatch
             all-to-alls before, the combine after; before each block: ZeRO-3's gather
  backward   the mirror: sp's gather of the output gradient before a region's backward, tp's
             all-reduce or sp's reduce-scatter after its input gradients, sp's re-gather
             before its weight gradients, the norm gains' all-reduces after the block,
             Ulysses' and the experts' backward all-to-alls around the core and the
             experts, ring's kv and dkv pairs per ring step; ZeRO-3's gather before and
             ZeRO-2/3's reduce-scatter after each block
  embedding  tp's all-reduce (sp: reduce-scatter) after the first stage's lookup; before the
  and head   head, sp's all-gather and after it the vocabulary loss's all-gather

The bytes are always the ledger's: a place whose record the pool does not hold (a layout
without that collective) takes nothing, and records no place asked for stay in the pool;
op_trace puts those after the step's last backward op, so the trace's collectives equal the
ledger's in every case. Their order inside a pass is the runtime's where a rule exists; the
embedding's and the final norm's backward collectives, recomputation's repeats and the MoE
token-split records (fivefold.planner.moe_ledger) are the leftovers today.
"""

from __future__ import annotations

import functools
from collections import deque

from fivefold.comm.ledger import CommRecord

SP_GATHER = ("all_gather", "sp_activations")
REGION_EXIT = (("all_reduce", "tp_activations"), ("reduce_scatter", "sp_activations"))
FORWARD = {  # (when, op name suffix) -> the (op, purpose) keys to take there
    ("before", "attention.wq"): (SP_GATHER,),
    ("after", "attention.wv"): (("all_to_all", "cp_q"), ("all_to_all", "cp_k"),
                                ("all_to_all", "cp_v")),
    ("after", "attention.core"): (("all_to_all", "cp_out"),),
    ("after", "attention.wo"): REGION_EXIT,
    ("before", "mlp.w1"): (SP_GATHER,),
    ("before", "mlp.router"): (SP_GATHER,),
    ("after", "mlp.router"): (("all_to_all", "moe_counts"), ("all_to_all", "moe_dispatch")),
    ("after", "mlp.w2"): (("all_to_all", "moe_combine"),) + REGION_EXIT,
}
BACKWARD = {  # the same for a backward pass, in backward order
    ("before", "mlp.w2"): (SP_GATHER, ("all_to_all", "moe_combine_backward")),
    ("after", "mlp.w2"): (("all_gather", "sp_regather"),),
    ("after", "mlp.w1"): (("all_to_all", "moe_dispatch_backward"),) + REGION_EXIT,
    ("before", "attention.wo"): (SP_GATHER,),
    ("before", "attention.core"): (("all_to_all", "cp_out_grad"),),
    ("after", "attention.core"): (("all_to_all", "cp_v_grad"), ("all_to_all", "cp_k_grad"),
                                  ("all_to_all", "cp_q_grad"), ("all_gather", "sp_regather")),
    ("after", "attention.wq"): REGION_EXIT,
}
RING = ((("send", "cp_kv"), ("recv", "cp_kv")),  # per ring step but the last
        (("send", "cp_dkv"), ("recv", "cp_dkv")))  # per step of the backward
PASS_PURPOSES = frozenset({
    "tp_activations", "sp_activations", "sp_regather", "sp_norm_grads", "vocab_loss",
    "cp_q", "cp_k", "cp_v", "cp_out", "cp_q_grad", "cp_k_grad", "cp_v_grad", "cp_out_grad",
    "cp_kv", "cp_dkv", "moe_counts", "moe_dispatch", "moe_combine", "moe_dispatch_backward",
    "moe_combine_backward"})


class CommPool:
    """The ledger's per-pass records, handed out by (op, purpose) in ledger order."""

    def __init__(self, records: list[CommRecord], zero_stage: int, offload: bool):
        self.queues: dict[tuple[str, str], deque] = {}
        self.rest: list[CommRecord] = []
        for r in records:
            per_pass = (r.purpose in PASS_PURPOSES
                        or (r.purpose == "params" and (zero_stage == 3 or offload))
                        or (r.purpose == "grads" and zero_stage >= 2
                            and r.op == "reduce_scatter"))
            if per_pass:
                self.queues.setdefault((r.op, r.purpose), deque()).append(r)
            else:
                self.rest.append(r)

    def take(self, keys) -> list[CommRecord]:
        """One record of each key the pool still holds."""
        if not keys:
            return []
        out = []
        for key in keys:
            queue = self.queues.get(key)
            if queue:
                out.append(queue.popleft())
        return out

    def leftovers(self) -> list[CommRecord]:
        return [r for queue in self.queues.values() for r in queue]


@functools.cache
def places(name: str, phase: str, when: str) -> tuple:
    """The (op, purpose) keys to take `when` ("before"/"after") the op called `name` in a
    pass of `phase` ("forward" or a backward's)."""
    table = FORWARD if phase in ("forward", "recompute") else BACKWARD
    for (at, suffix), keys in table.items():
        if at == when and name.endswith(suffix):
            return keys
    return ()
