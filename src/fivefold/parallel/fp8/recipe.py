"""An fp8 recipe as data: scaling granularity, the tensor classes in fp8, real or emulated.

Torch-free, so the planner times the same recipe the runtime runs (fivefold.planner.compute).
A linear y = x W^T runs three GEMMs, each on two of three tensor classes:

  forward      y  = x  W^T    input, weight
  grad_input   dx = dy W      grad_output, weight
  grad_weight  dW = dy^T x    grad_output, input

A class in `tensors` is rounded to fp8 (e4m3 for input and weight, e5m2 for grad_output, as
arXiv 2209.05433 Sec. 4 and torchao's float8 training do) wherever it enters a GEMM; a GEMM
runs on fp8 units when both its operands are fp8 (`fp8_gemms`), otherwise in the high
precision with the fp8 operand dequantized. Switching a class off is the ablation of
docs/fp8.md. `scaling`: "tensorwise" (one scale per tensor) or "rowwise" (one scale per row
of each operand along the GEMM's contracted dim, so x and W are scaled again along the other
axis for the weight and input gradients; torchao's "rowwise").
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.validate_parallel import FP8_TENSORS

GEMM_OPERANDS = {"forward": ("input", "weight"), "grad_input": ("grad_output", "weight"),
                 "grad_weight": ("grad_output", "input")}


@dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "tensorwise"
    tensors: tuple[str, ...] = FP8_TENSORS
    emulate: bool = True
    forward_format: str = "e4m3"  # input and weight (fivefold.parallel.fp8.formats)
    grad_format: str = "e5m2"  # grad_output

    def format_of(self, tensor_class: str) -> str | None:
        """The format `tensor_class` is rounded to, None where it stays in high precision."""
        if tensor_class not in self.tensors:
            return None
        return self.grad_format if tensor_class == "grad_output" else self.forward_format


def fp8_gemms(tensors: tuple[str, ...]) -> tuple[str, ...]:
    """The GEMMs of a linear (GEMM_OPERANDS) whose two operands are both in fp8."""
    return tuple(g for g, ops in GEMM_OPERANDS.items() if all(o in tensors for o in ops))
