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
# Programs per SM of TileLang's persistent backward grid (2 and 8 were within a few percent of 4 in the sweep).
BWD_PROGRAMS_PER_SM = 4
# Triton's backward loads the next row block before computing this one and runs as many programs per SM as
# make BWD_WARPS_PER_SM warps: 2 of 8 warps at width 4096, 4 of 4 warps at widths up to 1024. With the
# prefetch that was the fastest grid at every width of the H200 sweep, 9-25% faster than 4 programs without
# it (perf_tests/test_norms.py::test_triton_tile_exploration; notes/kernels.md).
BWD_WARPS_PER_SM = 16
BWD_PREFETCH = True


def block_config(width: int) -> tuple[int, int]:
    """(rows per program, warps per program) for a row width (TILE_ELEMENTS per program)."""
    return _block_config(width, TILE_ELEMENTS)


def backward_launch(x2: torch.Tensor, warps_per_sm: int | None = None) -> tuple[int, int, int, int, int, torch.Tensor]:
    """(rows, width, rows per program, warps, programs, dx) of a norm backward over the (M, N) input `x2`: a
    persistent grid (persistent_programs) and the dx buffer it fills. `warps_per_sm`: as many programs per SM
    as make that many warps (at least one); None: BWD_PROGRAMS_PER_SM."""
    m, n = x2.shape
    block_m, num_warps = block_config(n)
    per_sm = BWD_PROGRAMS_PER_SM if warps_per_sm is None else max(1, warps_per_sm // num_warps)
    programs = persistent_programs(m, block_m, sm_count(x2.device.index), per_sm)
    return m, n, block_m, num_warps, programs, torch.empty_like(x2)


def persistent_programs(rows: int, block_m: int, sms: int, per_sm: int = BWD_PROGRAMS_PER_SM) -> int:
    """Programs of a persistent backward grid: per_sm per SM, no more than there are row blocks."""
    return max(1, min(-(-rows // block_m), per_sm * sms))


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
