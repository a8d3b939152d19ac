"""RMSNorm and LayerNorm in Triton: forwards (optionally saving 1/rms, or mean and 1/std) and backwards (dx
plus per-program dw / db partials).

Each program handles BLOCK_M rows of the full (padded) width, so narrow rows still give every program
several kilobytes to move. The row count M is not specialised on (a new M never recompiles); the width
N is a runtime argument that triton specialises only on divisibility by 16 (the 16-byte vector loads),
so one compile serves a whole width class (BLOCK_N = next power of two).
"""

from __future__ import annotations

import torch
import triton.language as tl

from pcvr_lib.kernels._triton import Launcher, align_key, cdiv, helper, kernel, next_pow2
from pcvr_lib.kernels.norms import config
from pcvr_lib.kernels.norms.config import backward_launch, block_config, paired_rows


@helper
def row_tile(start, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows start .. start + BLOCK_M of an (M, N) row-major tensor, its width padded to BLOCK_N: (rows, row
    mask, columns, column mask, tile mask, int64 element offsets). Every norm kernel's row tile."""
    rows = start + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    return rows, rmask, cols, cmask, mask, offs


@helper
def norm_forward(X, W, B, Y, MEAN, RSTD, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SAVE_STATS: tl.constexpr, CENTERED: tl.constexpr):
    """One row block of a norm forward: RMSNorm, or LayerNorm when CENTERED (mean removed, bias added); B and
    MEAN are read only when CENTERED, the statistics stored only when SAVE_STATS."""
    rows, rmask, cols, cmask, mask, offs = row_tile(tl.program_id(0) * BLOCK_M, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if CENTERED:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        x = tl.where(cmask[None, :], x - mean[:, None], 0.0)  # padded columns stay out of the variance
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None] * w[None, :]
    if CENTERED:
        y = y + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if SAVE_STATS:
        if CENTERED:
            tl.store(MEAN + rows, mean, mask=rmask)
        tl.store(RSTD + rows, rstd, mask=rmask)


@helper
def backward_rows(X, DY, MEAN, RSTD, start, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CENTERED: tl.constexpr):
    """The loads of one backward row block: x and dy in their dtype, the rows' 1/std and (when CENTERED) mean;
    RMSNorm's mean slot repeats its 1/std (never read)."""
    rows, rmask, _, _, mask, offs = row_tile(start, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0) if CENTERED else rstd
    return x, dy, mean, rstd


@helper
def norm_backward(DY, X, W, MEAN, RSTD, DX, DWP, DBP, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CENTERED: tl.constexpr, PREFETCH: tl.constexpr):
    """A persistent program of a norm backward: dx of its row blocks and its partial dw (and db when
    CENTERED) sums, which the caller adds over programs. PREFETCH: the next row block's loads (x, dy and the
    rows' statistics) are issued before this one is computed: two blocks in flight per program instead of
    one, and no dependent load at the top of an iteration (the loop is bound by the bytes each SM has in
    flight)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    # dw (db) accumulate per (row slot, column) in registers and are summed over rows once after the loop (a
    # cross-row reduction per iteration would go through shared memory each time)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if CENTERED:
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        x_next, dy_next, mean_next, rstd_next = backward_rows(X, DY, MEAN, RSTD, pid * BLOCK_M, M, N, BLOCK_M,
                                                              BLOCK_N, CENTERED)
    for start in range(pid * BLOCK_M, M, step):
        # (its columns repeat those above; the compiler merges the two)
        _, _, _, _, mask, offs = row_tile(start, M, N, BLOCK_M, BLOCK_N)
        if PREFETCH:
            x, dy, mean, rstd = x_next, dy_next, mean_next, rstd_next
            x_next, dy_next, mean_next, rstd_next = backward_rows(X, DY, MEAN, RSTD, start + step, M, N, BLOCK_M,
                                                                  BLOCK_N, CENTERED)
        else:
            x, dy, mean, rstd = backward_rows(X, DY, MEAN, RSTD, start, M, N, BLOCK_M, BLOCK_N, CENTERED)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        if CENTERED:
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        else:
            xhat = x * rstd[:, None]
        gw = dy * w[None, :]
        c1 = tl.sum(gw * xhat, axis=1) / N
        if CENTERED:
            c2 = tl.sum(gw, axis=1) / N
            dx = (gw - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        else:
            dx = (gw - xhat * c1[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if CENTERED:
            db += dy
    tl.store(DWP + pid * N + cols, tl.sum(dw, axis=0), mask=cmask)
    if CENTERED:
        tl.store(DBP + pid * N + cols, tl.sum(db, axis=0), mask=cmask)


# The kernels: RMSNorm's take no bias, mean or bias partials (their slots get an argument never read).
@kernel(do_not_specialize=["M"])
def _rms_fwd(X, W, Y, RSTD, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             SAVE_RSTD: tl.constexpr):
    norm_forward(X, W, W, Y, RSTD, RSTD, M, N, eps, BLOCK_M, BLOCK_N, SAVE_RSTD, False)


@kernel(do_not_specialize=["M"])
def _rms_bwd(DY, X, W, RSTD, DX, DWP, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             PREFETCH: tl.constexpr):
    norm_backward(DY, X, W, RSTD, RSTD, DX, DWP, DWP, M, N, BLOCK_M, BLOCK_N, False, PREFETCH)


@kernel(do_not_specialize=["M"])
def _ln_fwd(X, W, B, Y, MEAN, RSTD, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SAVE_STATS: tl.constexpr):
    norm_forward(X, W, B, Y, MEAN, RSTD, M, N, eps, BLOCK_M, BLOCK_N, SAVE_STATS, True)


@kernel(do_not_specialize=["M"])
def _ln_bwd(DY, X, W, MEAN, RSTD, DX, DWP, DBP, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PREFETCH: tl.constexpr):
    norm_backward(DY, X, W, MEAN, RSTD, DX, DWP, DBP, M, N, BLOCK_M, BLOCK_N, True, PREFETCH)


_launch_rms_fwd = Launcher(_rms_fwd, "rms_norm.fwd")
_launch_rms_bwd = Launcher(_rms_bwd, "rms_norm.bwd")


def rms_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, save_rstd: bool):
    """x2: (M, N) contiguous. Returns (y, rstd or None)."""
    m, n = x2.shape
    block_m, num_warps = block_config(n)
    y = torch.empty_like(x2)
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device) if save_rstd else y
    args = (x2, weight, y, rstd, m, n, eps, block_m, next_pow2(n), save_rstd)
    key = (x2.get_device(), next_pow2(n), block_m, num_warps, align_key(x2, weight, y, rstd, n), save_rstd)
    _launch_rms_fwd(key, (cdiv(m, block_m), 1, 1), args, num_warps)
    return y, (rstd if save_rstd else None)


def rms_backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """Returns (dx, dw) for the (M, N) forward input x2."""
    m, n, block_m, num_warps, programs, dx = backward_launch(x2, config.BWD_WARPS_PER_SM)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    prefetch = config.BWD_PREFETCH
    args = (dy, x2, weight, rstd, dx, partial, m, n, block_m, next_pow2(n), prefetch)
    key = (x2.get_device(), next_pow2(n), block_m, num_warps, align_key(dy, x2, weight, rstd, dx, partial, n),
           prefetch)
    _launch_rms_bwd(key, (programs, 1, 1), args, num_warps)
    return dx, partial.sum(0).to(weight.dtype)


_launch_ln_fwd = Launcher(_ln_fwd, "layer_norm.fwd")
_launch_ln_bwd = Launcher(_ln_bwd, "layer_norm.bwd")


def ln_forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, save_stats: bool):
    """x2: (M, N) contiguous. Returns (y, stats or None), stats (2, M) fp32: the rows' mean and 1/std."""
    m, n = x2.shape
    block_m, num_warps = block_config(n)
    y = torch.empty_like(x2)
    if save_stats:
        stats = paired_rows(m, x2.device)
        mean, rstd = stats[0], stats[1]
    else:
        mean = rstd = y  # never touched: SAVE_STATS is a compile-time False
    args = (x2, weight, bias, y, mean, rstd, m, n, eps, block_m, next_pow2(n), save_stats)
    key = (x2.get_device(), next_pow2(n), block_m, num_warps, align_key(x2, weight, bias, y, mean, rstd, n),
           save_stats)
    _launch_ln_fwd(key, (cdiv(m, block_m), 1, 1), args, num_warps)
    return y, (stats if save_stats else None)


def ln_backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """Returns (dx, dw, db) for the (M, N) forward input x2."""
    m, n, block_m, num_warps, programs, dx = backward_launch(x2, config.BWD_WARPS_PER_SM)
    partial = paired_rows(programs * n, x2.device).view(2, programs, n)
    prefetch = config.BWD_PREFETCH
    args = (dy, x2, weight, mean, rstd, dx, partial[0], partial[1], m, n, block_m, next_pow2(n), prefetch)
    key = (x2.get_device(), next_pow2(n), block_m, num_warps, align_key(*args[:8], n), prefetch)
    _launch_ln_bwd(key, (programs, 1, 1), args, num_warps)
    sums = partial.sum(1).to(weight.dtype)
    return dx, sums[0], sums[1]


def compile_for(arch: int, name: str, width: int, dtype: str = "fp16", flag: bool = True):
    """Compile one norm kernel ahead of time for CUDA compute capability `arch` (e.g. 90) without a GPU, as a
    launch of rows `width` wide would specialise it (16-byte aligned pointers; N when it divides by 16).
    `name`: "rms_fwd", "rms_bwd", "ln_fwd", "ln_bwd"; `flag`: a forward's SAVE_RSTD / SAVE_STATS. Returns
    triton's CompiledKernel (.asm["ptx"] the PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = {"rms_fwd": _rms_fwd, "rms_bwd": _rms_bwd, "ln_fwd": _ln_fwd, "ln_bwd": _ln_bwd}[name].compiled
    block_m, num_warps = block_config(width)
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": next_pow2(width), "SAVE_RSTD": flag, "SAVE_STATS": flag,
                  "PREFETCH": config.BWD_PREFETCH}
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("X", "W", "B", "Y", "DY", "DX"):
            signature[arg] = f"*{dtype}"
        elif arg in ("MEAN", "RSTD", "DWP", "DBP"):
            signature[arg] = "*fp32"
        else:
            signature[arg] = "fp32" if arg == "eps" else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
               if signature[arg].startswith("*") or (arg == "N" and width % 16 == 0)}
    return triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps})
