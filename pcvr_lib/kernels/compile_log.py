"""Seconds each kernel variant took to compile (or to load from a disk cache) in this process.

Both launchers (`_triton`, `_tilelang`) record here, keyed by (DSL, kernel name, ...variant key); the
benchmarks report an op's compile seconds from it and the recompilation tests count its entries.
"""

from __future__ import annotations

SECONDS: dict[tuple, float] = {}


def record(dsl: str, key: tuple, seconds: float) -> None:
    SECONDS[(dsl, *key)] = seconds


def total(dsl: str, prefix: str = "") -> float:
    """Seconds of the variants compiled by `dsl` whose kernel name starts with `prefix` (e.g. "rms_norm")."""
    return sum(s for k, s in SECONDS.items() if k[0] == dsl and k[1].startswith(prefix))


def count(dsl: str, prefix: str = "") -> int:
    """How many variants `dsl` compiled (or loaded) for kernel names starting with `prefix`."""
    return sum(1 for k in SECONDS if k[0] == dsl and k[1].startswith(prefix))
