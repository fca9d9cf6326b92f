"""The zigzag (load-balanced causal) split of a sequence over the ranks of a ring.

Under a causal mask, token t attends to t + 1 keys, so a contiguous split gives the last rank
of a ring about 2n - 1 times the attention work of the first, which idles through the masked
part. Striped Attention (Brandon et al., arXiv 2311.09431, Sec. 3) balances the work by giving
every rank tokens from all along the sequence; the zigzag form of the same idea (used by
Megatron-LM's context parallelism and ring-flash-attn) cuts the sequence into 2n equal chunks
and gives rank i chunks i and 2n-1-i, an early and a late one:

    n = 2, chunks 0 1 2 3:   rank 0 holds [0, 3], rank 1 holds [1, 2]

Every rank then holds the same number of (query, key) pairs under the mask, and against any
other rank's pair of chunks exactly half of its own pairs are visible (fivefold.parallel
.context.ring_attention uses this to compute only the visible half).

Pure index math: `zigzag_positions` are the true token positions a rank holds (the rows of the
rotary tables it needs, the labels it predicts); shard and unshard are gathers along one dim.
"""

from __future__ import annotations

import torch


def check_zigzag(seq_len: int, degree: int) -> None:
    """ValueError unless a sequence of `seq_len` tokens splits into 2 x `degree` equal chunks."""
    if degree < 1:
        raise ValueError(f"the ring degree must be at least 1, got {degree}")
    if seq_len % (2 * degree):
        raise ValueError(f"the balanced (zigzag) ring splits each sequence into 2 x cp = "
                         f"{2 * degree} equal chunks, and {seq_len} tokens do not divide by "
                         f"{2 * degree}: make seq_len a multiple of {2 * degree}")


def zigzag_chunks(degree: int, index: int) -> tuple[int, int]:
    """The two chunk numbers (out of 2 x degree) that ring rank `index` holds, in order."""
    return index, 2 * degree - 1 - index


def zigzag_positions(seq_len: int, degree: int, index: int) -> torch.Tensor:
    """The true positions (int64, increasing, seq_len / degree of them) ring rank `index` holds."""
    check_zigzag(seq_len, degree)
    chunk = seq_len // (2 * degree)
    first, second = zigzag_chunks(degree, index)
    return torch.cat((torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)))


def zigzag_shard(x: torch.Tensor, degree: int, index: int, dim: int = 1) -> torch.Tensor:
    """Ring rank `index`'s part of `x` along `dim` (the sequence): its two chunks, joined."""
    check_zigzag(x.shape[dim], degree)
    chunks = x.chunk(2 * degree, dim)
    first, second = zigzag_chunks(degree, index)
    return torch.cat((chunks[first], chunks[second]), dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every ring rank's shard (in rank order): the inverse of
    `zigzag_shard` over all ranks."""
    degree = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * degree)
    for index, shard in enumerate(shards):
        first, second = zigzag_chunks(degree, index)
        chunks[first], chunks[second] = shard.chunk(2, dim)
    return torch.cat(chunks, dim)
