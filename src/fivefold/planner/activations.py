"""Bytes autograd saves for backward, per block and for the root, for one micro-batch.

Counted operator by operator from what fivefold.models.llama saves (checked against
fivefold.memory.activation_count on the plain model, tests/test_planner_ledger.py), per
token, with a = bytes of the compute dtype (4 fp32, 2 bf16/fp16; fp8 training keeps bf16
activations), D width, Hd = heads x head_dim, H heads, F MLP width:

  RMSNorm (x2)     its fp32 input (pow), rsqrt (4 bytes), the normalized value (x weight)
                   -> (4 + a)D + 4 each
  q/k/v input      aD (one tensor, saved by three linears)
  attention        q, k and v (repeated to all heads), output, fp32 log-sum-exp
                   -> 4a Hd + 4H
  wo input         a Hd
  MLP input        aD
  SwiGLU           w1 out, w3 out, silu out, w2 input -> 4aF   (GELU: w1 out, w2 input: 2aF)

This is Korthikanti et al.'s accounting (arXiv 2205.05198, Sec. 4.1) for a fused-attention
Llama block: no s x s scores, no dropout masks. Tensor parallelism divides the Hd, H and F
terms by tp; sequence parallelism also the D terms. Context parallelism divides the tokens;
ring attention (and the hybrid's ring) saves this rank's q, output and fp32 log-sum-exp and
the key/value heads as they are, not repeated to every head (`ring_kv_heads`: a tp rank's
kv heads, replicated up to the Ulysses degree in the hybrid), 2a Hd + 2a K E + 4H.
A stack release before that stack's FlashAttention (Stack.unfused_gpt_block: Megatron-LM
before 2023-01) runs the older GPT block instead, with LayerNorm, dropout masks and the
unfused s x s attention scores: fivefold.planner.activations_megatron2022 counts it.
Recomputation: `full` keeps only each block's input (aD) plus, during its backward, one
block's full set; `selective` (torchtitan's per-op policy, fivefold.memory.recompute) keeps
the block input, the attention kernel's output and log-sum-exp and the outputs of every
second matmul in execution order: wq, wv, w1 and, in a SwiGLU block, w2 (a GELU block's w2
is its 6th matmul and is recomputed).

The root (embedding stage / head stage): token ids (int64), the final norm, the head input,
the fp32 log-softmax of the vocabulary-parallel logits and the int64 targets.

These are the counts for a model held in its compute dtype, as the data-parallel engine
holds it. Where the runtime trains fp32 weights under autocast instead (every other update
path), fivefold.planner.activations_autocast adds what that saves; under context
parallelism each stage also saves its tokens' rotary rows once (`rotary_rows_bytes`);
fivefold.planner.rank_memory adds both for the memory report.

fp8 (`fp8_input_copy`): fivefold's fp8 linear keeps the high-precision input and weight and
quantizes them again in backward, as torchao does, so under either recipe it saves what a
plain linear saves (tests/test_fp8.py measures it). A stack that keeps its linears' fp8
inputs (Transformer Engine, `Stack.fp8_saved_inputs`) can do so only where one fp8 copy
serves both passes: the input class in fp8 and tensorwise scales.
"""

from __future__ import annotations

from fivefold.config import ModelConfig
from fivefold.models.description import is_moe_layer
from fivefold.parallel.context.heads import ulysses_kv_heads
from fivefold.parallel.plan import PRECISION_BYTES, ParallelPlan
from fivefold.planner.activations_autocast import (autocast_block_bytes, autocast_root_bytes,
                                                   fp32_weights_under_autocast)
from fivefold.planner.activations_megatron2022 import (gpt_block_saved_bytes,
                                                       gpt_root_saved_bytes)
from fivefold.planner.stack import FIVEFOLD, Stack


def fp8_input_copy(lay: ParallelPlan) -> bool:
    """Whether a linear's input exists as one fp8 copy that both passes can use: precision
    fp8, the "input" class in fp8, tensorwise scales. Rowwise scales x along K for the
    forward GEMM and along the tokens for the weight gradient's, so its forward copy does not
    serve backward; with the input class off there is no fp8 copy. Such a copy is what a
    stack may save for backward (Stack.fp8_saved_inputs) and what a stack's fp8
    sequence-parallel all-gather moves (Stack.fp8_sp_gather, fivefold.planner.simulate)."""
    return (lay.precision == "fp8" and lay.fp8_recipe == "tensorwise"
            and "input" in lay.fp8_tensors)


