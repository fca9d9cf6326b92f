"""Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", arXiv
1710.03740, Sec. 3.2), the same rule on every layout.

fp16's 5 exponent bits flush small gradients to zero; multiplying the loss by a scale S
before backward shifts every gradient up by S, and the update divides it out again. S starts
at 2^16; a step whose gradients overflow (the global gradient norm is not finite) is skipped
and halves S, and 2000 finite steps in a row double it: the constants and arithmetic of
torch.amp.GradScaler, whose state_dict layout this keeps, so a checkpoint of either loads into
the other. Unlike GradScaler, which checks each device's gradients on its own, the overflow
decision here is the gradient norm that clipping already all-reduces over the plan's axes
(fivefold.parallel.grad_clip): one value every rank shares, so data, tensor, context and
pipeline ranks and ZeRO shards all skip the same steps with no collective added.
"""

from __future__ import annotations

import torch

INIT_SCALE, GROWTH, BACKOFF, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000


class LossScale:
    """The current scale S and its growth tracker (one per run, on the host)."""

    def __init__(self):
        self.scale = INIT_SCALE
        self.growth_tracker = 0  # finite steps since S last changed

    @property
    def factor(self) -> float:
        """What each micro-batch's loss is multiplied by before backward."""
        return self.scale

    def inverse(self) -> torch.Tensor:
        """fp32 1/S, what GradScaler.unscale_ multiplies by (S is a power of two: exact)."""
        return torch.tensor(self.scale, dtype=torch.float64).reciprocal().float()

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide the scale out of `grads` in place (multiplying by `inverse()`)."""
        inv = self.inverse()
        for g in grads:
            g.mul_(inv.to(g.device))

    def update(self, overflow: bool) -> None:
        """After a step: halve S on overflow, double it after GROWTH_INTERVAL finite steps."""
        if overflow:
            self.scale *= BACKOFF
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == GROWTH_INTERVAL:
            self.scale *= GROWTH
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        """torch.amp.GradScaler's layout."""
        return {"scale": self.scale, "growth_factor": GROWTH, "backoff_factor": BACKOFF,
                "growth_interval": GROWTH_INTERVAL, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["_growth_tracker"])
