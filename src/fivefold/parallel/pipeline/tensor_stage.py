"""Tensor parallelism inside a pipeline stage: 3D parallelism (pp x dp x tp).

Megatron-LM composes the two this way (arXiv 2104.04473, Sec. 2.3 and 3): each pipeline stage
is split over the "tp" axis exactly as the whole model is, and a stage talks to the next one
through the rank of the same tensor-parallel index (the "pp" process groups of the mesh run
across stages at a fixed tp rank). `apply_tensor_parallel_to_stage` therefore applies
fivefold.parallel.tensor to the stage's blocks (and the vocabulary-parallel embedding on the
first stage, the vocabulary-parallel head and final-norm hook on the last), then sets what is
stage-specific:

- the loss: the last stage's logits are this rank's vocabulary columns, so its summed token
  cross-entropy is fivefold.parallel.vocab_parallel_loss (never gathering the logits);
- the borrowed tied head (a last stage that computes the head with the first stage's
  embedding): a buffer of this rank's vocabulary rows, the same rows as the embedding shard
  of the first stage's rank of the same tp index, with which it is exchanged;
- the messages between stages. Without sequence parallelism the hidden states between blocks
  are replicated over the tp ranks, and each tp rank sends its own full (B, T, D) replica to
  its peer: t copies of one activation cross the stage boundary (Megatron's scatter/gather
  of these, Sec. 4.1, is not done). With sequence parallelism the hidden states between
  blocks are sequence shards, and each tp rank sends its (B, T/t, D) shard: no duplicate.

TeraPipe's token slices (its block runs the attention's linears itself, outside the
tensor-parallel region hooks) are not composed with tensor parallelism; validation rejects
the combination.
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.pipeline.stage import PipelineStage
from fivefold.parallel.tensor import apply_tensor_parallel, shard_tensor
from fivefold.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy


class VocabParallelLossSum:
    """Summed token cross-entropy (fp32) of vocabulary-sharded logits (B, T, V'/t)."""

    def __init__(self, vocab: int, axis: Axis):
        self.vocab, self.axis = vocab, axis

    def __call__(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(),
                                            self.vocab, self.axis).sum()


@torch.no_grad()
def apply_tensor_parallel_to_stage(stage: PipelineStage, tp_axis: Axis,
                                   sequence_parallel: bool) -> PipelineStage:
    """Split `stage` over `tp_axis` in place (see the module docstring); returns it."""
    apply_tensor_parallel(stage, tp_axis, sequence_parallel)
    if stage.borrows_embedding:
        stage.tied_head_weight = shard_tensor("tok_embeddings.weight", stage.tied_head_weight,
                                              tp_axis.size, tp_axis.rank)
    if stage.has_last:
        stage.token_loss_sum = VocabParallelLossSum(stage.cfg.vocab, tp_axis)
    stage.sequence_shards = tp_axis.size if sequence_parallel else 1
    return stage
