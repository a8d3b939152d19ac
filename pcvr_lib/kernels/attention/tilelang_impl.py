"""Flash attention in TileLang: forward, and a backward of two kernels (dQ + delta, then dK/dV).

Same algorithm, masks and dropout hash as triton_impl.py (base-2 scores, +inf LSE for rows with no key).
Batch, heads and both sequence lengths are dynamic symbols (`T.dynamic`), so one compiled kernel serves
every length; kernels are cached by (head dim, dtype, mask mode, key lengths, dropout, tile config).
Inputs must be contiguous (B, H, S, D); the wrapper makes them so.

Compiled and cached by the shared `_tilelang` runtime, for the device's sm_90a on Hopper (wgmma and
register reallocation need it). `compile_only(arch)` lowers the three kernels of one variant and compiles
them with one nvcc call (CI compiles for sm_90a on a machine without a GPU).
"""


import tilelang
import tilelang.language as T

from .._tilelang import LAUNCHERS, Kernels, lower_cuda, nvcc_cubin_bytes
from .config import TILELANG_BWD_CONFIGS, TILELANG_FWD_CONFIGS, backward_kernels, tilelang_stat_rows
from .masks import LOG2E, MODE_CODE, NO_STRUCTURE, dropout_threshold, length_bucket


def _keep(row, col, skv, stream, thr):
    """The dropout keep test of masks.py for element (row, col) of one (b, h) stream (TIR expression)."""
    x = T.Cast("uint32", row * skv + col) ^ stream
    x = x ^ (x >> T.uint32(16))
    x = x * T.uint32(0x21F0AAAD)
    x = x ^ (x >> T.uint32(15))
    x = x * T.uint32(0x735A2D97)
    x = x ^ (x >> T.uint32(15))
    return (x >> T.uint32(8)) >= T.Cast("uint32", thr)


def _stream(seed, bh):
    x = T.Cast("uint32", seed) + T.Cast("uint32", bh) * T.uint32(0x61C88647)
    x = x ^ (x >> T.uint32(16))
    x = x * T.uint32(0x21F0AAAD)
    x = x ^ (x >> T.uint32(15))
    x = x * T.uint32(0x735A2D97)
    return x ^ (x >> T.uint32(15))


def _allowed(mode, row, col, qlen, kv_len, sq, skv, W=None, G=None, q_word=None, k_code=None):
    """Whether query `row` may see key `col` (masks.py), as a TIR boolean. Window (4): W, G; roles (5): the
    query's visibility word and the key's role code (staged in shared memory once per tile)."""
    if mode == 1:
        return (col < kv_len) & (row < sq)
    if mode == 2:
        return (col <= row) & (col < kv_len) & (row < sq)
    if mode == 4:
        valid_row = row < qlen
        return (((col <= row) & (row - col < W) & valid_row) | (valid_row & (row >= qlen - G) & (col < kv_len))
                | (col == row)) & (col < skv) & (row < sq)
    if mode == 5:
        seen = ((q_word >> (k_code & 31)) & 1) != 0
        return ((seen & (k_code < 32)) | (col == row)) & (col < skv) & (row < sq)
    return (((col <= row) & (row < qlen)) | (col == row)) & (col < skv) & (row < sq)


