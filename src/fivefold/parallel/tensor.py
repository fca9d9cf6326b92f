"""1D tensor parallelism (Megatron-LM) with optional sequence parallelism, applied from outside.

`apply_tensor_parallel(model, tp_axis, sequence_parallel)` rewrites a plain
fivefold.models.llama.Transformer in place so that the t ranks of the "tp" axis share every
block (Megatron-LM, arXiv 1909.08053, Sec. 3, Fig. 3; 2104.04473, Sec. 2.3):

  attention  wq, wk, wv  column-parallel: rank r keeps query heads [rH/t, (r+1)H/t) and
                         key/value heads [rK/t, (r+1)K/t); with grouped-query attention the
                         query heads of a group land on the rank of their shared kv head
             wo          row-parallel: the matching input columns; the partial outputs sum
  MLP        w1, w3      column-parallel, F/t inner features each (SwiGLU; GELU has only w1)
             w2          row-parallel
  embedding              vocabulary-parallel: rank r keeps rows [rV'/t, (r+1)V'/t); a token
                         outside them looks up zero, so the sum over ranks is the embedding
  output head            vocabulary-parallel (the same shard when tied); `model(tokens)` then
                         returns this rank's (B, T, V'/t) logits and the loss is
                         fivefold.parallel.vocab_parallel_loss, which never gathers them
  norms                  replicated
  MoE layer              replicated (router, experts, shared experts): it runs whole on every
                         tp rank, on the same tokens, with no region around it; experts are
                         split by expert parallelism instead (fivefold.parallel.expert).
                         With sequence parallelism it runs on the rank's T/t tokens
                         (fivefold.parallel.moe_tokens sums its gradients over tp).

Each attention and MLP is a region entered through Megatron's f and left through g
(fivefold.parallel.tensor_comm): one all-reduce forward and one backward per region. With
`sequence_parallel` (2205.05198, Sec. 4.2.2) the residual stream, the norms and the region
inputs stay split along the sequence (B, T/t, D); regions are entered by an all-gather and left
by a reduce-scatter (the same bytes as the all-reduce they replace), the column-parallel
linears keep only the sequence shard of their input and gather it again in backward, and the
norm gains, which now see T/t tokens each, have their gradients summed over the axis.
Explicit module hooks and autograd functions, not DTensor: every collective is on the ledger.

Parameters keep their plain names (layers.0.attention.wq.weight, ...) and each shard is the
slice of the plain model's value (for a freshly built model: of `init_tensor(name,
full_shape)`), so a tensor-parallel model starts bit-identical to the single-process one and
the data-parallel engine flattens the local shards like any parameters.

Vocabulary padding: the vocabulary V is padded to V' = ceil(V/t)*t, a multiple of tp, by
appending V' - V (< t) rows to the embedding and output matrices. The real rows are the plain
model's; the padding rows are zeros. No token id reaches them and the loss leaves their logits
out, so their gradient is zero, AdamW keeps them at zero, and they are never predicted
(`GatheredLogits` drops their columns). `gather_full_state` returns the unpadded tensors.

Activation bytes kept for backward per layer (`activation_bytes_per_layer`), fp32, batch b,
sequence s, width h, heads a of width e (h' = ae), MLP width f; derived from what each
operation of this block saves (measured with saved_tensors_hooks in the tests):

  two RMSNorms           input, normalized input (bsh each), 1/rms (bs)      4bsh + 2bs
  region inputs          attention input (wq, wk, wv), MLP input (w1, w3)    2bsh
  attention (SDPA)       q, k, v (after the GQA repeat), output, logsumexp   4bsh' + bas
  wo input               the heads laid out as (b, s, h'), a copy unless     bsh'
                         one head per rank, where it is the output itself
  SwiGLU                 w1 and w3 outputs, silu output, product (w2 input)  4bsf (GELU 2bsf)

so, for SwiGLU, 4 bytes x (6bsh + 5bsh' + 4bsf + 2bs + bas) without tensor parallelism; with
tp the head and MLP terms divide by t, 4(6bsh + 2bs + (5bsh' + 4bsf + bas)/t); with sequence
parallelism everything divides by t. This is 2205.05198's sbh(34 + 5as/h) ->
sbh(10 + 24/t + 5as/(ht)) -> sbh/t (34 + 5as/h) (Sec. 4.1-4.2, 16-bit activations) for this
block: fp32, no dropout
masks, RMSNorm, SwiGLU, and flash-style attention (the fused SDPA kernel, also on CPU), which
keeps a logsumexp (bas) instead of the s x s scores, softmax and mask (the 5as/h term). On
CUDA the model hands SDPA the K shared key/value heads without repeating them, so there k and
v count K/H of their term above; the formula is the CPU's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.config import ModelConfig
from fivefold.models.description import MOE_PLACEMENTS, VOCAB_PARTS, name_in_part, placement
from fivefold.models.llama import Transformer
from fivefold.models.moe import MoE
from fivefold.parallel.grad_reduce import sum_norm_gain_grads
from fivefold.parallel.tensor_comm import (SharedRegather, copy_to_tp, gather_from_sp,
                                           gather_stacked, linear_regathered,
                                           reduce_from_tp, scatter_to_sp)


# ---------------------------------------------------------------- placements, as data

def split_dim(name: str) -> int | None:
    """The dim along which parameter `name` is split over the tp ranks; None: replicated.

    The model description's placement (fivefold.models.description): column-parallel weights
    and biases (Qwen2's q/k/v biases) split their output features, row-parallel weights their
    input features, vocabulary matrices their rows. An MoE layer's parameters (router,
    experts, shared experts) are replicated: the runtime runs MoE layers whole on every tp
    rank (`apply_tensor_parallel`).
    """
    if name_in_part(name) in MOE_PLACEMENTS:
        return None
    return placement(name).tp_dim


def _is_vocab(name: str) -> bool:
    return placement(name).part in VOCAB_PARTS


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel degree."""
    return -(-vocab // tp) * tp


def shard_tensor(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of parameter `name` (vocabulary matrices padded with zero rows)."""
    dim = split_dim(name)
    if dim is None:
        return full.clone()
    if _is_vocab(name):
        full = F.pad(full, (0, 0, 0, padded_vocab(full.shape[0], tp) - full.shape[0]))
    size = full.shape[dim] // tp
    return full.narrow(dim, rank * size, size).clone()


def unshard_tensor(name: str, shards: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """The full parameter from every rank's part, in rank order (vocabulary padding dropped)."""
    dim = split_dim(name)
    if dim is None:
        return shards[0]
    full = torch.cat(shards, dim)
    return full[:vocab] if _is_vocab(name) else full


@torch.no_grad()
def gather_full_state(state: dict[str, torch.Tensor], vocab: int,
                      axis: Axis) -> dict[str, torch.Tensor]:
    """Every parameter's full value on every rank, from this rank's tensor-parallel parts."""
    if axis.size == 1:  # whole already (and possibly an MoE model's, which tp does not split)
        return dict(state)
    out = {}
    for name, part in state.items():
        if split_dim(name) is None:
            out[name] = part
            continue
        parts = gather_stacked(part, axis, "state_dict")
        out[name] = unshard_tensor(name, list(parts.unbind(0)), vocab)
    return out


# ---------------------------------------------------------------- the parallel modules

class VocabParallelEmbedding(nn.Module):
    """Rows [r*V'/t, (r+1)*V'/t) of the embedding; the lookup is summed (or reduce-scattered
    along the sequence, with sequence parallelism) over the tp ranks."""

    def __init__(self, weight_shard: torch.Tensor, axis: Axis, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.vocab_start = axis.rank * weight_shard.shape[0]

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        local_BT = tokens_BT - self.vocab_start
        outside_BT = (local_BT < 0) | (local_BT >= self.weight.shape[0])
        x_BTD = F.embedding(local_BT.masked_fill(outside_BT, 0), self.weight)
        x_BTD = x_BTD.masked_fill(outside_BT[..., None], 0.0)
        if self.sequence_parallel:
            return scatter_to_sp(x_BTD, self.axis)
        return reduce_from_tp(x_BTD, self.axis)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"rows {self.vocab_start}..{self.vocab_start + rows - 1}, dim {dim}"


class TensorParallelRegion:
    """Entry and exit of one attention or MLP, installed as its forward pre-hook and hook.

    Without sequence parallelism: f on the input, g on the output. With it: all-gather the
    sequence on entry (and remember the shard for the region's column-parallel linears),
    reduce-scatter it on exit.
    """

    def __init__(self, axis: Axis, sequence_parallel: bool):
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.sp_input: tuple[torch.Tensor, torch.Tensor, SharedRegather] | None = None

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if not self.sequence_parallel:
            return (copy_to_tp(x, self.axis), *rest)
        full = gather_from_sp(x, self.axis)
        self.sp_input = (full, x, SharedRegather(self.axis))
        return (full, *rest)

    def leave(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        self.sp_input = None
        if self.sequence_parallel:
            return scatter_to_sp(out, self.axis)
        return reduce_from_tp(out, self.axis)


class ColumnParallelLinear(nn.Module):
    """x W_r^T (+ b_r) with W_r, b_r this rank's rows of the output features. Inside a
    sequence-parallel region it keeps only the sequence shard of its input for backward."""

    def __init__(self, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None,
                 region: TensorParallelRegion):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.bias = None if bias_shard is None else nn.Parameter(bias_shard)
        self.region = region

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        sp_input = self.region.sp_input
        if sp_input is not None and x_BTD is sp_input[0] and torch.is_grad_enabled():
            _, x_local, shared = sp_input
            out = linear_regathered(x_BTD, x_local, self.weight, shared)
            return out if self.bias is None else out + self.bias
        return F.linear(x_BTD, self.weight, self.bias)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in_features={in_features}, out_features={out_features} (this rank's rows)"


class GatheredLogits(nn.Module):
    """A tensor-parallel model seen whole: tokens (B, T) -> full-vocabulary logits (B, T, V).

    For sampling, where every rank needs the whole distribution of one position: the vocabulary
    shards are all-gathered (purpose "logits") and the padding columns dropped. With sequence
    parallelism the window is padded on the right to a multiple of tp (the model is causal, so
    the padding does not change the logits of the real positions).
    """

    def __init__(self, model: Transformer, axis: Axis, sequence_parallel: bool):
        super().__init__()
        self.model, self.cfg = model, model.cfg
        self.axis, self.sequence_parallel = axis, sequence_parallel

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        T = tokens_BT.shape[1]
        if self.sequence_parallel:
            tokens_BT = F.pad(tokens_BT, (0, -T % self.axis.size))
        parts = gather_stacked(self.model(tokens_BT), self.axis, "logits")
        return parts.movedim(0, -2).flatten(-2)[:, :T, :self.cfg.vocab]


# ---------------------------------------------------------------- the rewrite

def _shard_of(name: str, param: torch.Tensor, axis: Axis) -> torch.Tensor:
    return shard_tensor(name, param.detach(), axis.size, axis.rank)


@torch.no_grad()
def apply_tensor_parallel(model: Transformer, tp_axis: Axis,
                          sequence_parallel: bool) -> Transformer:
    """Split `model` over `tp_axis` in place (see the module docstring); returns it.

    The config must already be validated for this degree (fivefold.validate): heads, kv_heads
    and ffn_hidden divisible by tp, and seq_len too with sequence parallelism. `model` may
    also be one pipeline stage (fivefold.parallel.pipeline.stage): the embedding, final norm
    and head it does not hold are skipped.
    """
    cfg, t = model.cfg, tp_axis.size
    assert cfg.heads % t == 0 and cfg.n_kv_heads % t == 0 and cfg.ffn_hidden % t == 0, (
        f"tp {t} must divide heads {cfg.heads}, kv_heads {cfg.n_kv_heads} and ffn_hidden "
        f"{cfg.ffn_hidden}")
    sp = sequence_parallel
    if hasattr(model, "tok_embeddings"):
        model.tok_embeddings = VocabParallelEmbedding(
            _shard_of("tok_embeddings.weight", model.tok_embeddings.weight, tp_axis), tp_axis, sp)
    if getattr(model, "output", None) is not None:
        model.output.weight = nn.Parameter(_shard_of("output.weight", model.output.weight,
                                                     tp_axis))
        model.output.out_features = model.output.weight.shape[0]
    for i, block in enumerate(model.layers):
        # an MoE layer runs whole on every tp rank, on the same replicated tokens (with
        # sequence parallelism on the rank's shard): no region around it
        regions = ("attention",) if isinstance(block.mlp, MoE) else ("attention", "mlp")
        for region_name in regions:
            region_module = getattr(block, region_name)
            region = TensorParallelRegion(tp_axis, sp)
            for child, linear in list(region_module.named_children()):
                name = f"layers.{i}.{region_name}.{child}"
                shard = _shard_of(f"{name}.weight", linear.weight, tp_axis)
                if split_dim(f"{name}.weight") == 0:
                    bias = (None if linear.bias is None else
                            _shard_of(f"{name}.bias", linear.bias, tp_axis))
                    setattr(region_module, child, ColumnParallelLinear(shard, bias, region))
                else:  # row-parallel: each rank would add a bias before the sum
                    assert linear.bias is None, f"{name} has a bias; row-parallel needs none"
                    linear.weight = nn.Parameter(shard)
                    linear.in_features = shard.shape[1]
            region_module.register_forward_pre_hook(region.enter)
            region_module.register_forward_hook(region.leave)
        block.attention.n_heads //= t
        block.attention.n_kv_heads //= t
    if hasattr(model, "norm"):
        model.norm.register_forward_hook(
            lambda module, args, out: (gather_from_sp(out, tp_axis) if sp else
                                       copy_to_tp(out, tp_axis)))
    if sp:  # replicated gains see T/t tokens per rank: their gradients are partial sums
        for name, param in model.named_parameters():  # (MoE layers: fivefold.parallel.moe_tokens)
            if split_dim(name) is None and name_in_part(name) not in MOE_PLACEMENTS:
                sum_norm_gain_grads(param, tp_axis)
    return model


# ---------------------------------------------------------------- training-step helpers

def counted_masks(units, tp_rank: int) -> list[torch.Tensor | None]:
    """Over each flat unit's shard (fivefold.parallel.flat_unit): True where this tp rank
    adds the element to the gradient norm (fivefold.parallel.grad_clip). Split parameters
    count on every tp rank (each holds its own shard), replicated ones (norm gains, equal on
    every tp rank) on tp rank 0 only, so the sum over data-parallel shards and tp ranks counts
    each element of the plain model exactly once. None: every element (tp rank 0)."""
    if tp_rank == 0:
        return [None] * len(units)
    masks = []
    for unit in units:
        mask = torch.zeros(unit.padded, dtype=torch.bool, device=unit.device)
        for name, off, n in zip(unit.names, unit.offsets, unit.numels):
            mask[off:off + n] = split_dim(name) is not None
        masks.append(mask[unit.shard_slice])
    return masks


def activation_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int, tp: int = 1,
                               sequence_parallel: bool = False) -> int:
    """Bytes one block keeps for backward in fp32 on one rank (the module docstring's table)."""
    b, s, h, f, a = batch, seq_len, cfg.hidden, cfg.ffn_hidden, cfg.heads
    inner = cfg.heads * cfg.d_head
    mlp = 4 if cfg.ffn_type == "swiglu" else 2
    wo_input = 0 if cfg.heads == tp else 1  # one head: transposing it is a view, no copy
    replicated = 6 * b * s * h + 2 * b * s
    split = (4 + wo_input) * b * s * inner + mlp * b * s * f + b * a * s
    if sequence_parallel:
        return 4 * (replicated + split) // tp
    return 4 * (replicated + split // tp)
