"""The embedding-bag launch configurations: Triton's tile shape and TileLang's thread geometry."""

from __future__ import annotations

from typing import NamedTuple

from .._triton import next_pow2

# Elements of gathered rows one program keeps in flight per chunk: enough independent 16-byte loads
# per thread to cover DRAM latency, few enough registers for several programs per SM.
TILE_ELEMENTS = 4096


class LaunchConfig(NamedTuple):
    block_b: int
    block_l: int
    block_d: int
    num_warps: int


def launch_config(batch: int, bag: int, dim: int, elem_bytes: int) -> LaunchConfig:
    """Tile shape for a (batch, bag, dim) problem. It depends on dim and on the bag length's power-of-two
    class (capped at 8) only, never on the batch size, so a batch change never recompiles."""
    block_d = next_pow2(dim)
    block_l = min(next_pow2(bag), 8)
    block_b = max(1, min(64, TILE_ELEMENTS // (block_d * block_l)))
    num_warps = 4 if block_b * block_d >= 1024 else 2
    return LaunchConfig(block_b, block_l, block_d, num_warps)


# TileLang: threads per block, and the bag positions whose row loads one thread issues at once
TILELANG_THREADS = 128
TILELANG_UNROLL = 4


def tilelang_geometry(dim: int, vec: int) -> tuple[int, int, int]:
    """(threads per bag, bags per block, column chunks per thread)."""
    cols = -(-dim // vec)
    tpr = 1
    while tpr < cols and tpr < TILELANG_THREADS:
        tpr *= 2
    return tpr, TILELANG_THREADS // tpr, -(-cols // tpr)


def vector_width(dim: int, elem_bytes: int, ptr: int) -> int:
    """Columns per 16-byte vector load (1 when the width or the pointer is not aligned to it)."""
    vec = 16 // elem_bytes
    return vec if dim % vec == 0 and ptr % 16 == 0 else 1
