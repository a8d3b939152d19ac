"""RMSNorm and LayerNorm in TileLang: forwards (optionally saving 1/rms, or mean and 1/std) and backwards (dx
plus per-program dw / db partials).

Same tiling as the Triton kernels (config.py): BLOCK_M rows of the width padded
to a power of two per block; TileLang guards the out-of-range rows and columns of each copy, and the
mean divides by the true width. M (rows) and G (backward programs) are symbolic: one compile per
(kind, width, dtype). The width stays static on purpose: TileLang then proves the 16-byte alignment
of every row and emits vector loads (a symbolic width gives guarded scalar code). LayerNorm masks the
padded columns out of the variance.
"""

import tilelang.language as T
import torch

from pcvr_lib.kernels._tilelang import LAUNCHERS, Kernels
from pcvr_lib.kernels.norms.config import backward_launch, block_config, next_pow2, paired_rows


def build_forward(n: int, dtype: str, save_stats: bool, centered: bool):
    """The forward prim_func of RMSNorm, or of LayerNorm when `centered`; with `save_stats` it also writes 1/rms
    (and the mean)."""
    block_m, num_warps = block_config(n)
    block_n = next_pow2(n)
    m = T.dynamic("M")
    acc = "float32"

    @T.macro
    def body(X, W, B, Y, eps, bx, mean, r):
        xs = T.alloc_fragment((block_m, block_n), dtype)
        xf = T.alloc_fragment((block_m, block_n), acc)
        sq = T.alloc_fragment((block_m, block_n), acc)
        T.copy(X[bx * block_m, 0], xs)
        if centered:
            for i, j in T.Parallel(block_m, block_n):
                xf[i, j] = T.cast(xs[i, j], acc)
            T.reduce_sum(xf, mean, dim=1)
            for i in T.Parallel(block_m):
                mean[i] = mean[i] / n
            for i, j in T.Parallel(block_m, block_n):
                xf[i, j] = T.if_then_else(j < n, xf[i, j] - mean[i], T.cast(0, acc))
                sq[i, j] = xf[i, j] * xf[i, j]
        else:
            for i, j in T.Parallel(block_m, block_n):
                xf[i, j] = T.cast(xs[i, j], acc)
                sq[i, j] = xf[i, j] * xf[i, j]
        T.reduce_sum(sq, r, dim=1)
        for i in T.Parallel(block_m):
            r[i] = T.rsqrt(r[i] / n + eps)
        for i, j in T.Parallel(block_m, block_n):
            if centered:
                xs[i, j] = T.cast(xf[i, j] * r[i] * T.cast(W[j], acc) + T.cast(B[j], acc), dtype)
            else:
                xs[i, j] = T.cast(xf[i, j] * r[i] * T.cast(W[j], acc), dtype)
        T.copy(xs, Y[bx * block_m, 0])

    grid, threads = T.ceildiv(m, block_m), num_warps * 32
    if not centered:  # RMSNorm: no bias, no mean (their slots in `body` take arguments it never reads)
        @T.prim_func
        def rms_fwd_train(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), Y: T.Tensor((m, n), dtype),
                          RSTD: T.Tensor((m,), acc), eps: T.float32):
            with T.Kernel(grid, threads=threads) as bx:
                r = T.alloc_fragment((block_m,), acc)
                body(X, W, W, Y, eps, bx, r, r)
                T.copy(r, RSTD[bx * block_m])

        @T.prim_func
        def rms_fwd_infer(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), Y: T.Tensor((m, n), dtype),
                          eps: T.float32):
            with T.Kernel(grid, threads=threads) as bx:
                r = T.alloc_fragment((block_m,), acc)
                body(X, W, W, Y, eps, bx, r, r)

        return rms_fwd_train if save_stats else rms_fwd_infer

    @T.prim_func
    def ln_fwd_train(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), B: T.Tensor((n,), dtype),
                     Y: T.Tensor((m, n), dtype), MEAN: T.Tensor((m,), acc), RSTD: T.Tensor((m,), acc),
                     eps: T.float32):
        with T.Kernel(grid, threads=threads) as bx:
            mean = T.alloc_fragment((block_m,), acc)
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, B, Y, eps, bx, mean, r)
            T.copy(mean, MEAN[bx * block_m])
            T.copy(r, RSTD[bx * block_m])

    @T.prim_func
    def ln_fwd_infer(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), B: T.Tensor((n,), dtype),
                     Y: T.Tensor((m, n), dtype), eps: T.float32):
        with T.Kernel(grid, threads=threads) as bx:
            mean = T.alloc_fragment((block_m,), acc)
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, B, Y, eps, bx, mean, r)

    return ln_fwd_train if save_stats else ln_fwd_infer