def ring_kv_heads(model: ModelConfig, lay: ParallelPlan) -> int | None:
    """Key/value heads per token that ring attention saves for backward, or None where the
    attention core saves them repeated to every query head (no ring: one process, Ulysses)."""
    ring, ulysses = lay.context_degrees
    if ring == 1:
        return None
    return ulysses_kv_heads(model.n_kv_heads // lay.tp, ulysses)


def block_saved_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                      sp: bool = False, recompute: str = "none", layer: int = 0,
                      stack: Stack = FIVEFOLD, fp8: bool = False,
                      kv_heads: int | None = None) -> float:
    """Bytes one block keeps for backward over `tokens` tokens of one micro-batch (under
    `stack`: fivefold's own count unless the stack saves as Transformer Engine does;
    `kv_heads`: `ring_kv_heads`, for ring attention's unrepeated keys and values; a stack
    release before its FlashAttention: the older GPT block's dense layers,
    planner.activations_megatron2022)."""
    if stack.unfused_gpt_block and not is_moe_layer(model, layer):
        return gpt_block_saved_bytes(model, tokens, act_bytes, tp, sp, recompute)
    if stack.fp8_saved_inputs:
        return te_block_saved_bytes(model, tokens, act_bytes, tp, sp, recompute, layer, fp8)
    a = act_bytes
    D = model.hidden / tp if sp else model.hidden
    hd = model.heads * model.d_head / tp
    kv = max(1, model.n_kv_heads // tp) * model.d_head
    heads = model.heads / tp
    moe = is_moe_layer(model, layer)
    if recompute == "full":
        per_token = a * D
    elif recompute == "selective":
        f_saved = _expert_width(model, tp) if moe else model.ffn_hidden / tp  # (per token)
        w2_saved = a * D if moe or model.ffn_type == "swiglu" else 0.0  # 7th matmul, not 6th
        per_token = a * D + a * (hd + kv) + a * hd + 4 * heads + a * f_saved + w2_saved
    else:
        norms = 2 * ((4 + a) * D + (4 / tp if sp else 4))  # SP: rsqrt of 1/tp of the tokens
        qkv_out = 4 * a * hd if kv_heads is None else 2 * a * hd + 2 * a * kv_heads * model.d_head
        attention = a * D + qkv_out + 4 * heads + a * hd
        if moe:  # the layer routes the rank's tokens / tp with sp or on the experts' grid
            routed = tokens / tp if sp or not stack.experts_follow_tp else tokens
            return tokens * (norms + attention) + routed * moe_saved_per_token(model, a) + \
                moe_saved_constant(model, a)
        per_token = norms + attention + a * D + _mlp_saved(model, a, tp)
    return tokens * per_token


def te_block_saved_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                         sp: bool = False, recompute: str = "none", layer: int = 0,
                         fp8: bool = False) -> float:
    """What a Transformer Engine block (Megatron-Core) keeps, per token: each norm its input
    and rsigma (aD + 4); each linear its input, in fp8 (1 byte) where `fp8` (the
    `fp8_input_copy` of the plan); fused
    attention q, k and v at their own head counts (GQA not repeated), the output and the
    fp32 log-sum-exp; the MLP the fc1 output (2F for SwiGLU) and the fc2 input. Sequence
    parallelism keeps the D-wide tensors as 1/tp shards (re-gathered in backward).
    `selective` (Megatron's layernorm / moe_act modules) drops the norms' linear inputs and
    the fc2 input, which are recomputed; `full` keeps the block input."""
    a, lin = act_bytes, (1 if fp8 else act_bytes)
    D = model.hidden / tp if sp else model.hidden
    hd = model.heads * model.d_head / tp
    kv = max(1, model.n_kv_heads // tp) * model.d_head
    if recompute == "full":
        return tokens * a * D
    moe = is_moe_layer(model, layer)
    width = _expert_width(model, tp) if moe else model.ffn_hidden / tp
    fc1_out = (2 if model.ffn_type == "swiglu" else 1) * width
    copies = model.moe.top_k if moe else 1  # routed token copies enter the experts
    norms = 2 * (a * D + 4)
    attention = lin * D + a * (hd + 2 * kv) + a * hd + 4 * model.heads / tp + lin * hd
    mlp = lin * D * copies + a * fc1_out + lin * width
    if moe:
        mlp += 8 * model.moe.experts
    per_token = norms + attention + mlp
    if recompute == "selective":
        per_token -= lin * D + lin * D * copies + lin * width
    return tokens * per_token


def _expert_width(model: ModelConfig, tp: int) -> float:
    """Expert MLP width one token passes through (top-k routed plus shared experts)."""
    m = model.moe
    ffn = m.expert_ffn_hidden or model.ffn_hidden
    return (m.top_k + m.shared_experts) * ffn / tp


def _mlp_saved(model: ModelConfig, a: int, tp: int) -> float:
    F = model.ffn_hidden / tp
    return 4 * a * F if model.ffn_type == "swiglu" else 2 * a * F


def moe_saved_per_token(model: ModelConfig, a: int) -> float:
    """What fivefold.models.moe saves per token of a dropless MoE layer (replicated over tp,
    so no width is divided), counted from its forward with E experts, top-k, expert width F:

      router        its fp32 input (4D; in fp32 that is the MLP input itself), the scores
                    (4E, softmax or sigmoid output), the chosen ids (int64, 8k), the
                    renormalization's numerator and sum (4k + 4)
      dispatch      token and assignment ids of the sorted copies (int64, 2 x 8k), the
                    gathered copies (k a D)
      experts       SwiGLU per copy: w1 and w3 outputs, silu output, w2 input (4 k a F)
      combine       the expert outputs and their gates (k a D + 4k), the gated copies that
                    index_add sums (k a D)
      shared        a SwiGLU of the shared experts' width (4 a F_shared), which saves the
                    compute-dtype MLP input apart from the router's fp32 copy when a < 4
      aux losses    load balancing: a second score matrix and its sum (4E + 4); z-loss: the
                    fp32 logits and their log-sum-exp (4E + 4)

    A capacity factor drops copies: this is then the bound for no drops."""
    m = model.moe
    E, k, D = m.experts, m.top_k, model.hidden
    F = m.expert_ffn_hidden or model.ffn_hidden
    shared = m.shared_experts * F
    n = 4 * D + 4 * E + 8 * k + 4 * k + 4
    n += 16 * k + k * a * D
    n += 4 * k * a * F
    n += 2 * k * a * D + 4 * k
    if shared:
        n += 4 * a * shared + (a * D if a < 4 else 0)
    if m.aux_loss_weight:
        n += 4 * E + 4
    if m.z_loss_weight:
        n += 4 * E + 4
    return n


def moe_saved_constant(model: ModelConfig, a: int = 4) -> float:
    """Per-micro-batch bytes of an MoE layer that do not grow with tokens: the grouped
    matmul's int32 group offsets, the load-balancing loss's fp32 expert shares and, at a
    compute dtype under fp32 (a < 4), the router's fp32 weight copy that its
    `weight.float()` makes and its linear saves (fivefold.models.moe.MoE.route)."""
    m = model.moe
    return (4 * m.experts if m.expert_matmul == "grouped" else 0) + \
        (4 * m.experts if m.aux_loss_weight else 0) + \
        (4 * m.experts * model.hidden if a < 4 else 0)


def full_block_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                     sp: bool = False, layer: int = 0) -> float:
    """What one block holds while it is recomputed and differentiated (no recompute mode)."""
    return block_saved_bytes(model, tokens, act_bytes, tp, sp, "none", layer)


