"""The learning-rate schedule: a pure function of the optimizer step, so the step number (and
the schedule's length, below) is the scheduler's whole state in a checkpoint.

Every schedule starts with a linear warm-up to `train.lr` over `train.warmup_steps` steps
(absent: min(20, length // 10), so a 200-step run warms up 20 steps and a 10-step run 1),
then, by `train.lr_schedule`:

- "cosine": cosine decay to the floor `lr * min_lr_ratio` at the last step;
- "linear": linear decay to the floor at the last step;
- "constant": `lr` to the end (no floor);
- "wsd": warmup-stable-decay (MiniCPM, Hu et al., arXiv 2404.06395, Sec. 4): `lr` held until
  the last `decay_fraction` of the steps (default 0.1, MiniCPM's ~10%, which they find
  enough to reach the loss of a cosine run), which decay to the floor in the
  `decay_shape` "linear", "cosine" or "sqrt" (1 - sqrt of the decay's progress, the best
  of those compared by Hägele et al., arXiv 2405.18392, Sec. 3). A warm-up longer than the
  stable phase shortens the decay.

The schedule is laid out for a length, normally `train.steps`; past its end every schedule
holds its last value. A checkpoint records the length (`schedule_steps` in meta.json) so a
run resumed with more steps can keep the steps already taken on their schedule
(`resumed_length`).
"""

from __future__ import annotations

import math

from fivefold.config import ConfigError, TrainConfig
from fivefold.models.validate_model import choice, positive

LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
DECAY_SHAPES = ("linear", "cosine", "sqrt")
AUTO_WARMUP_MAX = 20  # warm-up steps when train.warmup_steps is absent, at most a tenth


def warmup_steps(t: TrainConfig, length: int) -> int:
    """`train.warmup_steps`, or min(20, length // 10) when it is absent."""
    return t.warmup_steps if t.warmup_steps is not None else min(AUTO_WARMUP_MAX, length // 10)


def _decayed(progress: float, shape: str) -> float:
    """The fraction of (lr - floor) left after `progress` (0 to 1) of a decay."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, t: TrainConfig, length: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based) of the schedule laid out for
    `length` steps (default `train.steps`)."""
    length = t.steps if length is None else length
    warmup = warmup_steps(t, length)
    if warmup and step < warmup:
        return t.lr * (step + 1) / warmup
    if t.lr_schedule == "constant":
        return t.lr
    floor = t.lr * t.min_lr_ratio
    if t.lr_schedule == "wsd":
        start = max(warmup, length - max(1, round(t.decay_fraction * length)))
        if step < start:
            return t.lr
        progress = min(1.0, (step - start + 1) / max(1, length - start))
        return floor + (t.lr - floor) * _decayed(progress, t.decay_shape)
    decay_steps = max(1, length - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    return floor + (t.lr - floor) * _decayed(progress, t.lr_schedule)


def resumed_length(saved: int, t: TrainConfig, taken: int) -> tuple[int, str | None]:
    """The length to lay the schedule out for when a run whose schedule was laid out for
    `saved` steps resumes after `taken` steps with `train.steps` steps, and a line saying
    how the added steps are laid out (None when nothing was added).

    The rule: if the schedule laid out for the new length gives every step already taken
    the lr it had, it is used (a WSD run extended in its stable phase then decays at the new
    end, which is what WSD is for: MiniCPM Sec. 4.2). Otherwise the old schedule is kept:
    its remaining steps follow it and the added steps hold its last lr (the floor, for a
    schedule that decays): re-stretching the decay would raise the lr of a run that has
    already decayed (re-warming, which costs loss before it helps). Fewer steps than
    before lay the schedule out anew for the new length."""
    if t.steps <= saved:
        return t.steps, None
    if all(lr_at(step, t, t.steps) == lr_at(step, t, saved) for step in range(taken)):
        return t.steps, (f"train.steps {t.steps} > the schedule's {saved} steps: the "
                         f"{t.lr_schedule} schedule is laid out anew for {t.steps} steps "
                         f"(the {taken} steps taken keep their lr under it)")
    kept = (f"steps {taken + 1}-{saved} keep their {t.lr_schedule} schedule, "
            if taken < saved else "")
    return saved, (f"train.steps {t.steps} > the schedule's {saved} steps: {kept}steps "
                   f"{max(saved, taken) + 1}-{t.steps} hold its last lr "
                   f"{lr_at(saved - 1, t, saved):.3g} (an lr that has decayed is not raised "
                   "again)")


def validate_schedule(t: TrainConfig) -> None:
    """The schedule's keys, each failure a ConfigError naming its key."""
    choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    choice("train.decay_shape", t.decay_shape, DECAY_SHAPES)
    if not 0.0 < t.decay_fraction <= 1.0:
        raise ConfigError("train.decay_fraction", f"must lie in (0, 1], got {t.decay_fraction}")
    positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    if t.warmup_steps is not None and t.warmup_steps > t.steps:
        raise ConfigError("train.warmup_steps", f"{t.warmup_steps} warm-up steps exceed the "
                                                f"{t.steps} steps of the run; lower it or "
                                                "leave it out (automatic: min(20, steps // 10))")
