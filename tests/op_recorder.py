"""Record the GEMM and attention ops one training step dispatches, per rank.

`RecordOps` is a TorchDispatchMode (torch.utils._python_dispatch): every aten op the step
runs below autograd (forward, backward, recomputation, optimizer) passes through
`__torch_dispatch__`, where the matrix products (mm, addmm, bmm, baddbmm) are recorded as
("gemm", M, N, K, batch, dtype), the experts' grouped products (torch._grouped_mm) as
("grouped_gemm", M, N, K, groups, dtype, ragged) with `ragged` the dimension the groups
split ("M" rows, or "K" for the weights' gradient), and the fused attention kernels (SDPA's
CPU flash kernel, forward and backward) as ("attention", pass, B, H, Hkv, T, S, E, causal,
dtype): the keys of fivefold.planner.op_trace.compute_counts. The composite ops
(linear, matmul, einsum) decompose before they reach the mode, so what is recorded is what
the CPU kernels run. Element-wise ops and collectives are not recorded here (the ledger
records the collectives: fivefold.comm.ledger).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
           torch.float64: "fp64"}
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: "forward",
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "backward"}


def _gemm(func, args) -> tuple | None:
    """(M, N, K, batch) of a matrix product, from its operands' shapes."""
    if func in (aten.mm.default, aten.mm.out):
        (m, k), (_, n) = args[0].shape, args[1].shape
        return m, n, k, 1
    if func in (aten.addmm.default, aten.addmm.out):
        (m, k), (_, n) = args[1].shape, args[2].shape
        return m, n, k, 1
    if func in (aten.bmm.default, aten.bmm.out):
        (b, m, k), (_, _, n) = args[0].shape, args[1].shape
        return m, n, k, b
    if func in (aten.baddbmm.default, aten.baddbmm.out):
        (b, m, k), (_, _, n) = args[1].shape, args[2].shape
        return m, n, k, b
    return None


class RecordOps(TorchDispatchMode):
    """Counts of the keys of the module docstring dispatched while active; ("unknown", name)
    counts any other matrix or attention op, so that a kernel the recorder cannot read
    shows up as a mismatch instead of vanishing."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shape = _gemm(func, args)
        if shape is not None:
            dtype = args[-1].dtype
            self.ops["gemm", *shape, _DTYPES.get(dtype, str(dtype))] += 1
        elif func is aten._grouped_mm.default:
            a, b = args[0], args[1]
            if b.dim() == 3:  # rows of each group times its matrix: (M, K) x (X, K, N)
                shape = a.shape[0], b.shape[2], a.shape[1], b.shape[0], "M"
            else:  # the weights' gradient, grouped over the reduced rows: (M, R) x (R, N)
                shape = a.shape[0], b.shape[1], a.shape[1], args[2].shape[0], "K"
            self.ops["grouped_gemm", *shape[:4], _DTYPES.get(b.dtype, str(b.dtype)),
                     shape[4]] += 1
        elif func in _ATTENTION:
            q, k = args[0], args[1]  # forward: q, k, v; backward: grad_out, q, k, ...
            if _ATTENTION[func] == "backward":
                q, k = args[1], args[2]
            b, h, t, e = q.shape
            at = 4 if _ATTENTION[func] == "forward" else 7  # the aten schemas' is_causal
            causal = bool(kwargs.get("is_causal", args[at] if len(args) > at else False))
            self.ops["attention", _ATTENTION[func], b, h, k.shape[1], t, k.shape[2], e, causal,
                     _DTYPES.get(q.dtype, str(q.dtype))] += 1
        elif "mm" in func.__name__ or "attention" in func.__name__:
            self.ops["unknown", func.__name__] += 1
        return func(*args, **kwargs)
