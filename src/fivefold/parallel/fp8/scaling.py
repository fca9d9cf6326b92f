"""Dynamic amax scaling of one GEMM operand, agreed over the tensor-parallel ranks.

Current (just-in-time) scaling, as torchao's float8 training computes it: the scale of a
tensor is s = fmt.max / amax, amax the largest |value| over the whole tensor ("tensorwise")
or over each row along the GEMM's contracted dim ("rowwise"); the tensor is multiplied by s
in fp32, saturated to +-fmt.max (so an outlier never becomes NaN or infinity) and rounded to
the format; the GEMM's result is multiplied back by 1/s of each operand (arXiv 2209.05433,
Sec. 4, per-tensor scaling). amax is floored at AMAX_EPS, so an all-zero row gets a large
finite scale and stays zero.

Layouts. A tensor-parallel rank holds a shard of some operands: a column-parallel linear
(wq, wk, wv, w1, w3; fivefold.parallel.tensor) the rows of W and the columns of dy, a
row-parallel one (wo, w2) the columns of W and of x. Where the amax reduces over the
sharded dim (tensorwise always; rowwise when the shard splits the contracted dim), each
rank's partial amax is all-gathered over the "tp" axis (purpose "fp8_amax", on the ledger)
and the maximum taken, so every rank scales its shard exactly as the one-process run scales
the whole tensor and the quantized shard is the shard of the quantized whole. Data and
pipeline parallelism need nothing: a rank's weights are whole (ZeRO-3 gathers them before
the forward), and activation scales are per micro-batch, which a layout computes on the
same micro-batch as the one-process run with the same micro_batch. Sequence parallelism
needs nothing either: its regions' linears take the gathered sequence (and the row-parallel
ones' output gradient is gathered too). Context parallelism splits every micro-batch's
tokens (the rows of x and dy) over the cp ranks: where an amax reduces over the tokens
(tensorwise x and dy; rowwise, the weight gradient's x and dy along M) the cp ranks'
partial amaxes are all-gathered over "cp" as well ("fp8_amax"), so each scale covers the
one-process run's tokens. MoE layers running on a rank's share of the tokens (tp folded
into the experts' grid, sp, cp: fivefold.parallel.moe_tokens) agree their experts' and
shared experts' token-reducing amaxes the same way over the ranks that split the micro-batch
(fivefold.parallel.fp8.experts).
"""

from __future__ import annotations

import torch

from fivefold.comm.collectives import Axis
from fivefold.parallel.fp8.formats import Format, round_to_format
from fivefold.parallel.tensor_comm import gather_stacked

AMAX_EPS = 1e-12


def agreed_amax(t: torch.Tensor, dim: int | None, shard_dim: int | None,
                axis: Axis | None, token_axis: Axis | None = None) -> torch.Tensor:
    """amax of `t` (2-D) over `dim` (None: the whole tensor; else kept as size 1), the same
    on every rank of `axis` when `t` is this rank's shard along `shard_dim`, and on every
    rank of `token_axis` when those ranks hold the other rows (tokens, dim 0) of `t`."""
    if t.numel() == 0:  # no rows here (an expert this rank routes nothing to): amax 0
        amax = t.new_zeros(() if dim is None else t.shape[:dim] + (1,) + t.shape[dim + 1:])
    else:
        low, high = torch.aminmax(t.detach()) if dim is None else torch.aminmax(
            t.detach(), dim=dim, keepdim=True)
        amax = torch.maximum(-low, high)
    if axis is not None and axis.size > 1 and shard_dim is not None and dim in (None, shard_dim):
        amax = gather_stacked(amax, axis, "fp8_amax").amax(0)
    if token_axis is not None and token_axis.size > 1 and dim in (None, 0):
        amax = gather_stacked(amax, token_axis, "fp8_amax").amax(0)
    return amax.float()


def scale_of(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fmt.max / amax in fp32 (1 for an unscaled format such as bf16)."""
    if not fmt.scaled:
        return torch.ones_like(amax)
    return fmt.max / amax.clamp(min=AMAX_EPS)


def quantize(t: torch.Tensor, fmt: Format, scale: torch.Tensor, emulate: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`t` scaled, saturated and rounded to `fmt`. Emulated: (the dequantized fp32 values,
    None), ready for an fp32 GEMM. Real: (the `fmt.dtype` tensor, 1/scale) for
    torch._scaled_mm."""
    scaled = (t.float() * scale).clamp_(-fmt.max, fmt.max)  # saturate
    if emulate:
        return round_to_format(scaled, fmt).div_(scale), None
    return scaled.to(fmt.dtype), scale.reciprocal()
