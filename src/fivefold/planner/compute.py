"""Compute time of one micro-batch through one layer, as a roofline per operator.

Every operator of a block is listed with its shape on one rank (after tensor, context and
expert parallelism have split it) and timed against the hardware profile
(fivefold.hardware) by fivefold.planner.op_prices: GEMMs by their roofline and the
profile's GEMM surface, attention by the kernel generation the stack runs, element-wise ops
by their HBM bytes. Backward runs two GEMMs of each forward one's size (input and weight
gradients). fp8 runs those of the linear layers whose two operands are in fp8 at the fp8
rate (the recipe's tensor classes, fivefold.parallel.fp8.recipe: switching a class off puts
the two GEMMs that read it back at the bf16 rate) and pays the casts (amax, scale,
transpose) of the classes in fp8 as memory traffic, by the recipe's scaling
(`fp8_cast_bytes`); attention, norms and the output head stay in bf16, as torchao's Float8
training does. The recipe's scaling picks the fp8 GEMMs' table (op_prices.gemm_table):
rowwise-scaled GEMMs run at the profile's measured rowwise rate and surface (Hopper:
h200_measured.json's rowwise column, 0.89-0.99 of the tensorwise rate per shape), and at its
fp8 rate where it measured none (Blackwell's published tables, Ampere).

Recomputation (`full`: the whole block's forward again before its backward; `selective`:
torchtitan's per-op policy, arXiv 2410.06511, which saves matmul and attention outputs except
every second matmul (wk, wo, w3 of a Llama block; wk, wo, w2 of a GELU block) and recomputes
those and every element-wise op) adds forward work to the backward. Model FLOPs follow
docs/planner.md: forward matmuls (attention scores and values over the full s x s square)
times three.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import ModelConfig
from fivefold.hardware import HardwareProfile
from fivefold.kernel_tables import attention_rate
from fivefold.parallel.fp8.recipe import fp8_gemms
from fivefold.planner.op_prices import (Gemm, attention_time, eltwise_time, gemm_time,
                                        math_ring_attention_time, torch_cp_merge_bytes,
                                        unfused_attention_time)
from fivefold.planner.stack import FIVEFOLD, Stack
from fivefold.validate import FP8_TENSORS


@dataclass(frozen=True)
class OpTimes:
    """Seconds of one micro-batch through one unit (a block or the head) on one rank."""

    fwd: float  # forward compute
    bwd: float  # backward compute: input and weight gradients
    wgrad: float  # the weight-gradient part of `bwd` (zero-bubble schedules move it)
    recompute: float  # forward work repeated in backward under the recompute mode
    model_flops: float  # forward + backward model FLOPs (the FLOP convention)
    hw_flops: float  # FLOPs executed, recomputation included


# The row-parallel linears of a block (Megatron 1D: attention's proj and the MLP's fc2).
ROW_PARALLEL = ("wo", "w2")
# Transformer Engine's ring-exchange TP overlap (fivefold.planner.stack: tp_overlap_chunks):
# the GEMMs an all-gather feeds or a reduce-scatter drains in forward; in backward the
# row-parallel ones, whose input gradient an all-gather of the output gradient feeds. MoE
# blocks' routed and shared experts are not among them (expert tensor parallelism is its own).
TP_RING_FORWARD = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def tp_ring_gemm_time(g: Gemm, tp: int, prof: HardwareProfile, fp8: bool,
                      act_bytes: int, recipe: str = "tensorwise") -> float:
    """`g` run as tp ring-exchange chunks of 1/tp of its rows: each chunk reads the whole
    weight and pays one launch."""
    return tp * gemm_time(Gemm(g.name, -(-g.m // tp), g.k, g.n), prof, fp8, act_bytes, recipe)


def newton_schulz_time(matrices: list[tuple[int, int]], prof: HardwareProfile,
                       steps: int = 5) -> float:
    """Muon's orthogonalization (torch.optim.Muon): per (rows, cols) matrix, `steps` quintic
    Newton-Schulz iterations in bf16 on the A x B orientation (A the smaller side), each the
    Gram matrix X X^T (A x B x A), its square (A x A x A) and the product with X (A x A x B)."""
    total = 0.0
    for rows, cols in matrices:
        a, b = sorted((rows, cols))
        total += steps * sum(gemm_time(g, prof, False, 2) for g in (
            Gemm("gram", a, b, a), Gemm("square", a, a, a), Gemm("apply", a, a, b)))
    return total


# torchao's Float8 tensor parallelism (Stack.fp8_shard_casts): the linear that carries each
# module's one input cast (its siblings share it), the siblings, and the row-parallel linears
# whose output gradient is cast on its sequence shard (ROW_PARALLEL).
SHARD_CAST_CARRIERS = ("wq", "w1")
SHARD_CAST_SHARERS = ("wk", "wv", "w3")


def fp8_cast_bytes(g: Gemm, act_bytes: int, fused: bool = False,
                   scaling: str = "tensorwise",
                   tensors: tuple[str, ...] = FP8_TENSORS,
                   shard_tp: int = 1) -> tuple[float, float]:
    """Forward and backward bytes of torchao-style dynamic fp8 scaling around one linear,
    for the tensor classes in fp8 (`tensors`: input m x k, weight k x n, grad_output m x n).

    Forward: amax of input and weight (read), then cast (read, write 1 byte). Backward,
    tensorwise: the same for the output gradient, plus fp8 transposes (read and write 1
    byte) of input, weight and gradient for the two backward GEMMs. Backward, rowwise: the
    scales run along the other axis, so input and weight are cast again from high precision
    and the output gradient twice (along n for the input gradient, along m for the weight
    gradient), each cast writing the layout its GEMM reads. `fused` (Transformer Engine,
    fivefold.planner.stack): the casts ride in the kernels that produce the activations and
    the weights are cast once per step, so only the fp8 copies of the input (forward) and
    output gradient (backward) are written. `shard_tp` > 1 (tensorwise; Stack.fp8_shard_casts,
    tp > 1 with sequence parallelism): the module's input is cast once on its sequence
    shard, 1/shard_tp of its rows, charged to wq or w1 (wk, wv, w3 share it), and wo's and
    w2's output gradients are cast on their shards; the transposes are of the gathered
    tensors, as before.
    """
    x = g.m * g.k if "input" in tensors else 0
    w = g.k * g.n if "weight" in tensors else 0
    dy = g.m * g.n if "grad_output" in tensors else 0
    if fused:
        return float(x), float(dy)
    cast = 2 * act_bytes + 1
    if scaling == "rowwise":
        return cast * (x + w), cast * (x + w + 2 * dy)
    x_cast, dy_cast = x, dy
    if shard_tp > 1:
        x_cast = (x / shard_tp if g.name in SHARD_CAST_CARRIERS
                  else 0 if g.name in SHARD_CAST_SHARERS else x)
        dy_cast = dy / shard_tp if g.name in ROW_PARALLEL else dy
    return cast * (x_cast + w), cast * dy_cast + 2 * (x + w + dy)


@dataclass(frozen=True)
class Shard:
    """How one rank sees a micro-batch: tokens, and the splits of tp, cp and sp."""

    micro_batch: int
    seq_len: int
    tp: int
    cp: int
    sp: bool
    ep: int
    precision: str
    recompute: str
    cp_mode: str = "ring"
    compiled: bool = False  # torch.compile fuses element-wise chains into single passes
    stack: Stack = FIVEFOLD  # the software's switches (fivefold.planner.stack)
    fp8_recipe: str = "tensorwise"  # precision fp8: the scaling (fivefold.parallel.fp8)
    fp8_tensors: tuple[str, ...] = FP8_TENSORS  # precision fp8: the classes in fp8
    expert_load: float = 1.0  # ep > 1: the busiest rank's routed rows over the mean
    etp: int = 1  # expert tensor parallelism (fivefold.expert_grid)
    split_backward: bool = False  # a zero-bubble schedule: recomputation reruns whole blocks

    def recompute_stops_early(self, moe: bool) -> bool:
        """Full recomputation of a dense block stops before its last GEMM under this stack
        (Stack.recompute_early_stop) unless a split backward recomputes whole blocks."""
        return (self.recompute == "full" and self.stack.recompute_early_stop and not moe
                and not self.split_backward)

    def passes(self, prof: HardwareProfile) -> float:
        return 1.0 if self.compiled or self.stack.fused_eltwise else prof.eff.eltwise_passes

    @property
    def eager_cp_merge(self) -> bool:
        """Ring CP whose partial outputs are merged by eager ops (an all-gather stack)."""
        return self.stack.cp_kv_exchange == "allgather" and self.cp_mode == "ring" and self.cp > 1

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch in this rank's GEMMs (cp splits the sequence)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def block_gemms(model: ModelConfig, sh: Shard, moe: bool) -> tuple[list[Gemm], list[Gemm]]:
    """(attention-side GEMMs, MLP-side GEMMs) of one block on one rank, forward."""
    n, D, d, tp = sh.tokens, model.hidden, model.d_head, sh.tp
    kv = max(1, model.n_kv_heads // tp) * d
    attn = [Gemm("wq", n, D, model.heads * d // tp), Gemm("wk", n, D, kv),
            Gemm("wv", n, D, kv), Gemm("wo", n, model.heads * d // tp, D)]
    if not moe:
        return attn, mlp_gemms(model.ffn_type, n, D, model.ffn_hidden // tp, "")
    m, follow = model.moe, sh.stack.experts_follow_tp  # (planner.stack experts_follow_tp)
    n_moe = n if follow else n / tp  # the experts' grid: the rank's 1/tp of the tokens, its
    routed = n_moe * m.top_k * sh.expert_load * (1 if follow else sh.etp)  # etp group's rows
    mlp = [Gemm("router", n_moe, D, m.experts)] + mlp_gemms(
        model.ffn_type, routed, D, m.expert_ffn_hidden // sh.stack.expert_width_split(
            tp, sh.etp), "expert.")  # the busiest rank's token-expert pairs
    if m.shared_experts:
        mlp += mlp_gemms(model.ffn_type, n_moe, D, m.shared_experts * m.expert_ffn_hidden
                         // (tp if follow else 1), "shared.")
    return attn, mlp


def mlp_gemms(ffn_type: str, n: int, D: int, F: int, prefix: str) -> list[Gemm]:
    gemms = [Gemm(prefix + "w1", n, D, F)]
    if ffn_type == "swiglu":
        gemms.append(Gemm(prefix + "w3", n, D, F))
    gemms.append(Gemm(prefix + "w2", n, F, D))
    return gemms


# The MoE GEMMs torchtitan's selective policy recomputes (its per-expert count is not
# modelled): the second matmul of each SwiGLU.
MOE_SELECTIVE_RECOMPUTED = ("wk", "wo", "w3", "expert.w3", "shared.w3")


def selective_recomputed(gemms: list[Gemm], moe: bool) -> tuple[str, ...]:
    """Names of the GEMMs `recompute = "selective"` runs again: every second matmul of a
    dense block in execution order (fivefold.memory.recompute's policy, torchtitan's)."""
    if moe:
        return MOE_SELECTIVE_RECOMPUTED
    return tuple(g.name for g in gemms[1::2])


def block_attention_time(model: ModelConfig, sh: Shard, prof: HardwareProfile
                         ) -> tuple[float, float]:
    """(forward s, backward s) of one block's attention kernels on one rank, as the stack runs
    them (its kernel generation on the profile's architecture and its ring kernel; an
    all-gather stack's eager merges excluded)."""
    heads = model.heads // sh.tp
    if sh.cp > 1 and sh.cp_mode == "ring" and sh.stack.ring_kernel == "math":
        return math_ring_attention_time(sh.micro_batch, heads,
                                        max(1, model.n_kv_heads // sh.tp), sh.seq_len,
                                        model.d_head, sh.cp, prof)
    generation = sh.stack.attention_generation(prof.architecture)
    if generation == "unfused":
        return unfused_attention_time(sh.micro_batch, heads, sh.seq_len, model.d_head, sh.cp,
                                      prof, sh.act_bytes)
    return attention_time(sh.micro_batch, heads, sh.seq_len, model.d_head, sh.cp, prof,
                          sh.cp_mode != "ulysses", sh.precision,
                          attention_rate(prof.attention_generations, generation),
                          not sh.eager_cp_merge)


def block_times(model: ModelConfig, sh: Shard, prof: HardwareProfile, moe: bool) -> OpTimes:
    """Compute seconds and FLOPs of one block for one micro-batch on one rank."""
    a, fp8 = sh.act_bytes, sh.precision == "fp8"
    attn_g, mlp_g = block_gemms(model, sh, moe)
    gemms = attn_g + mlp_g
    in_fp8 = fp8_gemms(sh.fp8_tensors)  # which of a linear's three GEMMs run in fp8
    ring_chunked = sh.stack.tp_overlap_chunks and sh.stack.overlaps_tp_collectives(sh.tp, sh.sp)
    shard_tp = sh.tp if sh.stack.fp8_shard_casts and sh.sp else 1
    gemm_s = wgrad_s = bwd_gemm_s = selective_s = cast_f = cast_b = 0.0
    selected = selective_recomputed(gemms, moe)
    for g in gemms:
        quantized = fp8 and g.name != "router"
        t_fwd, t_dgrad, t_wgrad = (gemm_time(g, prof, quantized and kind in in_fp8, a,
                                             sh.fp8_recipe)
                                   for kind in ("forward", "grad_input", "grad_weight"))
        if ring_chunked and g.name in TP_RING_FORWARD:
            t_fwd = tp_ring_gemm_time(g, sh.tp, prof, quantized and "forward" in in_fp8, a,
                                      sh.fp8_recipe)
            if g.name in ROW_PARALLEL:
                t_dgrad = tp_ring_gemm_time(g, sh.tp, prof, quantized and "grad_input"
                                            in in_fp8, a, sh.fp8_recipe)
        gemm_s += t_fwd
        wgrad_s += t_wgrad
        bwd_gemm_s += t_dgrad + t_wgrad
        if g.name in selected:
            selective_s += t_fwd
        if quantized:
            cf, cb = fp8_cast_bytes(g, a, sh.stack.fp8_fused_casts, sh.fp8_recipe,
                                    sh.fp8_tensors, shard_tp)
            cast_f, cast_b = cast_f + cf, cast_b + cb
    heads = model.heads // sh.tp
    at_f, at_b = block_attention_time(model, sh, prof)
    if sh.eager_cp_merge:
        kv_heads = heads if sh.stack.sdpa_repeats_kv else max(1, model.n_kv_heads // sh.tp)
        mf, mb = torch_cp_merge_bytes(sh.tokens * heads * model.d_head,
                                      sh.tokens * kv_heads * model.d_head, sh.cp, a)
        at_f += eltwise_time(mf, prof, 5 * sh.cp, 1.0)
        at_b += eltwise_time(mb, prof, 6 * sh.cp, 1.0)
    ew_bytes = block_eltwise_bytes(model, sh, moe)
    ew_f = eltwise_time(ew_bytes, prof, 12, sh.passes(prof))
    ew_b = eltwise_time(2 * ew_bytes, prof, 24, sh.passes(prof))
    cast_tf = eltwise_time(cast_f, prof, 0, 1.0)
    cast_tb = eltwise_time(cast_b, prof, 0, 1.0)
    f = gemm_s + at_f + ew_f + cast_tf
    b = bwd_gemm_s + at_b + ew_b + cast_tb
    if sh.stack.selective_modules:  # norms and activations only, no GEMM
        selective_s, selected = 0.0, ()
    last = t_fwd if sh.recompute_stops_early(moe) else 0.0  # the block's last GEMM, w2
    rec = {"full": f - last, "selective": selective_s + ew_f + cast_tf * selective_s / gemm_s,
           "none": 0.0}[sh.recompute]
    model_fl = 3 * (sum(g.flops for g in gemms) + 4 * sh.micro_batch * heads * model.d_head
                    * sh.seq_len * sh.seq_len / sh.cp)
    rec_fl = {"full": model_fl / 3 - (gemms[-1].flops if last else 0.0), "none": 0.0,
              "selective": sum(g.flops for g in gemms if g.name in selected)}
    return OpTimes(f, b, wgrad_s, rec, model_fl, model_fl + rec_fl[sh.recompute])


def block_eltwise_bytes(model: ModelConfig, sh: Shard, moe: bool) -> float:
    """Forward bytes of one block's element-wise ops (norms, rotary, activation, residuals)."""
    a, n, tp = sh.act_bytes, sh.tokens, sh.tp
    D = model.hidden
    d_side = D / tp if sh.sp else D  # tensors of width D are split by sequence parallelism
    q, kv = model.heads * model.d_head / tp, max(1, model.n_kv_heads // tp) * model.d_head
    if moe:
        m = model.moe
        width = (m.top_k * sh.expert_load + m.shared_experts) * m.expert_ffn_hidden
        f = width / tp  # split over tp, or (experts' grid) on the rank's 1/tp of the tokens
    else:
        f = model.ffn_hidden / tp
    act = 3 * f if model.ffn_type == "swiglu" else 2 * f
    per_token = 2 * 2 * d_side + 2 * (q + kv) + 2 * q + act + 2 * 3 * d_side
    if moe:  # (un)permute rows (the experts' grid: the etp group's, of 1/tp of the tokens)
        per_token += 2 * model.hidden * model.moe.top_k * sh.expert_load * (
            1 if sh.stack.experts_follow_tp else sh.etp / tp)
    return a * n * per_token


def head_times(model: ModelConfig, sh: Shard, prof: HardwareProfile) -> OpTimes:
    """Final norm, output projection (vocab-parallel over tp) and fp32 cross-entropy."""
    a = sh.act_bytes
    n = sh.tokens
    v = -(-model.vocab // sh.tp)  # the vocabulary-parallel shard, padded
    g = Gemm("output", n, model.hidden, v)
    t = gemm_time(g, prof, False, a)
    logits = n * v
    loss_f = eltwise_time(logits * (a + 4 + 8), prof, 4, 1.0)
    loss_b = eltwise_time(logits * (8 + 4 + a), prof, 4, 1.0)
    norm = eltwise_time(2 * a * n * model.hidden, prof, 2, sh.passes(prof))
    fl = 3 * g.flops
    return OpTimes(t + loss_f + norm, 2 * t + loss_b + 2 * norm, t, 0.0, fl, fl)


def embedding_times(model: ModelConfig, sh: Shard, prof: HardwareProfile) -> OpTimes:
    """Token lookup forward; backward scatters into a dense gradient of the table."""
    a = sh.act_bytes
    n = sh.tokens
    rows = -(-model.vocab // sh.tp)
    fwd = eltwise_time(2 * a * n * model.hidden, prof, 1, 1.0)
    bwd = eltwise_time(a * (rows * model.hidden + 2 * n * model.hidden), prof, 2, 1.0)
    return OpTimes(fwd, bwd, bwd, 0.0, 0.0, 0.0)