def _row_range(mode, m_start, bm, bn, qlen, kv_len, Skv, W, G):
    """[lo, hi) key tiles a block of rows starting at m_start visits (forward and dQ)."""
    if mode == 1:
        return 0, T.ceildiv(kv_len, bn)
    if mode == 2:
        return 0, T.ceildiv(T.min(kv_len, m_start + bm), bn)
    if mode == 5:
        return 0, T.ceildiv(Skv, bn)
    causal_hi = T.ceildiv(T.min(Skv, m_start + bm), bn)
    if mode == 4:
        # window band; a block with global rows sees every valid key; padded rows only themselves
        has_global = (m_start < qlen) & (m_start + bm > qlen - G)
        lo = T.if_then_else(m_start >= qlen, m_start // bn,
                            T.if_then_else(has_global, 0, T.max(m_start - W + 1, 0) // bn))
        hi = T.if_then_else(has_global, T.max(causal_hi, T.ceildiv(kv_len, bn)), causal_hi)
        return lo, T.max(lo, hi)
    lo = T.if_then_else(m_start >= qlen, m_start // bn, 0)
    return lo, T.max(lo, causal_hi)


def _col_range(mode, n_start, bm, bn, qlen, kv_len, Sq, W, G):
    """[lo, hi) query tiles a block of keys starting at n_start visits (the fused backward). The two-kernel dK/dV
    form of _bwd_kv_program computes the same bounds as statements: they name them in its TIR, so its compiled
    kernels (cached) stay as built."""
    if mode == 1:
        return 0, T.if_then_else(n_start < kv_len, T.ceildiv(Sq, bm), 0)
    if mode == 2:
        lo = n_start // bm
        return lo, T.if_then_else(n_start < kv_len, T.max(lo, T.ceildiv(Sq, bm)), lo)
    if mode == 4:
        # one range over the window band, the padded rows on the diagonal and the global rows (the
        # rows between band and global rows are visited masked: simpler than a second loop)
        has_keys = n_start < kv_len
        lo = T.if_then_else(has_keys, T.min(n_start, T.max(qlen - G, 0)), n_start) // bm
        top = T.max(n_start + bn - 1 + W, T.if_then_else(has_keys, qlen, 0))
        return lo, T.max(lo, T.ceildiv(T.min(Sq, top), bm))
    if mode == 5:
        return 0, T.ceildiv(Sq, bm)
    lo = n_start // bm
    return lo, T.max(lo, T.ceildiv(T.min(Sq, T.max(qlen, n_start + bn)), bm))


def _pass_configs(config: tuple) -> dict:
    """Small tiles (the short-sequence bucket) skip TMA and warp specialisation: fewer host-side descriptor
    encodes per call and no producer warpgroup for one or two tiles of work."""
    if config[0] <= 64 and config[3] <= 1:
        return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return {}


def _fa3_pipeline(dropout):
    """T.Pipelined order/stage of TileLang's Hopper flash-attention schedule for the forward loop body below,
    one entry per statement (tilelang 0.1.15 has neither `group` nor shared orders, so the example's groups
    are expanded and ranked): K copy | clear, QK gemm | mask+scale .. P cast | O rescale | V copy | PV gemm.
    Tile k's copies, QK gemm and softmax are stage 0; the rescale and PV gemm of tile k-1 (stage 1) are
    issued after tile k's QK gemm and before its softmax, which they overlap."""
    n_softmax = 9 if dropout else 8  # the dropout keep test is one more statement of the softmax group
    order = [0, 2, 3] + list(range(6, 6 + n_softmax)) + [4, 1, 5]
    stage = [0, 0, 0] + [0] * n_softmax + [1, 0, 1]
    return dict(order=order, stage=stage)


def fwd_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages, schedule=""):
    """Forward. `schedule="fa3"` (long buckets): the Hopper example's overlapped pipeline for the key-length
    and causal masks; the window and roles masks (per-tile staging statements) keep the plain pipeline."""
    if schedule == "fa3" and dropout:
        # with dropout this schedule fails the GPU accuracy check (causal-valid, p=0.3, S1000 D64: error 5x the
        # flash-rule bound; the cause is not known: notes/attention.md)
        raise ValueError("flash_attention TileLang: the 'fa3' forward schedule is wrong with dropout on the "
                         "H200 (notes/attention.md); use the default schedule for dropout")
    if schedule == "fa3" and mode in (1, 2, 3):
        return _fwd_fa3_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages)
    B, H, Sq, Skv, NKL, SqP, NR = T.dynamic("B, H, Sq, Skv, NKL, SqP, NR")
    acc = "float32"
    neg_inf = -T.infinity(acc)

    @T.prim_func
    def attn_fwd(
        Q: T.Tensor([B, H, Sq, D], dtype),
        K: T.Tensor([B, H, Skv, D], dtype),
        V: T.Tensor([B, H, Skv, D], dtype),
        O: T.Tensor([B, H, Sq, D], dtype),
        LSE: T.Tensor([B, H, SqP], acc),
        KL: T.Tensor([NKL], "int32"),
        ROLE: T.Tensor([NR], "int32"),
        VIS: T.Tensor([32], "int32"),
        qk_scale: T.float32,
        seed: T.int32,
        thr: T.int32,
        drop_scale: T.float32,
        W: T.int32,
        G: T.int32,
    ):
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([bm, D], dtype)
            K_s = T.alloc_shared([bn, D], dtype)
            V_s = T.alloc_shared([bn, D], dtype)
            s = T.alloc_fragment([bm, bn], acc)
            s_cast = T.alloc_fragment([bm, bn], dtype)
            o = T.alloc_fragment([bm, D], acc)
            m = T.alloc_fragment([bm], acc)
            m_prev = T.alloc_fragment([bm], acc)
            m_use = T.alloc_fragment([bm], acc)
            alpha = T.alloc_fragment([bm], acc)
            row_sum = T.alloc_fragment([bm], acc)
            l = T.alloc_fragment([bm], acc)
            lse = T.alloc_fragment([bm], acc)
            q_word = T.alloc_shared([bm], "int32")  # roles: visibility word of each query's role
            k_code = T.alloc_shared([bn], "int32")  # roles: role code of each key of the tile

            qlen = T.max(KL[bz], 0) if has_kl else Skv  # the valid length L of masks.py
            kv_len = T.min(qlen, Skv) if has_kl else Skv  # no key lengths: every key is valid
            m_start = bx * bm
            lo, hi = _row_range(mode, m_start, bm, bn, qlen, kv_len, Skv, W, G)
            stream = _stream(seed, bz * H + by)

            T.copy(Q[bz, by, m_start:m_start + bm, :], Q_s)
            if mode == 5:
                for i in T.Parallel(bm):
                    q_word[i] = VIS[T.if_then_else(m_start + i < Sq, ROLE[bz * Sq + m_start + i], 0) & 31]
            T.fill(o, 0)
            T.fill(l, 0)
            T.fill(m, neg_inf)
            for kk in T.Pipelined(lo, hi, num_stages=stages):
                T.copy(K[bz, by, kk * bn:(kk + 1) * bn, :], K_s)
                if mode == 5:
                    for j in T.Parallel(bn):
                        k_code[j] = T.if_then_else(kk * bn + j < Skv, ROLE[bz * Skv + kk * bn + j], 32)
                T.clear(s)
                T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else(
                        _allowed(mode, m_start + i, kk * bn + j, qlen, kv_len, Sq, Skv, W, G, q_word[i], k_code[j]),
                        s[i, j] * qk_scale, neg_inf)
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(bm):
                    m_use[i] = T.if_then_else(m[i] == neg_inf, 0.0, m[i])
                    alpha[i] = T.exp2(m_prev[i] - m_use[i])
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.exp2(s[i, j] - m_use[i])
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(bm):
                    l[i] = l[i] * alpha[i] + row_sum[i]
                if dropout:
                    for i, j in T.Parallel(bm, bn):
                        s[i, j] = T.if_then_else(_keep(m_start + i, kk * bn + j, Skv, stream, thr), s[i, j], 0.0)
                for i, j in T.Parallel(bm, D):
                    o[i, j] *= alpha[i]
                T.copy(s, s_cast)
                T.copy(V[bz, by, kk * bn:(kk + 1) * bn, :], V_s)
                T.gemm(s_cast, V_s, o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, D):
                o[i, j] = T.if_then_else(l[i] == 0.0, 0.0, o[i, j] * drop_scale / l[i])
            T.copy(o, O[bz, by, m_start:m_start + bm, :])
            for i in T.Parallel(bm):
                lse[i] = T.if_then_else(l[i] == 0.0, T.infinity(acc), m[i] + T.log2(l[i]))
            T.copy(lse, LSE[bz, by, m_start:m_start + bm])

    return attn_fwd


def _fwd_fa3_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages):
    """fwd_program's algorithm (same arguments, masks, dropout and LSE), its loop body ordered for
    `_fa3_pipeline`: the P cast closes the softmax group and the O rescale follows it."""
    B, H, Sq, Skv, NKL, SqP, NR = T.dynamic("B, H, Sq, Skv, NKL, SqP, NR")
    acc = "float32"
    neg_inf = -T.infinity(acc)

    @T.prim_func
    def attn_fwd(
        Q: T.Tensor([B, H, Sq, D], dtype),
        K: T.Tensor([B, H, Skv, D], dtype),
        V: T.Tensor([B, H, Skv, D], dtype),
        O: T.Tensor([B, H, Sq, D], dtype),
        LSE: T.Tensor([B, H, SqP], acc),
        KL: T.Tensor([NKL], "int32"),
        ROLE: T.Tensor([NR], "int32"),
        VIS: T.Tensor([32], "int32"),
        qk_scale: T.float32,
        seed: T.int32,
        thr: T.int32,
        drop_scale: T.float32,
        W: T.int32,
        G: T.int32,
    ):
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([bm, D], dtype)
            K_s = T.alloc_shared([bn, D], dtype)
            V_s = T.alloc_shared([bn, D], dtype)
            s = T.alloc_fragment([bm, bn], acc)
            s_cast = T.alloc_fragment([bm, bn], dtype)
            o = T.alloc_fragment([bm, D], acc)
            m = T.alloc_fragment([bm], acc)
            m_prev = T.alloc_fragment([bm], acc)
            m_use = T.alloc_fragment([bm], acc)
            alpha = T.alloc_fragment([bm], acc)
            row_sum = T.alloc_fragment([bm], acc)
            l = T.alloc_fragment([bm], acc)
            lse = T.alloc_fragment([bm], acc)

            qlen = T.max(KL[bz], 0) if has_kl else Skv
            kv_len = T.min(qlen, Skv) if has_kl else Skv
            m_start = bx * bm
            lo, hi = _row_range(mode, m_start, bm, bn, qlen, kv_len, Skv, W, G)
            stream = _stream(seed, bz * H + by)

            T.copy(Q[bz, by, m_start:m_start + bm, :], Q_s)
            T.fill(o, 0)
            T.fill(l, 0)
            T.fill(m, neg_inf)
            for kk in T.Pipelined(lo, hi, **_fa3_pipeline(dropout)):
                T.copy(K[bz, by, kk * bn:(kk + 1) * bn, :], K_s)
                T.clear(s)
                T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else(_allowed(mode, m_start + i, kk * bn + j, qlen, kv_len, Sq, Skv),
                                             s[i, j] * qk_scale, neg_inf)
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(bm):
                    m_use[i] = T.if_then_else(m[i] == neg_inf, 0.0, m[i])
                    alpha[i] = T.exp2(m_prev[i] - m_use[i])
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.exp2(s[i, j] - m_use[i])
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(bm):
                    l[i] = l[i] * alpha[i] + row_sum[i]
                if dropout:
                    for i, j in T.Parallel(bm, bn):
                        s[i, j] = T.if_then_else(_keep(m_start + i, kk * bn + j, Skv, stream, thr), s[i, j], 0.0)
                T.copy(s, s_cast)
                for i, j in T.Parallel(bm, D):
                    o[i, j] *= alpha[i]
                T.copy(V[bz, by, kk * bn:(kk + 1) * bn, :], V_s)
                T.gemm(s_cast, V_s, o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, D):
                o[i, j] = T.if_then_else(l[i] == 0.0, 0.0, o[i, j] * drop_scale / l[i])
            T.copy(o, O[bz, by, m_start:m_start + bm, :])
            for i in T.Parallel(bm):
                lse[i] = T.if_then_else(l[i] == 0.0, T.infinity(acc), m[i] + T.log2(l[i]))
            T.copy(lse, LSE[bz, by, m_start:m_start + bm])

    return attn_fwd


