"""Activation recomputation: `full` keeps each block's input, `selective` also every second
matmul's output and the attention kernel's; the rest is recomputed in backward.

Activation checkpointing (Chen et al., arXiv 1604.06174; Megatron-LM's "full" mode, Korthikanti
et al., arXiv 2205.05198 Sec. 5) trades one extra forward per block for memory: a block saves
only its input for backward, and its backward first runs its forward again, this time keeping
what autograd needs. Per block and token the saved bytes drop from the whole block's set
(fivefold.planner.activations) to a * D, plus, during one block's backward, that block's full
set.

`selective` is torchtitan's per-operator policy (its "op" selective activation checkpointing):
the block still runs under torch.utils.checkpoint, but torch's selective-checkpoint contexts
keep the outputs of the attention kernel (output and log-sum-exp) and of every second matmul
in the block's execution order (the 1st, 3rd, ...: wq, wv, w1, w2 of a SwiGLU block; wq, wv,
w1 of a GELU block), so the backward's replay takes those from the cache and recomputes only
the other matmuls (wk, wo, w3) and the element-wise work (norms, rotary, activations). Korthikanti
et al.'s selective mode recomputes the attention core instead; with a fused attention kernel
(no s x s scores kept) that saves nothing here, which is why torchtitan chose matmuls.

Both wrap each block's forward from outside: the model stays free of it, hooks registered on
the block run once around the checkpointed call, those of its submodules again during the
recomputation. The recomputed forward is the same computation, so losses and gradients equal
the run without it bit for bit on the CPU (tests/test_train.py).

What the selective cache holds is not packed through autograd's saved-tensor hooks (torch's
cache keeps it), so `observe_selective_saves` lets a counter (fivefold.memory.activation_count)
see each tensor the policy keeps, as it is kept.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

aten = torch.ops.aten

MATMULS = frozenset({aten.mm.default, aten.addmm.default})
ATTENTION_KERNELS = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default})

_observers: list[Callable[[torch.Tensor], None]] = []


def apply_full_recompute(blocks: Iterable[nn.Module]) -> None:
    """Make every block in `blocks` save only its input for backward."""
    for block in blocks:
        block.forward = _checkpointed(block.forward, None)


def apply_selective_recompute(blocks: Iterable[nn.Module]) -> None:
    """Make every block in `blocks` save its input, the attention kernel's outputs and every
    second matmul's output for backward (torchtitan's per-operator policy)."""
    for block in blocks:
        block.forward = _checkpointed(block.forward, _selective_contexts)


@contextlib.contextmanager
def observe_selective_saves(observer: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `observer(tensor)` for every tensor the selective policy keeps while inside."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def _checkpointed(forward, context_fn):
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)
    return run


def _selective_contexts():
    """Fresh contexts per checkpointed call: the matmul count restarts at every block."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, {}))


def _policy(matmuls_seen: dict[bool, int], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the attention kernel and odd-numbered matmuls (counted separately in the forward
    and in the recompute, which must agree on which outputs the cache serves)."""
    if op in MATMULS:
        n = matmuls_seen[ctx.is_recompute] = matmuls_seen.get(ctx.is_recompute, 0) + 1
        save = n % 2 == 1
    else:
        save = op in ATTENTION_KERNELS
    if save and not ctx.is_recompute and _observers:
        if not hasattr(ctx, "op_output"):
            raise RuntimeError("counting the selective cache needs torch's policy context to "
                               "carry the op's output (torch >= 2.13)")
        for out in _tensors(ctx.op_output):
            for observer in _observers:
                observer(out)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
