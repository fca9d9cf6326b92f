"""The fp8 linear layer of the blocks, applied from outside by `apply_fp8`.

`apply_fp8(model, recipe, tp_axis)` (called by fivefold.parallel.parallelize, after tensor
parallelism has split the linears) replaces every attention and MLP linear of every block
(wq, wk, wv, wo, w1, w2, w3; plain, column-parallel or row-parallel) by an `Fp8Linear`
holding the same parameters under the same names, so the data-parallel engine, ZeRO-3's
gathers, checkpoints and the optimizer see the model unchanged: master weights and optimizer
states stay in their own dtype (fp32). The embedding, the norms, the attention core and the
output head are untouched and run in the compute dtype (torchao's float8 training converts
the same modules, arXiv 2410.06511 Sec. 3.1).

`Fp8Linear` computes y = x W^T + b with the three GEMMs of fivefold.parallel.fp8.recipe:

  forward      x (e4m3) and W (e4m3), each scaled along K
  grad_input   dy (e5m2) and W (e4m3), each scaled along N
  grad_weight  dy (e5m2) and x (e4m3), each scaled along the tokens M

"Scaled along" matters only to rowwise scaling; tensorwise uses one scale per tensor, and x's
and W's forward scales (two fp32 scalars kept on the autograd context) again in backward.
Like torchao, the layer saves the high-precision x and W for backward and quantizes them again
there, so it keeps exactly what a plain linear keeps (x, shared by wq, wk and wv; W, a
parameter; under sequence parallelism only x's sequence shard, gathered again for the weight
gradient as `ColumnParallelLinear` does): nothing is saved in fp8 under either recipe
(fivefold.planner.activations).

Real fp8 (`recipe.emulate = False`): quantized operands are torch float8 tensors and a GEMM
with both operands in fp8 is `torch._scaled_mm` (fp32 accumulation, output in the compute
dtype), the kernel torchao's float8 training calls on Hopper and later GPUs; a GEMM with one
fp8 operand dequantizes it and runs in the compute dtype. torch 2.13 also runs _scaled_mm on
CPU, where tests/test_fp8.py holds it against the emulation; it has not been run on a GPU here.
Emulated (`recipe.emulate = True`): every quantized operand is rounded to its format and
scaled back in fp32 (fivefold.parallel.fp8.scaling.quantize), and each GEMM runs in fp32. The
operand values are those of the real fp8 GEMM, so the two differ only in fp32 accumulation
order and in where the 1/s factors are applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.models.moe import MoE
from fivefold.parallel.fp8.formats import FORMATS
from fivefold.parallel.fp8.recipe import Fp8Recipe
from fivefold.parallel.fp8.scaling import agreed_amax, quantize, scale_of
from fivefold.parallel.tensor import ColumnParallelLinear, split_dim


@dataclass(frozen=True)
class _Spec:
    """What one call of the fp8 matmul needs besides its tensors."""

    recipe: Fp8Recipe
    weight_shard: int | None  # dim of W split over tp: 0 column-parallel, 1 row-parallel
    axis: Axis | None
    out_dtype: torch.dtype
    token_axis: Axis | None = None  # the cp ranks, holding the micro-batch's other tokens

    def shard_of(self, tensor_class: str) -> int | None:
        """The dim of this class's (2-D) operand that the tp ranks split."""
        if tensor_class == "weight":
            return self.weight_shard
        if tensor_class == "input":  # (M, K): a row-parallel linear's input is split along K
            return 1 if self.weight_shard == 1 else None
        return 1 if self.weight_shard == 0 else None  # dy (M, N): column-parallel splits N

    def operand(self, t: torch.Tensor, tensor_class: str, dim: int,
                scale: torch.Tensor | None = None):
        """(values, 1/scale or None, scale) of `t` as a GEMM operand contracted along `dim`;
        `scale` reuses a tensorwise scale computed before."""
        name = self.recipe.format_of(tensor_class)
        if name is None:
            return t, None, None
        fmt = FORMATS[name]
        if scale is None:
            reduce_dim = dim if self.recipe.scaling == "rowwise" else None
            tokens = None if tensor_class == "weight" else self.token_axis
            scale = scale_of(agreed_amax(t, reduce_dim, self.shard_of(tensor_class), self.axis,
                                         tokens), fmt)
        values, inverse = quantize(t, fmt, scale, self.recipe.emulate)
        return values, inverse, scale

    def gemm(self, a, a_inverse, b, b_inverse, out_dtype: torch.dtype) -> torch.Tensor:
        """a (M, K) @ b (K, N): in fp32 (emulated), by torch._scaled_mm (both operands fp8),
        or in the compute dtype with the fp8 operand dequantized."""
        if self.recipe.emulate:
            return (a.float() @ b.float()).to(out_dtype)
        if a_inverse is not None and b_inverse is not None:
            return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inverse,
                                    scale_b=b_inverse, out_dtype=out_dtype)
        hp = self.out_dtype
        a = a.to(hp) * a_inverse.to(hp) if a_inverse is not None else a.to(hp)
        b = b.to(hp) * b_inverse.to(hp) if b_inverse is not None else b.to(hp)
        return (a @ b).to(out_dtype)


def _t(inverse: torch.Tensor | None) -> torch.Tensor | None:
    return None if inverse is None else inverse.t().clone(memory_format=torch.contiguous_format)


