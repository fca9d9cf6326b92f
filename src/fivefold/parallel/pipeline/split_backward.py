"""Zero-bubble's split backward: I (the stage input's gradient) and W (the weights' gradients).

Zero-bubble split (ZB, arXiv 2401.10241, Sec. 2). During a forward that a W will follow, every
module that owns parameters (Linear, RMSNorm, Embedding, the head) has its output recorded.
I asks autograd for the gradients of the stage input and of those outputs only, which walks
the activation-gradient chain and skips every weight gradient; W then runs, per recorded
output, the backward from that output to its own parameters: exactly the weight-gradient
matrix multiplies that I skipped, accumulated into `.grad` as a full backward would. The
output recorded is the module's own, taken before any other forward hook rewrites it: tensor
parallelism's hook on the final norm wraps its output in Megatron's f (copy_to_tp), whose
backward is an all-reduce; recorded after f, each W would run that all-reduce again. So W
issues no collective on the activation-gradient chain: every one there runs once, in I. The
collectives a W does issue are sequence parallelism's, which only weight gradients need: the
re-gather of a region's input, once per region and micro-batch, which I skips
(fivefold.parallel.tensor_comm says why in W rather than I), and the all-reduce of a norm
gain's gradient, run where that gradient is computed.

A module that owns parameters and holds parameter-owning modules too (an MoE layer: its
stacked experts, and a router whose weight it applies itself) is not split: the path from its
output to its own weights runs through its children and, under expert parallelism, through
the dispatch and combine all-to-alls, which a W would repeat. Its whole subtree's weights
(`eager_weights`) get their gradients in I, in the same walk as the input gradient, accumulated
into `.grad` as a full backward does. So on a stage with such weights I accumulates weight
gradients too, and the executor tells data parallelism before it (`last_gradient_steps`).
The MoE layers under zero-bubble schedules had no such rule before: the router's weight,
applied by its MoE layer rather than by calling the router, got no gradient in a W.
"""

from __future__ import annotations

import contextlib

import torch

from fivefold.parallel.pipeline.p2p_plan import Step
from fivefold.parallel.pipeline.schedules import B, I, W
from fivefold.parallel.pipeline.stage import PipelineStage


def _owns_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def eager_weights(stage: PipelineStage) -> list[torch.nn.Parameter]:
    """The weights whose gradients I computes (module docstring): every parameter under a
    module that owns parameters and holds parameter-owning modules (an MoE layer)."""
    out: dict[int, torch.nn.Parameter] = {}
    for module in stage.modules():
        if _owns_params(module) and any(_owns_params(c) for c in module.modules()
                                         if c is not module):
            out.update({id(p): p for p in module.parameters() if p.requires_grad})
    return list(out.values())


@contextlib.contextmanager
def capture_weight_ops(stage: PipelineStage, eager: list[torch.nn.Parameter]):
    """Record (output, own parameters) of every parameter-owning module run in the block,
    but for the modules whose weights are `eager`.

    The hook is put first (`prepend`), so it sees the module's own output before a hook
    installed earlier (tensor parallelism's on the final norm) replaces it."""
    ops: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] = []
    skip = {id(p) for p in eager}

    def hook(module, args, output):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params and isinstance(output, torch.Tensor) and output.requires_grad:
            ops.append((output, params))

    handles = [m.register_forward_hook(hook, prepend=True) for m in stage.modules()
               if _owns_params(m) and not any(id(p) in skip for p in m.parameters())]
    stage.capture = ops
    try:
        yield ops
    finally:
        stage.capture = None
        for handle in handles:
            handle.remove()


def backward_input(st: dict, tied: list[torch.Tensor], eager: list[torch.nn.Parameter]) -> None:
    """I of one unit whose state `st` holds its forward's "output", "input" (not on the first
    stage), "ops" (capture_weight_ops) and the "output_grad" received: sets "input_grad" and
    "deferred" (W's work); the borrowed tied head's and the eager weights' gradients are
    accumulated now."""
    ops = st.pop("ops")
    first = [st["input"]] if "input" in st else []
    outs = [y for y, _ in ops]
    if not eager:
        got = torch.autograd.grad([st["output"]], first + outs + tied,
                                  [st.pop("output_grad", None)], retain_graph=True,
                                  allow_unused=True)
        for leaf, g in zip(tied, got[len(got) - len(tied):]):
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    else:  # one walk that also accumulates the eager weights' (and the tied head's) gradients
        for y in first + outs:
            y.grad = None
        torch.autograd.backward([st["output"]], [st.pop("output_grad", None)],
                                inputs=first + outs + tied + eager, retain_graph=True)
        got = [y.grad for y in first + outs]
        for y in outs:
            y.grad = None
    if first:
        st["input_grad"] = got[0]
    st["deferred"] = [(y, dy, params) for (y, params), dy in
                      zip(ops, got[len(first):len(first) + len(ops)]) if dy is not None]


def backward_weight(st: dict) -> None:
    """W of one unit: each recorded output's backward to its own parameters."""
    for y, dy, params in st["deferred"]:
        torch.autograd.backward([y], [dy], inputs=params, retain_graph=True)


def last_gradient_steps(plan) -> set[Step]:
    """The plan Steps after which no action touches some of their virtual stage's weights
    again: per stage, the later of its last B and last W (the weights a W computes), and the
    later of its last B and last I (the eager weights, which I computes)."""
    last = {}
    for item in plan:
        if isinstance(item, Step):
            a = item.action
            if a.kind in (B, W):
                last[a.stage, W] = item
            if a.kind in (B, I):
                last[a.stage, I] = item
    return set(last.values())
