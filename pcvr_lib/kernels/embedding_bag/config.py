"""The embedding-bag launch configuration (Triton's tile shape; TileLang's geometry is in tilelang_impl)."""

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
