"""Deterministic parameter initialization from a parameter's name and full shape.

Each parameter's values come from a generator seeded by (seed, name, full shape) alone (the
residual projections are then scaled by the model's depth), so a
model that is later sharded, pipelined or built on another number of ranks starts bit-identical
to the single-process one: a shard is a slice of `init_tensor(name, full_shape)`. Parity tests
rely on this. The scheme is GPT-2's: normal(0, 0.02) for matrices and embeddings, with output
projections (attention `wo`, MLP `w2`) scaled by 1/sqrt(2 * layers); norms start at one.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

STD = 0.02
RESIDUAL_PROJECTIONS = ("attention.wo.weight", "mlp.w2.weight")


def param_seed(seed: int, name: str, shape: tuple[int, ...]) -> int:
    """A 63-bit generator seed that depends only on the run seed, the name and the shape."""
    digest = hashlib.sha256(f"{seed}|{name}|{tuple(shape)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_tensor(name: str, shape: tuple[int, ...], seed: int, layers: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` of the given full shape."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = STD / math.sqrt(2 * layers) if name.endswith(RESIDUAL_PROJECTIONS) else STD
    gen = torch.Generator().manual_seed(param_seed(seed, name, shape))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_model_(model: nn.Module, seed: int, layers: int) -> nn.Module:
    """Initialize every parameter of an unwrapped model in place, by name and shape."""
    for name, param in model.named_parameters():
        param.copy_(init_tensor(name, tuple(param.shape), seed, layers))
    return model
