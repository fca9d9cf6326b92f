"""A simulated step as `fivefold simulate` and `fivefold plan` report it."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.parallel.plan import ParallelPlan
from fivefold.planner.schedules import Replay

MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "other", "total")
BREAKDOWN_FIELDS = ("compute", "exposed_comm", "bubble", "optimizer")


@dataclass
class Estimate:
    """A simulated step; `to_json()` gives exactly the fields of run_spec.md."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    memory_per_gpu_bytes: dict[str, int]
    fits: bool
    breakdown_s: dict[str, float]
    parallel: dict
    layout: ParallelPlan = field(repr=False)
    stage_layers: list[int] = field(default_factory=list, repr=False)
    replay: Replay | None = field(default=None, repr=False)
    dp_tail_s: list[float] = field(default_factory=list, repr=False)
    step_model: object | None = field(default=None, repr=False)  # planner.step.LayoutStep
    offload: dict | None = None  # fivefold.planner.offload.offload_summary
    activation_offload: dict | None = None  # planner.activation_offload's summary

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
                "mfu": self.mfu, "hfu": self.hfu,
                "memory_per_gpu_bytes": dict(self.memory_per_gpu_bytes), "fits": self.fits,
                "breakdown_s": dict(self.breakdown_s), "parallel": dict(self.parallel),
                **({"offload": dict(self.offload)} if self.offload else {}),
                **({"activation_offload": dict(self.activation_offload)}
                   if self.activation_offload else {})}
