"""fp8 for MoE layers: the experts' GEMMs in fp8, the router in high precision.

DeepSeek-V3 (arXiv 2412.19437, Sec. 3.3.1) trains its MoE layers with the experts' GEMMs
(forward, input gradient, weight gradient) on fp8 inputs and keeps the gating (router) in
the high precision, since a rounded score moves tokens between experts. `apply_fp8_to_moe`
does the same from outside the model (fivefold.parallel.parallelize calls
`apply_fp8_to_experts` next to `apply_fp8`): it installs `Fp8ExpertMatmul` in the MoE layer's
`expert_mm` seam (fivefold.models.expert_matmul), which every path to the experts takes
(the local experts and expert parallelism's dispatcher alike), turns the shared experts'
three linears into `Fp8Linear`s and leaves the router alone (fivefold.models.moe computes
its logits in fp32 whatever the compute dtype).

Each expert's product is its own fp8 linear: expert e's rows x_e and its weight W_e are
scaled and rounded as fivefold.parallel.fp8.linear's `_Fp8Matmul` scales a dense linear's
operands (the recipe's formats, tensorwise or rowwise scales per expert GEMM), one GEMM per
expert, emulated in fp32 or by torch._scaled_mm. An expert that receives no row runs the
plain product on zero rows, so its weights still get a (zero) gradient.

The experts are whole on every rank here (expert parallelism moves rows, not weight shards),
so no scale is agreed over a weight shard. Where tensor (folded into the experts' grid,
with or without sequence parallelism) or context parallelism splits a micro-batch's tokens,
an MoE layer runs on its rank's share (fivefold.parallel.moe_tokens): expert e's call holds
only this rank's rows of e, and the shared experts' linears only its tokens. Every amax
that reduces over the rows (tensorwise x and dy; rowwise the weight gradient's x and dy
along M) is then all-gathered over those token-splitting ranks ("fp8_amax", as
fivefold.parallel.fp8.scaling does over cp), so each scale covers the rows the one-process
run's call holds; an expert with no row here still takes part (its amax is 0). Under expert
parallelism (ep or etp > 1) the routed experts' calls are left unagreed: an ep rank holds
an expert's rows from every source rank, which on a data-parallel ep axis are other
micro-batches than the one-process call's, so there the layouts match the one-process fp8
run to a rounding tolerance only (tests/test_fp8_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.comm.collectives import Axis
from fivefold.models.moe import MoE
from fivefold.parallel.fp8.linear import Fp8Linear, _Fp8Matmul, _Spec
from fivefold.parallel.fp8.recipe import Fp8Recipe


class Fp8ExpertMatmul:
    """The `expert_mm` seam: rows of group e (x_MD sorted by expert, `counts[e]` rows) times
    w_XFD[e]^T, each group's GEMMs with fp8 operands."""

    def __init__(self, recipe: Fp8Recipe, token_axis: Axis | None = None):
        self.recipe = recipe
        self.token_axis = token_axis if token_axis is not None and token_axis.size > 1 else None

    def __call__(self, x_MD: torch.Tensor, w_XFD: torch.Tensor, counts: list[int]
                 ) -> torch.Tensor:
        spec = _Spec(self.recipe, None, None, x_MD.dtype, self.token_axis)
        outs = []
        with torch.autocast(x_MD.device.type, enabled=False):
            for e, x in enumerate(torch.split(x_MD, counts)):
                outs.append(_Fp8Matmul.apply(x, w_XFD[e], spec)
                            if x.shape[0] or self.token_axis is not None
                            else x @ w_XFD[e].t())
        return torch.cat(outs)

    def __repr__(self) -> str:
        r = self.recipe
        return (f"Fp8ExpertMatmul({r.scaling} {'+'.join(r.tensors) or 'none'}"
                f"{' emulated' if r.emulate else ''}"
                f"{f' amax over {self.token_axis.name}' if self.token_axis else ''})")


def apply_fp8_to_experts(model: nn.Module, recipe: Fp8Recipe, token_group: Axis | None = None,
                         expert_parallel: bool = False) -> nn.Module:
    """fp8 experts and shared experts for every MoE layer of `model`, in place; the routers
    untouched. `token_group`: the ranks splitting a micro-batch's tokens, over which the
    row-reducing amaxes are agreed (the routed experts' only without `expert_parallel`,
    module docstring). Returns the model."""
    for moe in model.modules():
        if not isinstance(moe, MoE):
            continue
        moe.expert_mm = Fp8ExpertMatmul(recipe, None if expert_parallel else token_group)
        if moe.shared is not None:
            for name, child in list(moe.shared.named_children()):
                setattr(moe.shared, name, Fp8Linear(child.weight, child.bias, recipe, None,
                                                    None, None, token_group))
    return model
