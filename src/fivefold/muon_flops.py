"""Floating-point operations of Muon's Newton-Schulz orthogonalization (fivefold.muon), torch-free
so that the planner and the runtime's owner assignment (fivefold.parallel.muon_owners) count alike.
"""

from __future__ import annotations

NS_STEPS = 5  # fivefold.muon.NS_STEPS


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Per iteration on the A x B orientation (A the smaller side): the Gram matrix X X^T
    (2 A^2 B), its square (2 A^3) and the product with X (2 A^2 B)."""
    a, b = sorted((rows, cols))
    return steps * (4 * a * a * b + 2 * a ** 3)
