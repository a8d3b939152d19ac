"""Deliberate slowdowns of known size, to check that the comparison catches what it should.

Set only for the validation runs (notes/comparison.md); product code never reads them:
  PCVR_PLANTED_CPU_SLOWDOWN=0.10  every data case spends 10% more CPU time (after its real work, in its timed
                                  region, on its own thread): the data benchmarks wrap their timed function
                                  with `planted`
  PCVR_PLANTED_NORM_TILE=256      the norm kernels run 256 elements per program (device time)
  PCVR_PLANTED_HOST_US=5          the Triton RMSNorm forward wrapper spins about 5 us of Python before its
                                  launch (host only: the device work is unchanged)
The GPU ones are applied by perf_tests/conftest.py's autouse fixtures.
"""

from __future__ import annotations

import functools
import importlib
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


# ---------------------------------------------------------------- GPU cases, host only: Python in one wrapper

HOST_ENV = "PCVR_PLANTED_HOST_US"
HOST_TARGET = ("pcvr_lib.kernels.norms.triton_impl", "rms_forward")  # every Triton RMSNorm forward calls it


def planted_host_us() -> float | None:
    """Microseconds of Python spinning the planted wrapper adds per call, or None."""
    raw = os.environ.get(HOST_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{HOST_ENV}={raw!r}: expected microseconds such as 5") from None
    if not 0.0 < value <= 10_000.0:
        raise ValueError(f"{HOST_ENV}={raw!r}: expected microseconds between 0 and 10000")
    return value


def spin(iterations: int) -> None:
    """A Python loop of `iterations` steps: a fixed amount of Python work with no call inside it."""
    step = 0
    while step < iterations:
        step += 1


def spin_iterations(us: float) -> int:
    """How many `spin` steps take `us` microseconds on this host (the fastest of 5 timings of 20,000 steps)."""
    per_step = min(_timed_spin(20_000) for _ in range(5)) / 20_000
    return max(1, round(us * 1e-6 / per_step))


def _timed_spin(iterations: int) -> float:
    t0 = time.perf_counter()
    spin(iterations)
    return time.perf_counter() - t0


def plant_host_delay(monkeypatch, us: float) -> int:
    """Replace HOST_TARGET by a wrapper that spins about `us` of Python before calling it (monkeypatch undoes
    it); returns the spin's steps. The steps are calibrated once, so every call does the same work: two more
    Python calls per call (the wrapper and `spin`), which counted work sees exactly."""
    module = importlib.import_module(HOST_TARGET[0])
    original = getattr(module, HOST_TARGET[1])
    steps = spin_iterations(us)

    @functools.wraps(original)
    def slower(*args, **kwargs):
        spin(steps)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, HOST_TARGET[1], slower)
    return steps