class _Fp8Matmul(torch.autograd.Function):
    """x_MK W_NK^T with every GEMM's operands quantized as the spec's recipe says. Inside a
    sequence-parallel region (`shared` given) x_MK is the gathered sequence: only this rank's
    shard `x_local` is saved, and the weight gradient's x is gathered again from it."""

    @staticmethod
    def forward(ctx, x_MK, weight_NK, spec: _Spec, x_local=None, shared=None):
        x, x_inv, x_scale = spec.operand(x_MK, "input", 1)
        w, w_inv, w_scale = spec.operand(weight_NK, "weight", 1)
        ctx.spec, ctx.shared, ctx.x_dtype = spec, shared, x_MK.dtype
        if shared is not None:
            shared.users += 1
        ctx.save_for_backward(x_MK if shared is None else x_local, weight_NK)
        if spec.recipe.scaling == "tensorwise":  # fp32 scalars, reused in backward
            ctx.scales = (x_scale, w_scale)
        return spec.gemm(x, x_inv, w.t(), _t(w_inv), spec.out_dtype)

    @staticmethod
    def backward(ctx, grad_MN):
        spec = ctx.spec
        x_saved, weight_NK = ctx.saved_tensors
        tensorwise = spec.recipe.scaling == "tensorwise"
        x_scale, w_scale = ctx.scales if tensorwise else (None, None)
        grad_x = grad_w = None
        dy, dy_inv, dy_scale = spec.operand(grad_MN, "grad_output", 1)
        if ctx.needs_input_grad[0]:
            w, w_inv, _ = spec.operand(weight_NK, "weight", 0, w_scale)
            grad_x = spec.gemm(dy, dy_inv, w, w_inv, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if not tensorwise:
                dy, dy_inv, _ = spec.operand(grad_MN, "grad_output", 0)
            x_MK = x_saved if ctx.shared is None else ctx.shared.gather(x_saved).flatten(0, -2)
            x, x_inv, _ = spec.operand(x_MK, "input", 0, x_scale)
            grad_w = spec.gemm(dy.t(), _t(dy_inv), x, x_inv, weight_NK.dtype)
        return grad_x, grad_w, None, None, None


class Fp8Linear(nn.Module):
    """A block's linear with its GEMMs in fp8 (the module docstring); same parameters. A
    column-parallel linear keeps its `TensorParallelRegion`: under sequence parallelism it
    saves only its input's sequence shard, as `ColumnParallelLinear` does."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, recipe: Fp8Recipe,
                 weight_shard: int | None, axis: Axis | None, tp_region=None,
                 token_axis: Axis | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.recipe, self.weight_shard, self.axis = recipe, weight_shard, axis
        self.tp_region, self.token_axis = tp_region, token_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else x.dtype)
        spec = _Spec(self.recipe, self.weight_shard, self.axis, out_dtype, self.token_axis)
        sp_input = self.tp_region.sp_input if self.tp_region is not None else None
        x_local = shared = None
        if sp_input is not None and x is sp_input[0] and torch.is_grad_enabled():
            _, x_local, shared = sp_input  # the gathered sequence: amax of the whole of it
        with torch.autocast(device, enabled=False):
            y = _Fp8Matmul.apply(x.flatten(0, -2), self.weight, spec, x_local, shared)
        y = y.unflatten(0, x.shape[:-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        r = self.recipe
        shard = {0: ", column-parallel", 1: ", row-parallel", None: ""}[self.weight_shard]
        return (f"in_features={in_features}, out_features={out_features}{shard}, "
                f"{r.scaling} {'+'.join(r.tensors) or 'none'}"
                f"{' emulated' if r.emulate else ''}")


def has_fp8_units(device_type: str) -> bool:
    """Whether this process's device runs fp8 GEMMs: a CUDA GPU of compute capability 8.9
    or later (Ada, Hopper, Blackwell), where torch._scaled_mm has its fp8 kernels."""
    return (device_type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 9))


def apply_fp8(model: nn.Module, recipe: Fp8Recipe, tp_axis: Axis,
              cp_axis: Axis | None = None) -> nn.Module:
    """Replace the attention and MLP linears of `model`'s blocks (a whole Transformer or a
    pipeline stage, split over `tp_axis` or not, its tokens over `cp_axis` or not) by
    `Fp8Linear`s, in place; returns it. MoE layers are left to
    `fivefold.parallel.fp8.experts.apply_fp8_to_experts`."""
    token_axis = cp_axis if cp_axis is not None and cp_axis.size > 1 else None
    for i, block in model.layers.named_children():
        for region_name in ("attention", "mlp"):
            region = getattr(block, region_name)
            if isinstance(region, MoE):  # fivefold.parallel.fp8.experts
                continue
            for child_name, child in list(region.named_children()):
                assert isinstance(child, (nn.Linear, ColumnParallelLinear)), (
                    f"layers.{i}.{region_name}.{child_name} is a {type(child).__name__}")
                shard = (split_dim(f"layers.{i}.{region_name}.{child_name}.weight")
                         if tp_axis.size > 1 else None)
                setattr(region, child_name, Fp8Linear(child.weight, child.bias, recipe, shard,
                                                      tp_axis if shard is not None else None,
                                                      getattr(child, "region", None),
                                                      token_axis))
    return model