def bwd_dq_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages):
    B, H, Sq, Skv, NKL, SqP, NR = T.dynamic("B, H, Sq, Skv, NKL, SqP, NR")
    acc = "float32"

    @T.prim_func
    def attn_bwd_dq(
        Q: T.Tensor([B, H, Sq, D], dtype),
        K: T.Tensor([B, H, Skv, D], dtype),
        V: T.Tensor([B, H, Skv, D], dtype),
        O: T.Tensor([B, H, Sq, D], dtype),
        dO: T.Tensor([B, H, Sq, D], dtype),
        dQ: T.Tensor([B, H, Sq, D], dtype),
        LSE: T.Tensor([B, H, SqP], acc),
        Delta: T.Tensor([B, H, SqP], acc),
        KL: T.Tensor([NKL], "int32"),
        ROLE: T.Tensor([NR], "int32"),
        VIS: T.Tensor([32], "int32"),
        qk_scale: T.float32,
        sm_scale: T.float32,
        seed: T.int32,
        thr: T.int32,
        drop_scale: T.float32,
        W: T.int32,
        G: T.int32,
    ):
        with T.Kernel(T.ceildiv(Sq, bm), H, B, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([bm, D], dtype)
            dO_s = T.alloc_shared([bm, D], dtype)
            K_s = T.alloc_shared([bn, D], dtype)
            V_s = T.alloc_shared([bn, D], dtype)
            o_f = T.alloc_fragment([bm, D], dtype)
            do_f = T.alloc_fragment([bm, D], dtype)
            prod = T.alloc_fragment([bm, D], acc)
            delta = T.alloc_fragment([bm], acc)
            delta_s = T.alloc_shared([bm], acc)
            lse_s = T.alloc_shared([bm], acc)
            s = T.alloc_fragment([bm, bn], acc)
            dp = T.alloc_fragment([bm, bn], acc)
            ds_cast = T.alloc_fragment([bm, bn], dtype)
            dq = T.alloc_fragment([bm, D], acc)
            q_word = T.alloc_shared([bm], "int32")
            k_code = T.alloc_shared([bn], "int32")

            qlen = T.max(KL[bz], 0) if has_kl else Skv  # the valid length L of masks.py
            kv_len = T.min(qlen, Skv) if has_kl else Skv  # no key lengths: every key is valid
            m_start = bx * bm
            lo, hi = _row_range(mode, m_start, bm, bn, qlen, kv_len, Skv, W, G)
            stream = _stream(seed, bz * H + by)

            T.copy(O[bz, by, m_start:m_start + bm, :], o_f)
            T.copy(dO[bz, by, m_start:m_start + bm, :], do_f)
            for i, j in T.Parallel(bm, D):
                prod[i, j] = T.Cast(acc, o_f[i, j]) * T.Cast(acc, do_f[i, j])
            T.reduce_sum(prod, delta, dim=1)
            T.copy(delta, Delta[bz, by, m_start:m_start + bm])
            T.copy(delta, delta_s)
            T.copy(LSE[bz, by, m_start:m_start + bm], lse_s)
            T.copy(Q[bz, by, m_start:m_start + bm, :], Q_s)
            T.copy(dO[bz, by, m_start:m_start + bm, :], dO_s)
            if mode == 5:
                for i in T.Parallel(bm):
                    q_word[i] = VIS[T.if_then_else(m_start + i < Sq, ROLE[bz * Sq + m_start + i], 0) & 31]
            T.clear(dq)
            for kk in T.Pipelined(lo, hi, num_stages=stages):
                T.copy(K[bz, by, kk * bn:(kk + 1) * bn, :], K_s)
                T.copy(V[bz, by, kk * bn:(kk + 1) * bn, :], V_s)
                if mode == 5:
                    for j in T.Parallel(bn):
                        k_code[j] = T.if_then_else(kk * bn + j < Skv, ROLE[bz * Skv + kk * bn + j], 32)
                T.clear(s)
                T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dp)
                T.gemm(dO_s, V_s, dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    p = T.if_then_else(_allowed(mode, m_start + i, kk * bn + j, qlen, kv_len, Sq, Skv, W, G,
                                                q_word[i], k_code[j]),
                                       T.exp2(s[i, j] * qk_scale - lse_s[i]), 0.0)
                    if dropout:
                        kept = _keep(m_start + i, kk * bn + j, Skv, stream, thr)
                        dpv = T.if_then_else(kept, dp[i, j] * drop_scale, 0.0)
                        ds_cast[i, j] = p * (dpv - delta_s[i])
                    else:
                        ds_cast[i, j] = p * (dp[i, j] - delta_s[i])
                T.gemm(ds_cast, K_s, dq, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, D):
                dq[i, j] = dq[i, j] * sm_scale
            T.copy(dq, dQ[bz, by, m_start:m_start + bm, :])

    return attn_bwd_dq


def bwd_dkdv_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages):
    """dK and dV: a block of bn keys accumulates both over the query tiles it sees (Delta from the dQ kernel)."""
    return _bwd_kv_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages, fused=False)


