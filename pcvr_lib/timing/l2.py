"""L2 handling of a GPU case: the device number must not profit from data a previous call left in L2.

A case either rotates its calls over input copies that together exceed L2 ("rotate"), has a flush captured
before every call whose own time (a flush-only graph) is subtracted ("flush"), or says it runs warm ("warm").
"""

from __future__ import annotations

import functools
import math

L2_FLUSH_BYTES = 128 << 20  # over twice the H200's 50 MB L2: every line is evicted
L2_MODES = ("rotate", "flush", "warm")
DEFAULT_L2_BYTES = 50 << 20  # the H200's L2, used when the device does not report its own


def resolve_l2_mode(l2: str | None, flush_l2_cache: bool, rotations: int) -> str:
    """The case's L2 handling: explicit `l2`, else "rotate" when several input copies are given, else
    "flush" (or "warm" when the caller turned flushing off)."""
    if l2 is None:
        l2 = "rotate" if rotations > 1 else ("flush" if flush_l2_cache else "warm")
    if l2 not in L2_MODES:
        raise ValueError(f"l2={l2!r}: expected one of {', '.join(L2_MODES)}")
    if l2 == "rotate" and rotations < 2:
        raise ValueError("l2='rotate' needs a sequence of calls over distinct input copies (got one call)")
    return l2


def rotation_copies(bytes_per_call: int, l2: int = DEFAULT_L2_BYTES) -> int:
    """Input copies a case must rotate over so that one cycle touches at least twice the L2."""
    return max(2, math.ceil(2 * l2 / max(1, bytes_per_call)))


@functools.cache
def _flush_buffer(device_index: int, size: int = L2_FLUSH_BYTES):
    import torch

    return torch.empty(size, dtype=torch.uint8, device=f"cuda:{device_index}")


def flush_l2(device=None, size: int = L2_FLUSH_BYTES) -> None:
    """Overwrite a buffer larger than L2, evicting earlier data (asynchronous)."""
    import torch

    index = torch.device(device if device is not None else "cuda").index
    _flush_buffer(torch.cuda.current_device() if index is None else index, size).zero_()

