"""The routed experts' SwiGLU on tokens sorted by expert: grouped, padded, or one by one.

Tokens arrive sorted by expert, `counts[e]` rows for expert e (empty groups allowed: an
expert that receives no token still runs, on zero rows). Three ways compute the same thing:

  grouped   torch._grouped_mm over the ragged groups (MegaBlocks' dropless grouped GEMM,
            arXiv 2211.15841, Sec. 5), where the device runs it; torch 2.13 runs it on the
            CPU (fp32 and bf16) and on CUDA for bf16 on recent GPUs. A probe decides once per
            device type and dtype, and the padded form stands in where it fails.
  padded    every group padded with zero rows to the largest one, one batched matmul
            (torch.bmm) per weight: the portable form, at the cost of the padding.
  loop      one F.linear per expert: the reference.

`mm` replaces the grouped or padded product with another of the same signature
(x_MD, w_XFD, counts) -> y: the seam through which fp8 training runs the experts' GEMMs
(fivefold.parallel.fp8.experts), so this module stays free of precision machinery.

Tensor names: M token-assignments sorted by expert, D model width, F expert width, X experts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F



def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's backward rejects stride-0 (expanded) output gradients on the CPU;
    hand it a contiguous one."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_mm(x_MD: torch.Tensor, w_XFD: torch.Tensor, offsets_X: torch.Tensor) -> torch.Tensor:
    """Rows of group e times w_XFD[e]^T, by torch._grouped_mm (`offsets_X`: int32 group ends)."""
    return _contiguous_grad(torch._grouped_mm(x_MD, w_XFD.transpose(-2, -1), offs=offsets_X))


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (a 2-expert probe). The
    probe runs with gradients enabled whatever the caller's mode: the first call may come
    from an evaluation under no_grad, and the answer is cached for the process."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            w = torch.zeros(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            x = torch.zeros(16, 16, device=device_type, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([8, 16], device=device_type, dtype=torch.int32)
            grouped_mm(x, w, offsets).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def padded_mm(x_MD: torch.Tensor, w_XFD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same product by one torch.bmm over groups padded to the largest."""
    X, cap = len(counts), max(counts, default=0)
    rows = torch.arange(cap, device=x_MD.device)
    starts = torch.tensor([0, *counts[:-1]], device=x_MD.device).cumsum(0)
    counts_t = torch.tensor(counts, device=x_MD.device)
    valid_XC = rows[None, :] < counts_t[:, None]
    index_XC = (starts[:, None] + rows[None, :]).clamp(max=max(x_MD.shape[0] - 1, 0))
    x_XCD = torch.where(valid_XC[..., None], x_MD[index_XC], 0.0) if x_MD.shape[0] else \
        x_MD.new_zeros(X, cap, x_MD.shape[1])
    y_XCF = torch.bmm(x_XCD, w_XFD.transpose(-2, -1))
    return y_XCF[valid_XC]


def expert_swiglu(x_MD: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor, how: str = "grouped", mm=None) -> torch.Tensor:
    """w2_e(silu(w1_e x) * w3_e x) for the rows of each expert e, in the rows' order."""
    if how == "loop":
        outs = [F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])
                for e, h in enumerate(torch.split(x_MD, counts))]
        return torch.cat(outs) if outs else x_MD
    dtype = torch.promote_types(x_MD.dtype, w1.dtype) if not torch.is_autocast_enabled(x_MD.device.type) \
        else torch.get_autocast_dtype(x_MD.device.type)
    x_MD, w1, w3, w2 = (t.to(dtype) for t in (x_MD, w1, w3, w2))
    if mm is not None:
        mm = functools.partial(mm, counts=counts)
    elif grouped_mm_runs(x_MD.device.type, dtype):
        offsets = torch.tensor(counts, device=x_MD.device).cumsum(0).to(torch.int32)
        mm = functools.partial(grouped_mm, offsets_X=offsets)
    else:
        mm = functools.partial(padded_mm, counts=counts)
    return mm(F.silu(mm(x_MD, w1)) * mm(x_MD, w3), w2)