def bwd_fused_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages, schedule="fused"):
    """One backward kernel (the FlashAttention-2 structure of TileLang's Hopper example): a block of bn keys
    accumulates dK and dV over the query tiles it sees, as bwd_dkdv_program does, and adds each query tile's
    dQ share (dS^T K, scaled) into the fp32 `dQacc` with atomics (5 matmuls per tile pair instead of the two
    kernels' 7). Delta = rowsum(dO * O) comes in precomputed; `backward` casts dQacc to the output dtype.
    With 256 threads the key block is split between two warpgroups: bn = 128 keys."""
    assert schedule == "fused"
    return _bwd_kv_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages, fused=True)


def _ds_value(ds, sm_scale, fused: bool):
    """dS of one element: the fused kernel folds the softmax scale in (its dQ share reuses dS); the dK/dV
    kernel scales dK once at the end."""
    return ds * sm_scale if fused else ds


def _bwd_kv_program(D, dtype, mode, has_kl, dropout, bm, bn, threads, stages, fused: bool):
    """The key-block backward, two-kernel (`fused` False: dK, dV) or fused (dQ by atomics too). One macro
    body serves both prim_funcs; `fused` is a Python constant, so each kernel's statements are exactly those
    it was written with (its TIR, the disk-cache key, unchanged by the sharing)."""
    B, H, Sq, Skv, NKL, SqP, NR = T.dynamic("B, H, Sq, Skv, NKL, SqP, NR")
    acc = "float32"

    @T.macro
    def body(Q, K, V, dO, dQacc, dK, dV, LSE, Delta, KL, ROLE, VIS, qk_scale, sm_scale, seed, thr, drop_scale, W, G):
        with T.Kernel(T.ceildiv(Skv, bn), H, B, threads=threads) as (bx, by, bz):
            K_s = T.alloc_shared([bn, D], dtype)
            V_s = T.alloc_shared([bn, D], dtype)
            Q_s = T.alloc_shared([bm, D], dtype)
            dO_s = T.alloc_shared([bm, D], dtype)
            if fused:
                dsT_s = T.alloc_shared([bn, bm], dtype)
            lse_s = T.alloc_shared([bm], acc)
            delta_s = T.alloc_shared([bm], acc)
            sT = T.alloc_fragment([bn, bm], acc)
            dpT = T.alloc_fragment([bn, bm], acc)
            p_cast = T.alloc_fragment([bn, bm], dtype)
            ds_cast = T.alloc_fragment([bn, bm], dtype)
            dk = T.alloc_fragment([bn, D], acc)
            dv = T.alloc_fragment([bn, D], acc)
            if fused:
                dq = T.alloc_fragment([bm, D], acc)
            q_word = T.alloc_shared([bm], "int32")
            k_code = T.alloc_shared([bn], "int32")

            qlen = T.max(KL[bz], 0) if has_kl else Skv  # the valid length L of masks.py
            kv_len = T.min(qlen, Skv) if has_kl else Skv  # no key lengths: every key is valid
            n_start = bx * bn
            if fused:
                lo, hi = _col_range(mode, n_start, bm, bn, qlen, kv_len, Sq, W, G)
            # the same bounds as statements (named in the TIR): the two-kernel backward's cached builds have them
            elif mode == 1:
                lo = 0
                hi = T.if_then_else(n_start < kv_len, T.ceildiv(Sq, bm), 0)
            elif mode == 2:
                lo = n_start // bm
                hi = T.if_then_else(n_start < kv_len, T.max(lo, T.ceildiv(Sq, bm)), lo)
            elif mode == 4:
                has_keys = n_start < kv_len
                lo = T.if_then_else(has_keys, T.min(n_start, T.max(qlen - G, 0)), n_start) // bm
                top = T.max(n_start + bn - 1 + W, T.if_then_else(has_keys, qlen, 0))
                hi = T.max(lo, T.ceildiv(T.min(Sq, top), bm))
            elif mode == 5:
                lo = 0
                hi = T.ceildiv(Sq, bm)
            else:
                lo = n_start // bm
                hi = T.max(lo, T.ceildiv(T.min(Sq, T.max(qlen, n_start + bn)), bm))
            stream = _stream(seed, bz * H + by)

            T.copy(K[bz, by, n_start:n_start + bn, :], K_s)
            T.copy(V[bz, by, n_start:n_start + bn, :], V_s)
            if mode == 5:
                for i in T.Parallel(bn):
                    k_code[i] = T.if_then_else(n_start + i < Skv, ROLE[bz * Skv + n_start + i], 32)
            T.clear(dk)
            T.clear(dv)
            for mm in T.Pipelined(lo, hi, num_stages=stages):
                T.copy(Q[bz, by, mm * bm:(mm + 1) * bm, :], Q_s)
                T.copy(dO[bz, by, mm * bm:(mm + 1) * bm, :], dO_s)
                T.copy(LSE[bz, by, mm * bm:(mm + 1) * bm], lse_s)
                T.copy(Delta[bz, by, mm * bm:(mm + 1) * bm], delta_s)
                if mode == 5:
                    for j in T.Parallel(bm):
                        q_word[j] = VIS[T.if_then_else(mm * bm + j < Sq, ROLE[bz * Sq + mm * bm + j], 0) & 31]
                T.clear(sT)
                T.gemm(K_s, Q_s, sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dpT)
                T.gemm(V_s, dO_s, dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bn, bm):
                    p = T.if_then_else(_allowed(mode, mm * bm + j, n_start + i, qlen, kv_len, Sq, Skv, W, G,
                                                q_word[j], k_code[i]),
                                       T.exp2(sT[i, j] * qk_scale - lse_s[j]), 0.0)
                    if dropout:
                        kept = _keep(mm * bm + j, n_start + i, Skv, stream, thr)
                        p_cast[i, j] = T.if_then_else(kept, p * drop_scale, 0.0)
                        ds_cast[i, j] = _ds_value(p * (T.if_then_else(kept, dpT[i, j] * drop_scale, 0.0) - delta_s[j]),
                                                  sm_scale, fused)
                    else:
                        p_cast[i, j] = p
                        ds_cast[i, j] = _ds_value(p * (dpT[i, j] - delta_s[j]), sm_scale, fused)
                T.gemm(p_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(ds_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)
                if fused:
                    T.copy(ds_cast, dsT_s)
                    T.clear(dq)
                    T.gemm(dsT_s, K_s, dq, transpose_A=True)
                    T.atomic_add(dQacc[bz, by, mm * bm:(mm + 1) * bm, :], dq)
            if not fused:
                for i, j in T.Parallel(bn, D):
                    dk[i, j] = dk[i, j] * sm_scale
            T.copy(dk, dK[bz, by, n_start:n_start + bn, :])
            T.copy(dv, dV[bz, by, n_start:n_start + bn, :])

    if fused:  # (a prim_func is built where it is defined: only the one asked for)
        @T.prim_func
        def attn_bwd_fused(
            Q: T.Tensor([B, H, Sq, D], dtype),
            K: T.Tensor([B, H, Skv, D], dtype),
            V: T.Tensor([B, H, Skv, D], dtype),
            dO: T.Tensor([B, H, Sq, D], dtype),
            dQacc: T.Tensor([B, H, SqP, D], acc),
            dK: T.Tensor([B, H, Skv, D], dtype),
            dV: T.Tensor([B, H, Skv, D], dtype),
            LSE: T.Tensor([B, H, SqP], acc),
            Delta: T.Tensor([B, H, SqP], acc),
            KL: T.Tensor([NKL], "int32"),
            ROLE: T.Tensor([NR], "int32"),
            VIS: T.Tensor([32], "int32"),
            qk_scale: T.float32,
            sm_scale: T.float32,
            seed: T.int32,
            thr: T.int32,
            drop_scale: T.float32,
            W: T.int32,
            G: T.int32,
        ):
            body(Q, K, V, dO, dQacc, dK, dV, LSE, Delta, KL, ROLE, VIS, qk_scale, sm_scale, seed, thr, drop_scale, W, G)

        return attn_bwd_fused

    @T.prim_func
    def attn_bwd_dkdv(
        Q: T.Tensor([B, H, Sq, D], dtype),
        K: T.Tensor([B, H, Skv, D], dtype),
        V: T.Tensor([B, H, Skv, D], dtype),
        dO: T.Tensor([B, H, Sq, D], dtype),
        dK: T.Tensor([B, H, Skv, D], dtype),
        dV: T.Tensor([B, H, Skv, D], dtype),
        LSE: T.Tensor([B, H, SqP], acc),
        Delta: T.Tensor([B, H, SqP], acc),
        KL: T.Tensor([NKL], "int32"),
        ROLE: T.Tensor([NR], "int32"),
        VIS: T.Tensor([32], "int32"),
        qk_scale: T.float32,
        sm_scale: T.float32,
        seed: T.int32,
        thr: T.int32,
        drop_scale: T.float32,
        W: T.int32,
        G: T.int32,
    ):
        body(Q, K, V, dO, None, dK, dV, LSE, Delta, KL, ROLE, VIS, qk_scale, sm_scale, seed, thr, drop_scale, W, G)

    return attn_bwd_dkdv


_PROGRAMS = {"fwd": fwd_program, "dq": bwd_dq_program, "dkdv": bwd_dkdv_program, "fused": bwd_fused_program}


def _program(which: str):
    def build(D, dtype, mode, has_kl, dropout, config):
        return _PROGRAMS[which](D, dtype, mode, has_kl, dropout, *config)
    return build


KERNELS = Kernels({f"flash_attention.{which}": _program(which) for which in _PROGRAMS}, arch_specific=True,
                  pass_configs=lambda key: _pass_configs(key[6]))


def lower_source(which: str, D: int, dtype: str, mode: int, has_kl: bool, dropout: bool, config: tuple,
                 target) -> str:
    """The CUDA source of one kernel lowered for `target`, without running nvcc (no device needed)."""
    program = _PROGRAMS[which](D, dtype, mode, has_kl, dropout, *config)
    return lower_cuda(program, target, _pass_configs(config))


def compile_only(arch: str = "sm_90a", D: int = 64, dtype: str = "bfloat16", mode: int = 3, has_kl: bool = True,
                 dropout: bool = True, bucket: int = 1, fwd_config: tuple | None = None,
                 bwd_config: tuple | None = None) -> dict:
    """Lower the forward and the backward kernels of one variant for `arch` and compile the sources with nvcc
    in one invocation (one header parse). Returns {"fwd", then "dq" and "dkdv" or "fused": source,
    "cubin_bytes": n}; raises RuntimeError with nvcc's errors when compilation fails."""
    target = {"kind": "cuda", "arch": arch}
    bwd_config = bwd_config or TILELANG_BWD_CONFIGS[(D, bucket)]
    jobs = [("fwd", D, dtype, mode, has_kl, dropout, fwd_config or TILELANG_FWD_CONFIGS[(D, bucket)], target)]
    jobs += [(which, D, dtype, mode, has_kl, dropout, bwd_config, target) for which in backward_kernels(bwd_config)]
    sources = [lower_source(*job) for job in jobs]
    size = nvcc_cubin_bytes(sources, arch)
    return {**{job[0]: source for job, source in zip(jobs, sources, strict=True)}, "cubin_bytes": size}


_dummy_kl: dict = {}


def _kl_arg(key_lengths, device):
    if key_lengths is not None:
        return key_lengths
    t = _dummy_kl.get(device)
    if t is None:
        import torch

        t = _dummy_kl[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def _structured_args(structured, device):
    """(ROLE, VIS, W, G) kernel arguments: the window's ints, the roles mask's codes and words, or dummies."""
    s = structured or NO_STRUCTURE
    W, G, roles, words = s.window, s.global_queries, s.codes, s.words
    if roles is None:
        dummy = _dummy_vis.get(device)
        if dummy is None:
            import torch

            dummy = _dummy_vis[device] = torch.zeros(32, dtype=torch.int32, device=device)
        return dummy, dummy, W, G
    return roles.reshape(-1), words, W, G  # the kernels index the (B, S) codes flat: ROLE[b * S + s]


_dummy_vis: dict = {}


def forward(q, k, v, key_lengths, mode: str, scale: float, seed: int, dropout_p: float, store_lse: bool,
            config=None, structured=None):
    import torch

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Sq, D = q.shape
    cfg = config or TILELANG_FWD_CONFIGS[(D, length_bucket(Sq))]
    key = ("flash_attention.fwd", D, q.dtype, MODE_CODE[mode], key_lengths is not None, dropout_p > 0.0, cfg,
           q.get_device())
    exe = LAUNCHERS.get(key) or KERNELS.first(key, q.device)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, tilelang_stat_rows(Sq)), dtype=torch.float32, device=q.device)
    role, vis, W, G = _structured_args(structured, q.device)
    exe(q, k, v, o, lse, _kl_arg(key_lengths, q.device), role, vis, scale * LOG2E, seed,
        dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), W, G)
    return o, lse


