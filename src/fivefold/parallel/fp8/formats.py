"""The number formats of fp8 training and their round-to-nearest-even, written out in fp32.

Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv 2209.05433, Sec. 3, Table 1):

  e4m3 (torch.float8_e4m3fn)  4 exponent bits (bias 7), 3 mantissa bits, no infinities,
                              largest 448, smallest normal 2^-6, subnormal step 2^-9;
                              forward tensors (activations, weights)
  e5m2 (torch.float8_e5m2)    5 exponent bits (bias 15), 2 mantissa bits, largest 57344,
                              smallest normal 2^-14, subnormal step 2^-16; gradients
  bf16                        8 exponent bits, 7 mantissa bits: the bf16-emulated baseline
                              of docs/fp8.md (never scaled: its range is fp32's)

`round_to_format(x, fmt)` rounds fp32 values, already inside the format's range, to the
nearest value of the format, ties to the even mantissa, with the format's subnormals: the
spacing of the grid at x is 2^(e - m) for x's binade exponent e and m mantissa bits, floored
at the smallest normal exponent (where the subnormals continue the last normal spacing); it
works on the fp32 bits, a few in-place passes, since the emulation rounds every GEMM input. tests/test_fp8.py
checks it bit for bit against torch's own casts (`x.to(torch.float8_e4m3fn)`) over every
fp8 value, every midpoint between neighbours (the ties), subnormals, signed zeros and the
saturation bound. Written out rather than calling the cast so that the emulation is an
explicit model of the rounding, and a test that holds the two against each other can fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    mantissa_bits: int
    min_normal_exp: int  # exponent of the smallest normal value
    max: float  # largest finite value: scaled tensors are clamped to it (saturation)
    scaled: bool  # whether tensors are scaled by max / amax before rounding
    dtype: torch.dtype  # torch's storage dtype of the format


E4M3 = Format("e4m3", 3, -6, 448.0, True, torch.float8_e4m3fn)
E5M2 = Format("e5m2", 2, -14, 57344.0, True, torch.float8_e5m2)
BF16 = Format("bf16", 7, -126, torch.finfo(torch.bfloat16).max, False, torch.bfloat16)
FORMATS = {f.name: f for f in (E4M3, E5M2, BF16)}


EXPONENT_BITS = 0x7F800000  # an fp32's exponent field
HALF_MANTISSA = 0x400000  # the mantissa 1.5


def round_to_format(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 `x` (inside +-fmt.max) rounded to the nearest value of `fmt`, ties to even.

    The grid spacing at x is step = 2^(e - m), e = max(x's binade exponent, the smallest
    normal exponent). c = 1.5 * 2^23 * step, built from x's exponent bits, has fp32 spacing
    `step` around it and |x| << c, so fp32's own round-to-nearest-even of x + c lands on the
    nearest multiple of step, and subtracting c is exact; copysign keeps the sign of values
    that round to zero, as the format does. (c stays finite for every fp8 value and for bf16
    values below 2^111, far above anything the bf16 baseline rounds.)
    """
    c = (x.view(torch.int32) & EXPONENT_BITS).clamp_(min=(fmt.min_normal_exp + 127) << 23)
    c = c.add_(((23 - fmt.mantissa_bits) << 23) | HALF_MANTISSA).view(torch.float32)
    return (x + c).sub_(c).copysign_(x)
