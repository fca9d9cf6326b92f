"""Which tokens each context-parallel rank holds, for each mode: one formula for all three.

A cp group of `ring x ulysses` ranks (cp index c = ring_index * ulysses + ulysses_index, the
Ulysses sub-axis innermost) splits every sequence as follows:

1. The ring split: the sequence is cut into 2 x ring chunks and ring rank j holds chunks j and
   2 x ring - 1 - j (the zigzag balance, fivefold.parallel.context.zigzag).
2. The Ulysses split: the ranks of one Ulysses group cut their ring rank's part into
   `ulysses` contiguous pieces, piece i to Ulysses rank i.

so the Ulysses all-to-all (which concatenates the group's pieces in rank order) rebuilds
exactly the ring rank's zigzag part, in the order ring attention expects. The three modes are
the three cases of that rule:

    mode      ring  ulysses  layout         a rank's tokens
    ring      cp    1        "zigzag"       chunks c and 2cp-1-c of 2cp
    ulysses   1     cp       "contiguous"   chunk c of cp (the all-to-all rebuilds the true
                                            order; causal SDPA then runs on it unchanged)
    hybrid    cp/u  u        "zigzag-ring"  piece i of ring rank j's two chunks

Ulysses alone needs no balancing (after its all-to-all every rank attends over the whole
sequence for its heads), so it keeps contiguous shards and no permutation. The trainer uses
one layout per mode: `context_positions` gives a rank's true positions (the rows of the
rotary tables, the labels to predict), `shard_sequence` / `unshard_sequence` apply them.
"""

from __future__ import annotations

import torch

from fivefold.parallel.context.zigzag import check_zigzag, zigzag_positions

MODES = ("ulysses", "ring", "hybrid")
LAYOUTS = {"ring": "zigzag", "ulysses": "contiguous", "hybrid": "zigzag-ring"}


def context_layout(mode: str) -> str:
    """The sequence layout mode `mode` needs on its cp ranks (see the module docstring)."""
    if mode not in LAYOUTS:
        raise ValueError(f"parallel.cp_mode must be one of {', '.join(MODES)}, got {mode!r}")
    return LAYOUTS[mode]


def mode_degrees(mode: str, cp: int, ulysses: int | None = None) -> tuple[int, int]:
    """(ring degree, Ulysses degree) of a mode on `cp` ranks; hybrid takes its Ulysses degree."""
    context_layout(mode)
    if mode == "ring":
        return cp, 1
    if mode == "ulysses":
        return 1, cp
    if ulysses is None or ulysses < 1 or cp % ulysses:
        raise ValueError(f"a hybrid context-parallel layout runs a Ulysses degree times a ring "
                         f"degree on cp = {cp} ranks, and the Ulysses degree "
                         f"(parallel.cp_ulysses = {ulysses}) must divide cp")
    return cp // ulysses, ulysses


def check_sequence_split(seq_len: int, ring: int, ulysses: int) -> None:
    """ValueError unless `seq_len` tokens split over `ring` x `ulysses` ranks as described."""
    if ring > 1:
        check_zigzag(seq_len, ring)
    if seq_len % (ring * ulysses):
        raise ValueError(f"context parallelism over {ring * ulysses} ranks needs seq_len "
                         f"divisible by {ring * ulysses}, got {seq_len}")


def split_positions(seq_len: int, ring: int, ulysses: int, index: int) -> torch.Tensor:
    """True positions (int64, increasing) that cp index `index` holds under the rule above."""
    check_sequence_split(seq_len, ring, ulysses)
    ring_index, ulysses_index = divmod(index, ulysses)
    part = zigzag_positions(seq_len, ring, ring_index) if ring > 1 else torch.arange(seq_len)
    return part.chunk(ulysses)[ulysses_index]


def context_positions(seq_len: int, mode: str, cp: int, index: int,
                      ulysses: int | None = None) -> torch.Tensor:
    """True positions cp rank `index` holds in mode `mode` (hybrid: `ulysses` its degree)."""
    ring, ulysses = mode_degrees(mode, cp, ulysses)
    return split_positions(seq_len, ring, ulysses, index)


def shard_sequence(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The tokens at `positions` of the full `x` along `dim`."""
    return x.index_select(dim, positions.to(x.device))


def unshard_sequence(shards: list[torch.Tensor], positions: list[torch.Tensor],
                     dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard and its positions (all ranks, any order)."""
    joined = torch.cat(shards, dim)
    order = torch.cat(positions).to(joined.device)
    return joined.index_select(dim, torch.argsort(order))
