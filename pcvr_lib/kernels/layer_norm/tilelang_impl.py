"""LayerNorm in TileLang: forward (optionally saving mean and 1/std) and backward (dx + per-program
dw/db partials). Tiling as RMSNorm's (pcvr_lib.kernels.rms_norm.config); padded columns are masked
out of the variance; M and G are symbolic, so the row count never recompiles."""

import tilelang.language as T
import torch

from pcvr_lib.kernels._tilelang import LAUNCHERS
from pcvr_lib.kernels._triton import sm_count
from pcvr_lib.kernels.rms_norm.common import norm_kernels
from pcvr_lib.kernels.rms_norm.config import block_config, next_pow2, paired_rows, persistent_programs


def build_forward(n: int, dtype: str, save_stats: bool):
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
        for i, j in T.Parallel(block_m, block_n):
            xf[i, j] = T.cast(xs[i, j], acc)
        T.reduce_sum(xf, mean, dim=1)
        for i in T.Parallel(block_m):
            mean[i] = mean[i] / n
        for i, j in T.Parallel(block_m, block_n):
            xf[i, j] = T.if_then_else(j < n, xf[i, j] - mean[i], T.cast(0, acc))
            sq[i, j] = xf[i, j] * xf[i, j]
        T.reduce_sum(sq, r, dim=1)
        for i in T.Parallel(block_m):
            r[i] = T.rsqrt(r[i] / n + eps)
        for i, j in T.Parallel(block_m, block_n):
            xs[i, j] = T.cast(xf[i, j] * r[i] * T.cast(W[j], acc) + T.cast(B[j], acc), dtype)
        T.copy(xs, Y[bx * block_m, 0])

    @T.prim_func
    def ln_fwd_train(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), B: T.Tensor((n,), dtype),
                     Y: T.Tensor((m, n), dtype), MEAN: T.Tensor((m,), acc), RSTD: T.Tensor((m,), acc),
                     eps: T.float32):
        with T.Kernel(T.ceildiv(m, block_m), threads=num_warps * 32) as bx:
            mean = T.alloc_fragment((block_m,), acc)
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, B, Y, eps, bx, mean, r)
            T.copy(mean, MEAN[bx * block_m])
            T.copy(r, RSTD[bx * block_m])

    @T.prim_func
    def ln_fwd_infer(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), B: T.Tensor((n,), dtype),
                     Y: T.Tensor((m, n), dtype), eps: T.float32):
        with T.Kernel(T.ceildiv(m, block_m), threads=num_warps * 32) as bx:
            mean = T.alloc_fragment((block_m,), acc)
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, B, Y, eps, bx, mean, r)

    return ln_fwd_train if save_stats else ln_fwd_infer


def build_backward(n: int, dtype: str):
    block_m, num_warps = block_config(n)
    block_n = next_pow2(n)
    m = T.dynamic("M")
    g = T.dynamic("G")
    acc = "float32"

    @T.prim_func
    def ln_bwd(DY: T.Tensor((m, n), dtype), X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype),
               MEAN: T.Tensor((m,), acc), RSTD: T.Tensor((m,), acc), DX: T.Tensor((m, n), dtype),
               DWP: T.Tensor((g, n), acc), DBP: T.Tensor((g, n), acc)):
        with T.Kernel(g, threads=num_warps * 32) as bx:
            xs = T.alloc_fragment((block_m, block_n), dtype)
            dys = T.alloc_fragment((block_m, block_n), dtype)
            mu = T.alloc_fragment((block_m,), acc)
            r = T.alloc_fragment((block_m,), acc)
            xh = T.alloc_fragment((block_m, block_n), acc)
            gw = T.alloc_fragment((block_m, block_n), acc)
            prod = T.alloc_fragment((block_m, block_n), acc)
            dyf = T.alloc_fragment((block_m, block_n), acc)
            c1 = T.alloc_fragment((block_m,), acc)
            c2 = T.alloc_fragment((block_m,), acc)
            dw = T.alloc_fragment((block_n,), acc)
            db = T.alloc_fragment((block_n,), acc)
            T.clear(dw)
            T.clear(db)
            for it in T.serial(T.ceildiv(T.ceildiv(m, block_m) - bx, g)):
                row0 = (bx + it * g) * block_m
                T.copy(X[row0, 0], xs)
                T.copy(DY[row0, 0], dys)
                T.copy(MEAN[row0], mu)
                T.copy(RSTD[row0], r)
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
                T.copy(xs, DX[row0, 0])
                T.reduce_sum(prod, dw, dim=0, clear=False)
                T.reduce_sum(dyf, db, dim=0, clear=False)
            T.copy(dw, DWP[bx, 0])
            T.copy(db, DBP[bx, 0])

    return ln_bwd


KERNELS = norm_kernels("layer_norm", build_forward, build_backward)


def forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, save_stats: bool):
    m, n = x2.shape
    y = torch.empty_like(x2)
    key = ("layer_norm.fwd_train" if save_stats else "layer_norm.fwd_infer", n, x2.dtype, x2.get_device())
    exe = LAUNCHERS.get(key) or KERNELS.first(key, x2.device)
    if not save_stats:
        exe(x2, weight, bias, y, eps)
        return y, None
    mean, rstd = paired_rows(m, x2.device).unbind(0)
    exe(x2, weight, bias, y, mean, rstd, eps)
    return y, (mean, rstd)


def backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    m, n = x2.shape
    block_m, _ = block_config(n)
    programs = persistent_programs(m, block_m, sm_count(x2.device.index))
    dx = torch.empty_like(x2)
    partial = paired_rows(programs * n, x2.device).view(2, programs, n)
    key = ("layer_norm.bwd", n, x2.dtype, x2.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, x2.device))(dy, x2, weight, mean, rstd, dx, partial[0], partial[1])
    sums = partial.sum(1).to(weight.dtype)
    return dx, sums[0], sums[1]
