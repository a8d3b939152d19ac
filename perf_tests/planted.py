"""A deliberate CPU slowdown of known size, to check that the comparison catches what it should.

Set only for the validation runs (notes/comparison.md): `PCVR_PLANTED_CPU_SLOWDOWN=0.10` makes every data
case spend 10% more CPU time (after its real work, in its timed region, on its own thread). Product code
never reads it; the data benchmarks wrap their timed function with `planted`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

ENV = "PCVR_PLANTED_CPU_SLOWDOWN"


def planted_fraction() -> float:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a fraction such as 0.10") from None
    if not 0.0 <= value <= 10.0:
        raise ValueError(f"{ENV}={raw!r}: expected a fraction between 0 and 10")
    return value


def burn_cpu(seconds: float, clock: Callable[[], float] = time.thread_time) -> None:
    """Spin until this thread has used `seconds` more CPU time."""
    end = clock() + seconds
    while clock() < end:
        pass


def planted(fn: Callable, clock: Callable[[], float] = time.thread_time) -> Callable:
    """`fn`, followed by fraction x the CPU time it took of spinning (unchanged when the variable is unset)."""
    fraction = planted_fraction()
    if fraction == 0.0:
        return fn

    @functools.wraps(fn)
    def slower(*args, **kwargs):
        t0 = clock()
        result = fn(*args, **kwargs)
        burn_cpu((clock() - t0) * fraction, clock)
        return result

    return slower


# ---------------------------------------------------------------- GPU: a worse launch configuration

KERNEL_ENV = "PCVR_PLANTED_NORM_TILE"


def planted_norm_tile() -> int | None:
    """Elements per program the norm kernels are forced to (instead of config.TILE_ELEMENTS), or None."""
    raw = os.environ.get(KERNEL_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 32 or int(raw) & (int(raw) - 1):
        raise ValueError(f"{KERNEL_ENV}={raw!r}: expected a power of two >= 32 (elements per program)")
    return int(raw)