def build_backward(n: int, dtype: str, centered: bool):
    """The backward prim_func of RMSNorm, or of LayerNorm when `centered`: dx, and per-program partial sums of
    dw (and db) over the row blocks of its persistent loop."""
    block_m, num_warps = block_config(n)
    block_n = next_pow2(n)
    m = T.dynamic("M")
    g = T.dynamic("G")
    acc = "float32"

    @T.macro
    def body(DY, X, W, MEAN, RSTD, DX, DWP, DBP, bx):
        xs = T.alloc_fragment((block_m, block_n), dtype)
        dys = T.alloc_fragment((block_m, block_n), dtype)
        if centered:
            mu = T.alloc_fragment((block_m,), acc)
        r = T.alloc_fragment((block_m,), acc)
        xh = T.alloc_fragment((block_m, block_n), acc)
        gw = T.alloc_fragment((block_m, block_n), acc)
        prod = T.alloc_fragment((block_m, block_n), acc)
        if centered:
            dyf = T.alloc_fragment((block_m, block_n), acc)
            c1 = T.alloc_fragment((block_m,), acc)
            c2 = T.alloc_fragment((block_m,), acc)
        else:
            c = T.alloc_fragment((block_m,), acc)
        dw = T.alloc_fragment((block_n,), acc)
        if centered:
            db = T.alloc_fragment((block_n,), acc)
        T.clear(dw)
        if centered:
            T.clear(db)
        for it in T.serial(T.ceildiv(T.ceildiv(m, block_m) - bx, g)):
            row0 = (bx + it * g) * block_m
            T.copy(X[row0, 0], xs)
            T.copy(DY[row0, 0], dys)
            if centered:
                T.copy(MEAN[row0], mu)
            T.copy(RSTD[row0], r)
            if centered:
                for i, j in T.Parallel(block_m, block_n):
                    xh[i, j] = T.if_then_else(j < n, (T.cast(xs[i, j], acc) - mu[i]) * r[i], T.cast(0, acc))
                    dyf[i, j] = T.cast(dys[i, j], acc)
                    gw[i, j] = dyf[i, j] * T.cast(W[j], acc)
                    prod[i, j] = gw[i, j] * xh[i, j]
                T.reduce_sum(prod, c1, dim=1)
                T.reduce_sum(gw, c2, dim=1)
                for i, j in T.Parallel(block_m, block_n):
                    xs[i, j] = T.cast((gw[i, j] - xh[i, j] * (c1[i] / n) - c2[i] / n) * r[i], dtype)
                    prod[i, j] = dyf[i, j] * xh[i, j]
            else:
                for i, j in T.Parallel(block_m, block_n):
                    xh[i, j] = T.cast(xs[i, j], acc) * r[i]
                    gw[i, j] = T.cast(dys[i, j], acc) * T.cast(W[j], acc)
                    prod[i, j] = gw[i, j] * xh[i, j]
                T.reduce_sum(prod, c, dim=1)
                for i, j in T.Parallel(block_m, block_n):
                    xs[i, j] = T.cast((gw[i, j] - xh[i, j] * (c[i] / n)) * r[i], dtype)
                    prod[i, j] = T.cast(dys[i, j], acc) * xh[i, j]
            T.copy(xs, DX[row0, 0])
            T.reduce_sum(prod, dw, dim=0, clear=False)
            if centered:
                T.reduce_sum(dyf, db, dim=0, clear=False)
        T.copy(dw, DWP[bx, 0])
        if centered:
            T.copy(db, DBP[bx, 0])

    if not centered:
        @T.prim_func
        def rms_bwd(DY: T.Tensor((m, n), dtype), X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype),
                    RSTD: T.Tensor((m,), acc), DX: T.Tensor((m, n), dtype), DWP: T.Tensor((g, n), acc)):
            with T.Kernel(g, threads=num_warps * 32) as bx:
                body(DY, X, W, RSTD, RSTD, DX, DWP, DWP, bx)

        return rms_bwd

    @T.prim_func
    def ln_bwd(DY: T.Tensor((m, n), dtype), X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype),
               MEAN: T.Tensor((m,), acc), RSTD: T.Tensor((m,), acc), DX: T.Tensor((m, n), dtype),
               DWP: T.Tensor((g, n), acc), DBP: T.Tensor((g, n), acc)):
        with T.Kernel(g, threads=num_warps * 32) as bx:
            body(DY, X, W, MEAN, RSTD, DX, DWP, DBP, bx)

    return ln_bwd


def _kernels(op: str, centered: bool) -> dict:
    """One norm's TileLang kernels by name: inference forward, training forward (saves statistics), backward."""
    return {f"{op}.fwd_infer": lambda n, dtype: build_forward(n, dtype, False, centered),
            f"{op}.fwd_train": lambda n, dtype: build_forward(n, dtype, True, centered),
            f"{op}.bwd": lambda n, dtype: build_backward(n, dtype, centered)}


KERNELS = Kernels({**_kernels("rms_norm", False), **_kernels("layer_norm", True)})


def rms_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, save_rstd: bool):
    m, n = x2.shape
    y = torch.empty_like(x2)
    key = ("rms_norm.fwd_train" if save_rstd else "rms_norm.fwd_infer", n, x2.dtype, x2.get_device())
    exe = LAUNCHERS.get(key) or KERNELS.first(key, x2.device)
    if not save_rstd:
        exe(x2, weight, y, eps)
        return y, None
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    exe(x2, weight, y, rstd, eps)
    return y, rstd


def rms_backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    _, n, _, _, programs, dx = backward_launch(x2)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    key = ("rms_norm.bwd", n, x2.dtype, x2.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, x2.device))(dy, x2, weight, rstd, dx, partial)
    return dx, partial.sum(0).to(weight.dtype)


def ln_forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, save_stats: bool):
    m, n = x2.shape
    y = torch.empty_like(x2)
    key = ("layer_norm.fwd_train" if save_stats else "layer_norm.fwd_infer", n, x2.dtype, x2.get_device())
    exe = LAUNCHERS.get(key) or KERNELS.first(key, x2.device)
    if not save_stats:
        exe(x2, weight, bias, y, eps)
        return y, None
    stats = paired_rows(m, x2.device)  # (2, M): the rows' mean and 1/std
    exe(x2, weight, bias, y, stats[0], stats[1], eps)
    return y, stats


def ln_backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    _, n, _, _, programs, dx = backward_launch(x2)
    partial = paired_rows(programs * n, x2.device).view(2, programs, n)
    key = ("layer_norm.bwd", n, x2.dtype, x2.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, x2.device))(dy, x2, weight, mean, rstd, dx, partial[0], partial[1])
    sums = partial.sum(1).to(weight.dtype)
    return dx, sums[0], sums[1]
