"""The compute ops of one block (and of the output head) on one rank, per pass, predicted.

What the runtime's kernels run for a micro-batch of n = micro_batch x seq_len / cp tokens
(TeraPipe: x the slice's share) on one rank (tensor parallelism keeps n: with sequence
parallelism the column-parallel linears gather the sequence back), read off the model
(fivefold.models.llama, .moe, .mlp) and the layouts that rewrite it (fivefold.parallel.tensor,
.context, .expert):

  linear (in -> out)   forward GEMM (M, N, K) = (n, out, in); backward the input's gradient
                       (n, in, out) and the weight's (out, in, n). wq, wk, wv, w1, w3 are
                       column-parallel under tp (out / tp), wo and w2 row-parallel (in / tp);
                       the head is vocabulary-parallel (ceil(V / tp) rows), tied or not
  attention            SDPA's fused kernel, forward and backward, over (B, H, Hkv, T, S, E):
                       the rank's heads (H / tp; Ulysses H / (tp u) over the whole sequence),
                       and the key/value heads the kernel sees (repeated to H on the CPU, as
                       fivefold.models.llama does; the grouped heads on CUDA)
  ring attention       the blockwise math kernel (fivefold.parallel.context.block_attention):
                       per ring step the visible zigzag block (diagonal causal, then half the
                       rows or half the keys), per query chunk two batched GEMMs forward
                       (scores, output) and five backward (scores again, dv, dout v^T,
                       dq, dk), in fp32 for 16-bit inputs, batch B x H;
                       the hybrid runs it on H / u heads over T / r tokens
  MoE layer            the fp32 router (n', X, D) on the rank's n' = n / tp tokens, the routed
                       experts as grouped GEMMs (torch._grouped_mm, `model.moe.expert_matmul`
                       = "grouped") over n' x top_k rows at balanced routing (under ep the
                       rows this rank's X / ep experts receive: exact only summed over the ep
                       ranks, since the router decides them), the shared experts as a SwiGLU

Each forward op carries the selective-recomputation policy's class
(fivefold.memory.recompute): "mm" (mm/addmm: the policy keeps every second one), "sdpa"
(kept) or "other" (recomputed). Dropout, fp8 and the padded or looped expert matmuls are not
modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.config import Config
from fivefold.models.description import expert_ffn, is_moe_layer
from fivefold.parallel.context.heads import ulysses_kv_heads
from fivefold.parallel.pipeline.partition import slice_bounds
from fivefold.parallel.plan import ParallelPlan

QUERY_CHUNK, CPU_SCORE_BYTES = 512, 8 << 20  # fivefold.parallel.context.block_attention
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(slots=True)
class Op:
    """One op of one rank's step. `shape`: gemm (M, N, K, batch), grouped_gemm (M, N, K,
    groups), attention (B, H, Hkv, T, S, E); collectives and copies have `bytes` only.
    `deps`: indices of the ops (in the rank's list) this one waits for."""

    kind: str  # gemm | grouped_gemm | attention | elementwise | collective | send | recv
    #            | optimizer | host_copy | disk_copy
    name: str
    phase: str  # forward | recompute | backward | input_grad | weight_grad | step
    stream: str = "compute"  # compute | comm:<axis> | host | disk
    shape: tuple[int, ...] = ()
    dtype: str = ""
    bytes: int = 0
    causal: bool = False
    kernel: str = ""  # attention: "sdpa" | "ring-math"; collectives: the op
    axis: str = ""
    group: int = 0
    purpose: str = ""
    micro_batch: int = -1
    deps: tuple[int, ...] = ()
    ragged: str = ""  # grouped_gemm: the dimension the routing decides ("M" or "K")
    step: int = -1  # ring attention's GEMMs: the ring step
    policy: str = ""  # forward compute: "mm" | "sdpa" | "other" (module docstring)


@dataclass(frozen=True)
class Pass:
    """A forward op with the backward ops it causes: the input's gradient, the weight's."""

    forward: Op
    input_grad: tuple[Op, ...] = ()
    weight_grad: tuple[Op, ...] = ()


def _linear(name: str, n: int, d_in: int, d_out: int, dtype: str) -> Pass:
    g = lambda phase, m, nn, k: Op("gemm", name, phase, shape=(m, nn, k, 1), dtype=dtype)
    return Pass(replace(g("forward", n, d_out, d_in), policy="mm"),
                (g("input_grad", n, d_in, d_out),), (g("weight_grad", d_out, d_in, n),))


def _grouped(name: str, rows: int, d_in: int, d_out: int, groups: int, dtype: str) -> Pass:
    g = lambda phase, m, nn, k, ragged: Op("grouped_gemm", name, phase,
                                           shape=(m, nn, k, groups), dtype=dtype,
                                           ragged=ragged)
    return Pass(replace(g("forward", rows, d_out, d_in, "M"), policy="other"),
                (g("input_grad", rows, d_in, d_out, "M"),),
                (g("weight_grad", d_out, d_in, rows, "K"),))


def _sdpa(name: str, shape: tuple[int, ...], dtype: str, causal: bool = True) -> Pass:
    a = lambda phase: Op("attention", name, phase, shape=shape, dtype=dtype, causal=causal,
                         kernel="sdpa")
    return Pass(replace(a("forward"), policy="sdpa"), (a("input_grad"),))


def _ring_blocks(name: str, b: int, heads: int, tokens: int, e: int, ring: int, index: int,
                 dtype: str, device: str) -> list[Pass]:
    """The math kernel's batched GEMMs of ring attention on ring rank `index` of `ring`
    (fivefold.parallel.context.ring_attention: zigzag chunks of c = tokens / 2). The kernel
    runs forward and backward in its accumulation dtype (fp32 for 16-bit inputs; its forward
    turns the engine's autocast off). Each chunk's keys: all of an off-diagonal block's, a
    diagonal block's up to the chunk's last row."""
    acc = "fp32" if dtype in ("bf16", "fp16") else dtype
    c, bh, forward, backward = tokens // 2, b * heads, [], []
    for step in range(ring):
        src = (index - step) % ring
        rows, keys, causal = ((tokens, tokens, True) if src == index else
                              (tokens, c, False) if src < index else (c, tokens, False))
        per = QUERY_CHUNK if device != "cpu" else max(1, min(
            QUERY_CHUNK, CPU_SCORE_BYTES // (bh * keys * DTYPE_BYTES[acc])))
        for lo in range(0, rows, per):
            t = min(lo + per, rows) - lo
            s = min(lo + per, rows) if causal else keys  # the keys a chunk sees
            g = lambda phase, m, nn, k: Op("gemm", name, phase, shape=(m, nn, k, bh),
                                           dtype=acc,
                                           causal=causal, kernel="ring-math", step=step,
                                           policy="other")
            forward += [g("forward", t, s, e), g("forward", t, e, s)]
            backward += [g("input_grad", t, s, e), g("input_grad", s, e, t),
                         g("input_grad", t, s, e), g("input_grad", t, e, s),
                         g("input_grad", s, e, t)]
    # the whole backward hangs on the first pass, so that a reversed block keeps its order
    return [Pass(forward[0], tuple(backward))] + [Pass(op) for op in forward[1:]]


def tokens(cfg: Config, lay: ParallelPlan, piece: int = 0) -> tuple[int, int]:
    """(first, end) of a rank's tokens of each sequence in token slice `piece` (TeraPipe's
    near-equal slices, fivefold.parallel.pipeline.partition; else the cp rank's share)."""
    return slice_bounds(cfg.model.seq_len // lay.cp, lay.slices)[piece]


def block_passes(cfg: Config, lay: ParallelPlan, layer: int, rank: int, dtype: str,
                 device: str, piece: int = 0) -> list[Pass]:
    """The compute of block `layer` for one micro-batch (of token slice `piece`) on global
    rank `rank`, in the forward's order (the order the selective policy counts matmuls in).
    A TeraPipe slice after the first attends to the earlier slices' cached keys too, through
    SDPA with a mask (fivefold.parallel.pipeline.terapipe): not causal to the kernel."""
    m, t = cfg.model, lay.tp
    lo, hi = tokens(cfg, lay, piece)
    n, e = lay.micro_batch * (hi - lo), m.d_head
    h, kv = m.heads // t, m.n_kv_heads // t
    pre = f"layers.{layer}."
    out = [_linear(pre + "attention.wq", n, m.hidden, h * e, dtype),
           _linear(pre + "attention.wk", n, m.hidden, kv * e, dtype),
           _linear(pre + "attention.wv", n, m.hidden, kv * e, dtype)]
    ring, u = lay.context_degrees
    core = pre + "attention.core"
    if ring > 1:  # ring or hybrid: the math kernel on H / u heads over T / r tokens
        cp_index = (rank // t) % lay.cp
        out += _ring_blocks(core, lay.micro_batch, h // u, m.seq_len // ring, e, ring,
                            cp_index // u, dtype, device)
    else:
        heads = h // u
        kv_kernel = heads if device == "cpu" else (ulysses_kv_heads(kv, u) // u if u > 1
                                                   else kv)
        seq = m.seq_len if u > 1 else hi  # Ulysses: the whole sequence on H / u heads
        out.append(_sdpa(core, (lay.micro_batch, heads, kv_kernel, seq - lo, seq, e), dtype,
                         causal=lo == 0))
    out.append(_linear(pre + "attention.wo", n, h * e, m.hidden, dtype))
    if is_moe_layer(m, layer):
        out += _moe_passes(cfg, lay, pre + "mlp.", n // t, dtype)
        return out
    f = m.ffn_hidden // t
    out.append(_linear(pre + "mlp.w1", n, m.hidden, f, dtype))
    if m.ffn_type == "swiglu":
        out.append(_linear(pre + "mlp.w3", n, m.hidden, f, dtype))
    out.append(_linear(pre + "mlp.w2", n, f, m.hidden, dtype))
    return out


def _moe_passes(cfg: Config, lay: ParallelPlan, pre: str, n: int, dtype: str) -> list[Pass]:
    m, moe = cfg.model, cfg.model.moe
    if moe.expert_matmul != "grouped" or moe.capacity_factor is not None or lay.etp > 1:
        raise ValueError("the op trace models dropless grouped experts without etp "
                         f"(expert_matmul={moe.expert_matmul!r}, capacity_factor="
                         f"{moe.capacity_factor}, etp={lay.etp})")
    ffn = expert_ffn(m)
    rows, local = n * moe.top_k, moe.experts // lay.ep
    out = [_linear(pre + "router", n, m.hidden, moe.experts, "fp32"),
           _grouped(pre + "w1", rows, m.hidden, ffn, local, dtype),
           _grouped(pre + "w3", rows, m.hidden, ffn, local, dtype),
           _grouped(pre + "w2", rows, ffn, m.hidden, local, dtype)]
    if moe.shared_experts:
        f = moe.shared_experts * ffn
        out += [_linear(pre + "shared.w1", n, m.hidden, f, dtype),
                _linear(pre + "shared.w3", n, m.hidden, f, dtype),
                _linear(pre + "shared.w2", n, f, m.hidden, dtype)]
    return out


def head_pass(cfg: Config, lay: ParallelPlan, dtype: str, piece: int = 0) -> Pass:
    """The output head (vocabulary-parallel under tp, the tied embedding's rows or its own)."""
    lo, hi = tokens(cfg, lay, piece)
    return _linear("output", lay.micro_batch * (hi - lo), cfg.model.hidden,
                   -(-cfg.model.vocab // lay.tp), dtype)


def early_stop(cfg: Config, layer: int) -> bool:
    """Whether recomputing block `layer` stops before its last GEMM: torch's non-reentrant
    checkpoint stops once the backward has every tensor it saved, and the output of the
    block's last GEMM (a dense MLP's w2, or an MoE layer's shared experts' w2) is saved by
    nothing, unless the MoE layer's auxiliary loss, computed after it from the router's
    logits, still has to be rebuilt."""
    moe = cfg.model.moe
    if not is_moe_layer(cfg.model, layer):
        return True
    return bool(moe.shared_experts) and not (moe.aux_loss_weight or moe.z_loss_weight)


def recomputed(passes: list[Pass], mode: str, whole: bool = False) -> list[Op]:
    """The forward ops a block's backward runs again: all under "full"; under "selective"
    the policy's uncached ones (the even-numbered mm/addmm and every "other" op); the last
    GEMM only when `whole` (not `early_stop`, or a split backward, which recomputes whole
    blocks, as fivefold.planner.ledger_model counts the MLP's closing collective)."""
    if not whole:
        passes = passes[:-1]
    if mode == "full":
        return [replace(p.forward, phase="recompute") for p in passes]
    out, mms = [], 0
    for p in passes:
        if p.forward.policy == "mm":
            mms += 1
            if mms % 2 == 1:
                continue
        elif p.forward.policy == "sdpa":
            continue
        out.append(replace(p.forward, phase="recompute"))
    return out
