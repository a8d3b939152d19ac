"""The learning-rate multiplier: linear warmup, then no / linear / cosine decay down to min_lr_ratio."""

from __future__ import annotations

import math

DECAYS = ("none", "linear", "cosine")


def lr_multiplier(
    step: int, warmup_steps: int = 0, total_steps: int | None = None, decay: str = "none",
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the base lr for 0-based `step`.

    Warmup: (step + 1) / warmup_steps for step < warmup_steps (the first step is not at zero lr).
    Then with progress t = (step - warmup_steps) / (total_steps - warmup_steps), clamped to [0, 1]:
    none -> 1; linear -> 1 - (1 - r) t; cosine -> r + (1 - r) (1 + cos(pi t)) / 2, r = min_lr_ratio.
    """
    if decay not in DECAYS:
        raise ValueError(f"unknown lr decay {decay!r}; known: {', '.join(DECAYS)}")
    if warmup_steps < 0 or step < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got step={step}, warmup_steps={warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "none":
        return 1.0
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(
            f"{decay} decay needs total_steps > warmup_steps, got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}"
        )
    t = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * t
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
