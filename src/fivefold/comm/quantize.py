"""Block-wise symmetric int8 quantization, the codec of ZeRO++'s quantized collectives.

ZeRO++ (arXiv 2306.10209, Sec. 3.1) quantizes each block of `BLOCK` consecutive values
independently with its own scale, max|x| / 127, which bounds the error of a block by its own
range instead of the whole tensor's; a block costs BLOCK bytes of int8 plus one fp32 scale.
"""

from __future__ import annotations

import torch

BLOCK = 256


def quantize_int8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per block) of a 1-D tensor whose length `block` divides."""
    blocks = x.float().view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    block: int = BLOCK) -> torch.Tensor:
    return (q.view(-1, block).float() * scale[:, None]).view(-1).to(dtype)