def root_saved_bytes(model: ModelConfig, tokens: int, act_bytes: int, tp: int = 1,
                     first: bool = True, last: bool = True, stack: Stack = FIVEFOLD,
                     sp: bool = False) -> float:
    """Bytes saved outside the blocks: token ids; final norm, head input, loss (its fp32
    log-softmax unless the stack's fused loss keeps only its logits buffer, which the
    simulator counts with the loss's other bytes). Under sequence parallelism the final norm
    runs on this rank's 1/tp of the tokens and the head saves its all-gathered input. With
    tp > 1 the vocabulary-parallel embedding and loss each keep a bool mask per token
    (fivefold.parallel.tensor, fivefold.parallel.vocab_parallel_loss) and the loss no fp32
    scalar; one process's cross-entropy keeps its 4-byte total weight. A stack release
    before its FlashAttention keeps the older GPT model's (activations_megatron2022)."""
    if stack.unfused_gpt_block:
        return gpt_root_saved_bytes(model, tokens, act_bytes, tp, first, last, sp)
    a = act_bytes
    n = 8 * tokens if first else 0.0
    if first and tp > 1:
        n += tokens  # the embedding's out-of-shard mask
    if last:
        D = model.hidden
        logp = 4 * model.vocab / tp if stack.loss_saves_fp32 else 0.0
        norm = ((4 + a) * D + 4) / (tp if sp else 1)
        n += tokens * (norm + a * D + logp + 8)
        n += tokens if tp > 1 else 4  # the loss's target mask, or its total weight
    return n


