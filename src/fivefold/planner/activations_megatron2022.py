"""Bytes the older Megatron-LM GPT block keeps for backward: the block of arXiv 2205.05198.

Before Megatron-LM took in FlashAttention (`Stack.flash_attention_since`), its transformer
layer (megatron/model/transformer.py, e.g. at commit b707199, 2023-01-03, the last before
that merge) was the GPT block: LayerNorm (apex's fused kernel), GELU MLP with the bias-GELU
fusion, learned positions, dropout 0.1 on the attention probabilities and on each residual
branch (--attention-dropout, --hidden-dropout), and an unfused attention core that writes
the s x s scores, softmaxes them (FusedScaleMaskSoftmax) and drops them out before the
product with the values. Korthikanti et al. count what it saves in arXiv 2205.05198, Sec. 4.1
(34sbh + 5as^2b bytes per layer in 16-bit), Sec. 4.2 (tensor and sequence parallelism) and
Sec. 5 (selective recomputation). Counted here operator by operator, per token of one
micro-batch, with a = bytes of the compute dtype, D the width, Hd = heads x head_dim,
H heads, F the MLP width, s the sequence length (every key of the sequence), t = tp:

  LayerNorm (x2)     its input (aD) and its fp32 mean and inverse deviation (8), apex's
                     FusedLayerNormAffineFunction -> 2(aD + 8)
  qkv linear         its input aD
  Q K^T (baddbmm)    q and k: 2a Hd/t                                (k, v at the kv heads)
  softmax            its output, a s H/t
  attention dropout  its 1-byte mask, s H/t; its output a s H/t, which the product with
                     the values keeps together with v (a Hd/t)
  proj linear        its input a Hd/t
  bias-dropout-add   the 1-byte mask of the residual branch, D
  fc1 linear         its input aD
  bias-GELU          its input (fc1's output) a F/t; fc2 keeps GELU's output a F/t
                     (a SwiGLU MLP, which Megatron-LM gained only in 2023-04, would keep
                     w1, w3 and silu outputs and w2's input, 4a F/t)
  bias-dropout-add   the MLP branch's 1-byte mask, D

With a = 2, h = D = Hd, F = 4h and t = 1 that is 34 + 5as/h bytes per token (the paper's
sbh(34 + 5as/h)) plus the 16 bytes of the two norms' statistics, which the paper leaves out.
Tensor parallelism divides the Hd, H and F terms by t: sbh(10 + 24/t + 5as/(ht)); sequence
parallelism (Sec. 4.2.2-4.2.3) runs the norms, dropouts and residuals on 1/t of the tokens
and the column-parallel linears keep their input's sequence shard, re-gathered in backward,
so the D terms are divided too: sbh(34/t + 5as/(ht)).

Recomputation (megatron/arguments.py --recompute-granularity, 2022):
- `selective` checkpoints the attention core (ParallelAttention._checkpointed_attention_
  forward): softmax output, dropout mask and dropout output are recomputed from q, k and v,
  which stay saved as the checkpoint's inputs; what remains is Sec. 5's 34sbh/t (with
  sequence parallelism) or sbh(10 + 24/t).
- `full` keeps each layer's input, aD per token: the paper's 2sbh; with sequence
  parallelism that input is this rank's sequence shard, 2sbh/t.

Outside the blocks (Sec. 4.4; megatron/model/language_model.py and gpt_model.py of the same
commit): the first stage keeps the token and position ids (int64 each) and the embedding
dropout's 1-byte mask (on the sequence shard with sequence parallelism: the paper's sbhp/t
over its p in-flight micro-batches); the last stage keeps the final LayerNorm's input and
statistics, the output projection's input (its sequence shard with sequence parallelism)
and the cross-entropy's fp32 softmax: the loss runs on `output.float()` and
_VocabParallelCrossEntropy saves exp_logits, 4 bytes per logit of the rank's vocabulary
shard (the paper's 4sbv/t), plus the int64 targets and, with tp > 1, the vocabulary
shard's target mask.

Megatron-LM of 2022 had no context parallelism: the scores span all model.seq_len keys.
A mixture-of-experts layer is not this block (Megatron-LM of 2022 had only a top-1
SwitchMLP); activations.block_saved_bytes counts such layers as the newer stack's.
"""

from __future__ import annotations

from fivefold.config import ModelConfig

DROPOUT_MASK_BYTES = 1  # torch keeps a dropout mask as bool
NORM_STATS_BYTES = 8  # LayerNorm's fp32 mean and inverse standard deviation, per token


def attention_scores_bytes(model: ModelConfig, act_bytes: int, tp: int = 1) -> float:
    """Per token: the unfused attention core's s x s tensors (softmax output, dropout mask,
    dropout output) on one tensor-parallel rank, (2a + 1) s H / t: the paper's 5as/t at
    a = 2. Selective recomputation recomputes exactly these."""
    return (2 * act_bytes + DROPOUT_MASK_BYTES) * model.seq_len * model.heads / tp


def gpt_block_saved_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                          sp: bool = False, recompute: str = "none") -> float:
    """Bytes one older Megatron GPT block keeps for backward over `tokens` tokens of one
    micro-batch on one tensor-parallel rank (the table in the module docstring)."""
    a = act_bytes
    D = model.hidden / tp if sp else model.hidden  # what each norm, dropout, residual holds
    if recompute == "full":
        return tokens * a * D
    hd = model.heads * model.d_head / tp
    kv = model.n_kv_heads * model.d_head / tp
    F = model.ffn_hidden / tp
    norm_stats = NORM_STATS_BYTES / tp if sp else NORM_STATS_BYTES
    norms = 2 * (a * D + norm_stats)
    attention = a * D + a * hd + a * kv + a * kv + a * hd + DROPOUT_MASK_BYTES * D
    mlp = a * D + (4 if model.ffn_type == "swiglu" else 2) * a * F + DROPOUT_MASK_BYTES * D
    per_token = norms + attention + mlp
    if recompute != "selective":
        per_token += attention_scores_bytes(model, a, tp)
    return tokens * per_token


def gpt_root_saved_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                         first: bool = True, last: bool = True, sp: bool = False) -> float:
    """Bytes the older Megatron GPT model keeps outside its blocks on one tensor-parallel rank
    for one micro-batch of `tokens` tokens (the module docstring's last table)."""
    a = act_bytes
    D = model.hidden / tp if sp else model.hidden
    n = 0.0
    if first:  # token ids, position ids, the embedding dropout mask
        n += tokens * (8 + 8 + DROPOUT_MASK_BYTES * D)
    if last:  # final LayerNorm, output projection input, fp32 softmax, int64 targets
        norm_stats = NORM_STATS_BYTES / tp if sp else NORM_STATS_BYTES
        n += tokens * (a * D + norm_stats + a * D + 4 * model.vocab / tp + 8)
        n += tokens if tp > 1 else 0  # the vocabulary shard's target mask
    return n
