"""Errors and option checks shared by the optimizers."""

from __future__ import annotations

import math


class OptimizerError(ValueError):
    """A bad option or input for an optimizer; the message names the optimizer and the value at fault."""


class UnsupportedOptimizer(RuntimeError):
    """The optimizer cannot run on this device or with these parameters; the message says why."""


def check_common(name: str, **options) -> None:
    """Validate the options most optimizers share; only the ones given are checked."""
    if "lr" in options:
        lr = options["lr"]
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise OptimizerError(f"{name}: lr must be a finite number > 0, got {lr!r}")
    if "momentum" in options:
        m = options["momentum"]
        if not 0.0 <= m < 1.0:
            raise OptimizerError(f"{name}: momentum must be in [0, 1), got {m!r}")
    if "betas" in options:
        betas = options["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"{name}: betas must be two numbers in [0, 1), got {betas!r}")
    if "eps" in options and not options["eps"] >= 0:
        raise OptimizerError(f"{name}: eps must be >= 0, got {options['eps']!r}")
    if "weight_decay" in options and not options["weight_decay"] >= 0:
        raise OptimizerError(f"{name}: weight_decay must be >= 0, got {options['weight_decay']!r}")
    if "ns_steps" in options:
        s = options["ns_steps"]
        if not isinstance(s, int) or s < 1:
            raise OptimizerError(f"{name}: ns_steps must be an integer >= 1, got {s!r}")