def backward(do, q, k, v, o, lse, key_lengths, mode: str, scale: float, seed: int, dropout_p: float,
             config=None, structured=None):
    import torch

    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    B, H, Sq, D = q.shape
    cfg = config or TILELANG_BWD_CONFIGS[(D, length_bucket(Sq))]
    variant = (D, q.dtype, MODE_CODE[mode], key_lengths is not None, dropout_p > 0.0, cfg, q.get_device())
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    kl = _kl_arg(key_lengths, q.device)
    role, vis, W, G = _structured_args(structured, q.device)
    scalars = (scale * LOG2E, scale, seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), W, G)
    if backward_kernels(cfg) == ("fused",):
        # delta = rowsum(dO * O) in fp32 (padded rows 0), dQ accumulated in fp32 by the kernel's atomics
        delta = torch.zeros((B, H, tilelang_stat_rows(Sq)), dtype=torch.float32, device=q.device)
        delta[:, :, :Sq] = (o.float() * do.float()).sum(-1)
        dq_acc = torch.zeros((B, H, tilelang_stat_rows(Sq), D), dtype=torch.float32, device=q.device)
        key = ("flash_attention.fused", *variant)
        (LAUNCHERS.get(key) or KERNELS.first(key, q.device))(q, k, v, do, dq_acc, dk, dv, lse, delta, kl, role, vis,
                                                             *scalars)
        return dq_acc[:, :, :Sq].to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    delta = torch.empty((B, H, tilelang_stat_rows(Sq)), dtype=torch.float32, device=q.device)
    key = ("flash_attention.dq", *variant)
    (LAUNCHERS.get(key) or KERNELS.first(key, q.device))(q, k, v, o, do, dq, lse, delta, kl, role, vis, *scalars)
    key = ("flash_attention.dkdv", *variant)
    (LAUNCHERS.get(key) or KERNELS.first(key, q.device))(q, k, v, do, dk, dv, lse, delta, kl, role, vis, *scalars)
    return dq, dk, dv
