"""The C heap of this process (glibc's malloc, where torch's CPU tensors live): when freed memory goes back
to the OS, and when it is kept for reuse.

By default glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps
it on free, so a CPU training step that makes the same 50-120 MB temporaries on every step (symbiosis at the
smoke's sizes: [14080, 2048] fp32 FFN activations) faults every page of them in again each time, and the
kernel zeroes them: 270k-1.2M page faults and 1.6-7.7 s of system time per step on a 2-core VM, against
4.2-4.5 s of user time (notes/models.md). `keep_freed_heap()` serves them from the heap instead and keeps what
is freed there, so a step reuses the previous step's pages.

Elsewhere than glibc (musl, macOS) both functions do nothing and say so.
"""

from __future__ import annotations

import ctypes
import functools

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_UP_TO = 2**31 - 1  # free bytes at the heap's top kept before trimming (mallopt takes a C int)


@functools.cache
def _glibc():
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS now (before a fork: a child would copy each page its
    allocator writes into). True where the C library can (glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def keep_freed_heap() -> bool:
    """From now on, serve large blocks from the heap (no per-block mappings) and keep up to 2 GiB of freed
    memory at its top, so that repeated temporaries reuse pages instead of faulting in fresh zeroed ones.
    Process-wide and not undone (glibc then stops adapting its thresholds); the process's resident size stays
    near its peak. True where applied (glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO))