def layout_block_saved_bytes(model: ModelConfig, lay: ParallelPlan, layer: int,
                             stack: Stack = FIVEFOLD, act_bytes: int | None = None) -> float:
    """`block_saved_bytes` of block `layer` for one micro-batch of plan `lay` on one rank
    (its tokens: the micro-batch's share of a cp rank), with what autocast on fp32 weights
    adds where the stack trains a layout so (`layout_autocast`), as the block model
    (StageCosts.block_saved_bytes), the op trace's activation-offload copies and the memory
    report (rank_memory, at the `act_bytes` of the device it runs on) read it."""
    tokens = lay.micro_batch * model.seq_len // lay.cp
    a = act_bytes or PRECISION_BYTES[lay.precision]
    saved = block_saved_bytes(model, tokens, a, lay.tp, lay.sequence_parallel, lay.recompute,
                              layer, stack, fp8_input_copy(lay), ring_kv_heads(model, lay))
    if layout_autocast(lay, stack, a):
        saved += autocast_block_bytes(model, tokens, a, lay.recompute, layer)
    return saved


def layout_root_saved_bytes(model: ModelConfig, lay: ParallelPlan, first: bool, last: bool,
                            stack: Stack = FIVEFOLD, act_bytes: int | None = None) -> float:
    """`root_saved_bytes` of one micro-batch of plan `lay` on a stage (`first`, `last`), with
    autocast's terms where the stack keeps fp32 weights for the layout (`layout_autocast`);
    `act_bytes` as in `layout_block_saved_bytes`."""
    tokens = lay.micro_batch * model.seq_len // lay.cp
    a = act_bytes or PRECISION_BYTES[lay.precision]
    saved = root_saved_bytes(model, tokens, a, lay.tp, first, last, stack,
                             sp=lay.sequence_parallel)
    if layout_autocast(lay, stack, a):
        saved += autocast_root_bytes(model, tokens, a, last)
    return saved


def layout_autocast(lay: ParallelPlan, stack: Stack, act_bytes: int | None = None) -> bool:
    """Whether `stack` trains `lay` on fp32 weights under a half-precision autocast
    (Stack.autocast_fp32_weights: fivefold's update paths other than its data-parallel
    engine, planner.activations_autocast), which saves more than the compute-dtype model."""
    return stack.autocast_fp32_weights and fp32_weights_under_autocast(
        lay, act_bytes or PRECISION_BYTES[lay.precision])


def rotary_rows_bytes(model: ModelConfig, cp: int, table_bytes: int) -> float:
    """Bytes of the rotary rows of a context-parallel rank's tokens, per micro-batch and
    stage: the model's forward (fivefold.models.llama.Transformer.hidden_states, a pipeline
    stage's forward) gathers cos and sin at the rank's positions once, outside the blocks,
    by indexing, which makes new storages (without cp they are slices of the tables, model
    state), and every block's rotary saves them, 2 x seq_len / cp x d_head / 2 elements of
    the tables' dtype (`table_bytes`: the engine casts the buffers to its compute dtype,
    fp32 weights keep them fp32). The count charges them to the stage's first block that
    saves them; under activation offload each offloaded block copies them to the host while
    the device copy stays for the other blocks."""
    return 0.0 if cp == 1 else 2 * (model.seq_len // cp) * (model.d_head // 2) * table_bytes

