"""How many attention heads each Ulysses rank receives: the rules, without torch.

One definition for the runtime (fivefold.parallel.context.ulysses) and the planner, which
predicts the all-to-alls' bytes and the saved activations from them
(fivefold.planner.ledger_model, fivefold.planner.activations) and may not import torch.
"""

from __future__ import annotations


def ulysses_kv_heads(kv_heads: int, degree: int) -> int:
    """Key/value heads that enter the Ulysses all-to-all on `degree` ranks: `kv_heads` when
    the degree divides them, else `degree` (each head replicated) when they divide the
    degree; ValueError otherwise."""
    if kv_heads % degree == 0:
        return kv_heads
    if degree % kv_heads == 0:
        return degree
    raise ValueError(f"Ulysses splits the key/value heads over its {degree} ranks: "
                     f"kv_heads = {kv_heads} neither divides by {degree} nor divides it (so "
                     f"the heads cannot be replicated to fit); choose kv_heads or the Ulysses "
                     f"degree so that one divides the other")


def check_ulysses_heads(heads: int, kv_heads: int, degree: int) -> int:
    """ValueError unless Ulysses on `degree` ranks can split these heads; the kv heads it
    moves (see `ulysses_kv_heads`)."""
    if heads % degree:
        raise ValueError(f"Ulysses splits the attention heads over its {degree} ranks, and "
                         f"heads = {heads} does not divide by {degree}")
    if heads % kv_heads:
        raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
    return ulysses_kv_heads(kv_heads, degree)
