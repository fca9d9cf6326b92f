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

Recomputation (fivefold.memory.recompute; Chen et al., arXiv 1604.06174) keeps only a block's
input from the forward; torch's non-reentrant checkpoint runs the block's forward again in
the first backward walk that needs a saved tensor, and again in every later walk, since it
keeps what it recomputed per walk. I and W are two walks, so W on the forward's outputs would
run the forward a second time (and its tensor-parallel collectives with it). Instead the
recomputation is done once, in I, and W reuses it: while I runs, the same hooks record each
parameter-owning module's output as the recomputation produces it (`recomputed_outputs`), and
W starts from those, whose graph holds real tensors. As in the ZB paper's split (Sec. 2),
what W needs, the inputs of the weight-gradient products, lives from I to W: here the
recomputed graph of the unit's blocks, about what a unit without recomputation keeps. For W
to find every module, a checkpoint taken in a forward that W follows recomputes its whole
block (torch's early stop off), which also runs the MLP's closing collective again
(fivefold.planner.ledger_model counts it).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

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


def _hooked(stage: PipelineStage, eager: list[torch.nn.Parameter], record):
    """`record(module, output)` as a first forward hook of every parameter-owning module of
    the stage but those whose weights are `eager`, for outputs that require a gradient."""
    skip = {id(p) for p in eager}

    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            record(module, output)

    return [m.register_forward_hook(hook, prepend=True) for m in stage.modules()
            if _owns_params(m) and not any(id(p) in skip for p in m.parameters())]


@contextlib.contextmanager
def capture_weight_ops(stage: PipelineStage, eager: list[torch.nn.Parameter]):
    """Record (output, own parameters, module) of every parameter-owning module run in the
    block, but for the modules whose weights are `eager`.

    The hook is put first (`prepend`), so it sees the module's own output before a hook
    installed earlier (tensor parallelism's on the final norm) replaces it. A recomputed
    block (module docstring) runs its whole forward again: early stop is off for the
    checkpoints taken here."""
    ops: list[tuple[torch.Tensor, list[torch.nn.Parameter], torch.nn.Module]] = []

    def record(module, output):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            ops.append((output, params, module))

    handles = _hooked(stage, eager, record)
    stage.capture = ops
    try:
        with set_checkpoint_early_stop(False):
            yield ops
    finally:
        stage.capture = None
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def recomputed_outputs(stage: PipelineStage, eager: list[torch.nn.Parameter]):
    """{module: output} of the parameter-owning modules that a recomputation (fivefold.memory
    .recompute) runs again while inside: during I, the outputs W takes instead of the
    forward's."""
    again: dict[torch.nn.Module, torch.Tensor] = {}
    handles = _hooked(stage, eager, again.__setitem__)
    try:
        yield again
    finally:
        for handle in handles:
            handle.remove()


def backward_input(st: dict, tied: list[torch.Tensor], eager: list[torch.nn.Parameter],
                   stage: PipelineStage) -> None:
    """I of one unit whose state `st` holds its forward's "output", "input" (not on the first
    stage), "ops" (capture_weight_ops) and the "output_grad" received: sets "input_grad" and
    "deferred" (W's work, on the recomputed outputs where the walk recomputed blocks); the
    borrowed tied head's and the eager weights' gradients are accumulated now."""
    with recomputed_outputs(stage, eager) as again:
        _walk_input(st, tied, eager, again)


def _walk_input(st: dict, tied: list[torch.Tensor], eager: list[torch.nn.Parameter],
                again: dict) -> None:
    ops = st.pop("ops")
    first = [st["input"]] if "input" in st else []
    outs = [y for y, _, _ in ops]
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
    st["deferred"] = [(again.get(module, y), dy, params) for (y, params, module), dy in
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
