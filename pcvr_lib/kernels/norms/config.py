"""Launch shapes shared by the norm kernels (RMSNorm and LayerNorm, Triton and TileLang).

A "width class" is the padded width (next power of two); the tile holds BLOCK_M rows of it, chosen so
one program moves about TILE_ELEMENTS elements: narrow rows get many rows per program (enough bytes in flight),
wide rows one row. The row count never enters the choice, so a new M reuses the compiled kernel.
"""

from __future__ import annotations

import functools

import torch

from pcvr_lib.kernels._triton import next_pow2, sm_count

MAX_WIDTH = 16384  # one row must fit in registers; wider rows are rejected with a clear error
# Elements per program: the fastest of 1024-8192 in the H200 tile sweep, forward and backward (the explore
# benchmark perf_tests/test_norms.py::test_triton_tile_exploration; figures in notes/kernels.md).
TILE_ELEMENTS = 2048
# Programs per SM of the persistent backward grid (2 and 8 were within a few percent of 4 in the sweep).
BWD_PROGRAMS_PER_SM = 4


def block_config(width: int) -> tuple[int, int]:
    """(rows per program, warps per program) for a row width (TILE_ELEMENTS per program)."""
    return _block_config(width, TILE_ELEMENTS)


def backward_launch(x2: torch.Tensor) -> tuple[int, int, int, int, int, torch.Tensor]:
    """(rows, width, rows per program, warps, programs, dx) of a norm backward over the (M, N) input `x2`: a
    persistent grid (persistent_programs) and the dx buffer it fills."""
    m, n = x2.shape
    block_m, num_warps = block_config(n)
    return m, n, block_m, num_warps, persistent_programs(m, block_m, sm_count(x2.device.index)), torch.empty_like(x2)


def persistent_programs(rows: int, block_m: int, sms: int) -> int:
    """Programs of a persistent backward grid: BWD_PROGRAMS_PER_SM per SM, no more than there are row blocks."""
    return max(1, min(-(-rows // block_m), BWD_PROGRAMS_PER_SM * sms))


@functools.cache
def _block_config(width: int, tile_elements: int) -> tuple[int, int]:
    if width > MAX_WIDTH:
        raise ValueError(f"norm width {width} exceeds the supported maximum {MAX_WIDTH}")
    block_n = next_pow2(width)
    block_m = max(1, min(64, tile_elements // block_n))
    elements = block_m * block_n
    num_warps = min(16, max(4, elements // 512))
    return block_m, num_warps


def paired_rows(length: int, device) -> torch.Tensor:
    """A (2, length) fp32 tensor from one allocation whose two rows each start 16-byte aligned.

    Slices of one (2, length) tensor would put the second at 4 * length bytes: its alignment would
    then change with the row count, and triton specialises (recompiles) on pointer alignment.
    """
    stride = (length + 3) // 4 * 4
    buf = torch.empty((2, stride), dtype=torch.float32, device=device)
    return buf[:, :length]
