"""RMSNorm in TileLang: forward (optionally saving 1/rms) and backward (dx + per-program dw partials).

Same tiling as the Triton version (pcvr_lib.kernels.rms_norm.config): BLOCK_M rows of the width padded
to a power of two per block; TileLang guards the out-of-range rows and columns of each copy, and the
mean divides by the true width. M (rows) and G (backward programs) are symbolic: one compile per
(kind, width, dtype). The width stays static on purpose: TileLang then proves the 16-byte alignment
of every row and emits vector loads (a symbolic width gives guarded scalar code).
"""


import tilelang.language as T
import torch

from pcvr_lib.kernels._tilelang import LAUNCHERS
from pcvr_lib.kernels._triton import sm_count
from pcvr_lib.kernels.rms_norm.common import norm_kernels
from pcvr_lib.kernels.rms_norm.config import block_config, next_pow2, persistent_programs


def build_forward(n: int, dtype: str, save_rstd: bool):
    block_m, num_warps = block_config(n)
    block_n = next_pow2(n)
    m = T.dynamic("M")
    acc = "float32"

    @T.macro
    def body(X, W, Y, eps, bx, r):
        xs = T.alloc_fragment((block_m, block_n), dtype)
        xf = T.alloc_fragment((block_m, block_n), acc)
        sq = T.alloc_fragment((block_m, block_n), acc)
        T.copy(X[bx * block_m, 0], xs)
        for i, j in T.Parallel(block_m, block_n):
            xf[i, j] = T.cast(xs[i, j], acc)
            sq[i, j] = xf[i, j] * xf[i, j]
        T.reduce_sum(sq, r, dim=1)
        for i in T.Parallel(block_m):
            r[i] = T.rsqrt(r[i] / n + eps)
        for i, j in T.Parallel(block_m, block_n):
            xs[i, j] = T.cast(xf[i, j] * r[i] * T.cast(W[j], acc), dtype)
        T.copy(xs, Y[bx * block_m, 0])

    @T.prim_func
    def rms_fwd_train(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), Y: T.Tensor((m, n), dtype),
                      RSTD: T.Tensor((m,), acc), eps: T.float32):
        with T.Kernel(T.ceildiv(m, block_m), threads=num_warps * 32) as bx:
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, Y, eps, bx, r)
            T.copy(r, RSTD[bx * block_m])

    @T.prim_func
    def rms_fwd_infer(X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype), Y: T.Tensor((m, n), dtype),
                      eps: T.float32):
        with T.Kernel(T.ceildiv(m, block_m), threads=num_warps * 32) as bx:
            r = T.alloc_fragment((block_m,), acc)
            body(X, W, Y, eps, bx, r)

    return rms_fwd_train if save_rstd else rms_fwd_infer


def build_backward(n: int, dtype: str):
    block_m, num_warps = block_config(n)
    block_n = next_pow2(n)
    m = T.dynamic("M")
    g = T.dynamic("G")
    acc = "float32"

    @T.prim_func
    def rms_bwd(DY: T.Tensor((m, n), dtype), X: T.Tensor((m, n), dtype), W: T.Tensor((n,), dtype),
                RSTD: T.Tensor((m,), acc), DX: T.Tensor((m, n), dtype), DWP: T.Tensor((g, n), acc)):
        with T.Kernel(g, threads=num_warps * 32) as bx:
            xs = T.alloc_fragment((block_m, block_n), dtype)
            dys = T.alloc_fragment((block_m, block_n), dtype)
            r = T.alloc_fragment((block_m,), acc)
            xh = T.alloc_fragment((block_m, block_n), acc)
            gw = T.alloc_fragment((block_m, block_n), acc)
            prod = T.alloc_fragment((block_m, block_n), acc)
            c = T.alloc_fragment((block_m,), acc)
            dw = T.alloc_fragment((block_n,), acc)
            T.clear(dw)
            for it in T.serial(T.ceildiv(T.ceildiv(m, block_m) - bx, g)):
                row0 = (bx + it * g) * block_m
                T.copy(X[row0, 0], xs)
                T.copy(DY[row0, 0], dys)
                T.copy(RSTD[row0], r)
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
            T.copy(dw, DWP[bx, 0])

    return rms_bwd


KERNELS = norm_kernels("rms_norm", build_forward, build_backward)


def forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, save_rstd: bool):
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


def backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    m, n = x2.shape
    block_m, _ = block_config(n)
    programs = persistent_programs(m, block_m, sm_count(x2.device.index))
    dx = torch.empty_like(x2)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    key = ("rms_norm.bwd", n, x2.dtype, x2.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, x2.device))(dy, x2, weight, rstd, dx, partial)
    return dx, partial.sum(0).to(weight.dtype)
