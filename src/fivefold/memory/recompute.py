"""Full activation recomputation: keep each block's input, recompute the rest in backward.

Activation checkpointing (Chen et al., arXiv 1604.06174; Megatron-LM's "full" mode, Korthikanti
et al., arXiv 2205.05198 Sec. 5) trades one extra forward per block for memory: a block saves
only its input for backward, and its backward first runs its forward again, this time keeping
what autograd needs. Per block and token the saved bytes drop from the whole block's set
(fivefold.planner.activations) to a * D, plus, during one block's backward, that block's full
set.

`apply_full_recompute(blocks)` wraps each block's forward in torch.utils.checkpoint
(non-reentrant), from outside: the model stays free of it, hooks registered on the block run
once around the checkpointed call, those of its submodules again during the recomputation.
The recomputed forward is the same computation, so losses and gradients equal the run
without it bit for bit on the CPU (tests/test_train.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_full_recompute(blocks: Iterable[nn.Module]) -> None:
    """Make every block in `blocks` save only its input for backward."""
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run
