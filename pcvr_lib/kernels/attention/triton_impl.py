"""Flash attention in Triton: one forward kernel, two backward kernels (dQ with delta, then dK/dV), and a
one-launch backward where Sq and Skv fit one query tile (config.TRITON_BWD_ONE_TILE_CONFIGS, BLOCK_M 128):
one program per (b, h) holds every query row, so each key tile's dK/dV is complete in one visit. It is routed
by default for the head dims in config.TRITON_ONE_TILE_DEFAULT_DIMS (each head dim with a one-tile config).
The forward at Sq > 512 with the masks none / key lengths / causal / causal-valid goes to triton_long.py (its
config table in config.py decides per head dim); everything else runs here, every backward included.

Layout (B, H, S, D), last dim contiguous. Scores are kept in base 2 (`qk_scale = scale * log2(e)`); the
forward saves the per-row log-sum-exp in that base (+inf for rows without any key, so that the backward's
`exp2(s - lse)` is 0 there and those rows get zero gradients).

Masks (see masks.py): MODE 1 no causal mask, 2 causal (top-left aligned), 3 causal-valid; HAS_KL adds
key lengths (required for causal-valid). Each program walks only the key tiles its rows can see; tiles that
need no mask run a loop without the element-wise mask, the rest a masked loop.

Dropout uses the counter hash of masks.py (`keep = hash(seed, b*H+h, i*Skv+j) >> 8 >= threshold`). The
hash, the valid lengths, the key-tile range of a row block and the element mask of each MODE are @helper
device functions in triton_common.py, shared with triton_long.py (inlined when compiled; an interpreted
launch swaps in their interpreted twins).

The kernels are `_triton.kernel`s launched by the shared `_triton.Launcher` (compiled on CUDA tensors,
interpreted on CPU tensors under TRITON_INTERPRET=1). Sequence lengths, key lengths and the seed are not
specialised on, so a new sequence length does not recompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import Launcher, cdiv, kernel
from . import triton_long
from .config import (
    TRITON_BWD_DQ_CONFIGS,
    TRITON_BWD_KV_CONFIGS,
    TRITON_BWD_KV_MASK_CONFIGS,
    TRITON_BWD_ONE_TILE_CONFIGS,
    TRITON_FWD_CONFIGS,
    TRITON_LONG_FWD_CONFIGS,
    TRITON_ONE_TILE_DEFAULT_DIMS,
)
from .masks import LOG2E, MODE_CODE, NO_STRUCTURE, dropout_threshold, length_bucket
from .triton_common import (
    add_dq,
    add_dv,
    compile_signature,
    dropout_keep,
    element_mask,
    key_block,
    key_roles,
    key_tile_range,
    key_tile_setup,
    launch_aligned,
    masked_key_tile,
    masked_softmax_step,
    probabilities,
    program_tile,
    qkv_strides,
    row_mask_data,
    store_output,
    stream_key,
    valid_lengths,
)

_RUNTIME_INTS = ["H", "Sq", "Skv", "seed", "drop_threshold", "W", "G"]


@kernel(do_not_specialize=_RUNTIME_INTS)
def _attn_fwd(
    Q, K, V, O, LSE, KL, ROLE, VIS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    H, Sq, Skv, qk_scale, seed, drop_threshold, drop_scale, W, G,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh, b, h, m_start, offs_m, offs_d, offs_n0 = program_tile(pid_m, H, BLOCK_M, BLOCK_N, HEAD_DIM)

    # -- which key tiles this block of rows can see, and which of them need no element mask
    qlen, kv_len = valid_lengths(KL, b, Skv, HAS_KL)
    kv_lo, full_hi, kv_hi = key_tile_range(m_start, qlen, kv_len, Skv, W, G, MODE, BLOCK_M, BLOCK_N)

    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    row_ok = offs_m < Sq
    q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_vis, glob_row = row_mask_data(ROLE, VIS, b.to(tl.int64), Sq, offs_m, row_ok, qlen, G, MODE)

    if DROPOUT:
        hk = stream_key(seed, bh)  # per-(b, h) stream key

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # tiles with no element mask (all keys valid, all below the diagonal)
    for n_start in range(kv_lo, full_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(offs_m[:, None] * Skv + offs_n[None, :], hk, drop_threshold), p, 0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # tiles on the diagonal or the key-length edge
    for n_start in range(tl.maximum(full_hi, kv_lo), kv_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        col_ok = offs_n < Skv
        k_role = key_roles(ROLE, b.to(tl.int64), Skv, offs_n, col_ok, MODE)
        allowed = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, W, glob_row, q_vis, k_role, MODE, False)
        visit = True
        if MODE == 5:  # a tile none of these rows may see costs only the role loads
            visit = tl.max(allowed.to(tl.int32)) > 0
        if visit:
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(allowed, s, float("-inf"))
            p, alpha, m_new, l_i = masked_softmax_step(s, m_i, l_i)
            if DROPOUT:
                p = tl.where(dropout_keep(offs_m[:, None] * Skv + offs_n[None, :], hk, drop_threshold), p, 0.0)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

    store_output(O, LSE, acc, m_i, l_i, b, h, bh, offs_m, offs_d, row_ok, Sq, sob, soh, som, drop_scale, STORE_LSE)


@kernel(do_not_specialize=_RUNTIME_INTS)
def _attn_bwd_dq(
    Q, K, V, O, DO, DQ, LSE, DELTA, KL, ROLE, VIS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sdob, sdoh, sdom,
    H, Sq, Skv, qk_scale, sm_scale, seed, drop_threshold, drop_scale, W, G,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """dQ for one block of rows; also stores delta = rowsum(dO * O) for the dK/dV kernel."""
    pid_m = tl.program_id(0)
    bh, b, h, m_start, offs_m, offs_d, offs_n0 = program_tile(pid_m, H, BLOCK_M, BLOCK_N, HEAD_DIM)

    qlen, kv_len = valid_lengths(KL, b, Skv, HAS_KL)
    kv_lo, full_hi, kv_hi = key_tile_range(m_start, qlen, kv_len, Skv, W, G, MODE, BLOCK_M, BLOCK_N)

    row_ok = offs_m < Sq
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * sdob + h64 * sdoh + offs_m[:, None] * sdom + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    o = tl.load(O + b64 * sob + h64 * soh + offs_m[:, None] * som + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Sq + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + bh.to(tl.int64) * Sq + offs_m, mask=row_ok, other=float("inf"))
    q_vis, glob_row = row_mask_data(ROLE, VIS, b64, Sq, offs_m, row_ok, qlen, G, MODE)
    k_base = K + b64 * skb + h64 * skh
    v_base = V + b64 * svb + h64 * svh

    hk = 0  # (dropout's stream key)
    if DROPOUT:
        hk = stream_key(seed, bh)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n_start in range(kv_lo, full_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :])
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :])
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        dq = add_dq(dq, p, do, k, v, delta, offs_m, offs_n, Skv, hk, drop_threshold, drop_scale, DROPOUT)
    for n_start in range(tl.maximum(full_hi, kv_lo), kv_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        col_ok = offs_n < Skv
        k_role = key_roles(ROLE, b64, Skv, offs_n, col_ok, MODE)
        allowed = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, W, glob_row, q_vis, k_role, MODE, False)
        visit = True
        if MODE == 5:
            visit = tl.max(allowed.to(tl.int32)) > 0
        if visit:
            k, v = masked_key_tile(k_base, v_base, offs_n, offs_d, col_ok, skn, svn)
            p = probabilities(q, k, lse, allowed, qk_scale)
            dq = add_dq(dq, p, do, k, v, delta, offs_m, offs_n, Skv, hk, drop_threshold, drop_scale, DROPOUT)
    dq = dq * sm_scale
    tl.store(DQ + bh.to(tl.int64) * Sq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@kernel(do_not_specialize=_RUNTIME_INTS)
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA, KL, ROLE, VIS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    H, Sq, Skv, qk_scale, sm_scale, seed, drop_threshold, drop_scale, W, G,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """dK and dV for one block of keys, walking the query tiles that can see it (transposed scores)."""
    bh, b, h, n_start, offs_n, offs_d, offs_m0, col_ok, qlen, kv_len, edge = key_block(
        tl.program_id(0), KL, H, Skv, HAS_KL, BLOCK_N, BLOCK_M, HEAD_DIM)
    if MODE <= 1:
        q_lo = 0
        q_hi = tl.where(n_start < kv_len, Sq, 0)
        q_mid = tl.where(edge, q_hi, 0)  # masked tiles: [q_lo, q_mid), then unmasked up to q_hi
    elif MODE == 2:
        q_lo = (n_start // BLOCK_M) * BLOCK_M
        q_hi = tl.where(n_start < kv_len, Sq, 0)
        q_mid = tl.where(edge, q_hi, tl.minimum(q_hi, ((n_start + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M))
    elif MODE == 3:
        q_lo = (n_start // BLOCK_M) * BLOCK_M
        q_hi = tl.minimum(Sq, tl.maximum(qlen, n_start + BLOCK_N))
        q_mid = q_hi
    elif MODE == 4:
        # window: rows [n_start, n_start + BLOCK_N - 1 + W) see these keys (padded rows: only their own key);
        # then the global rows [qlen - G, qlen) outside [q_lo, q_mid), in a second masked loop
        q_lo = (n_start // BLOCK_M) * BLOCK_M
        q_mid = tl.minimum(Sq, n_start + BLOCK_N - 1 + W)
        q_hi = tl.where(n_start < kv_len, tl.minimum(Sq, qlen), 0)
    else:
        q_lo = 0
        q_hi = Sq
        q_mid = Sq
    q2_lo = q_mid
    if MODE == 4:
        q2_lo = (tl.maximum(qlen - G, 0) // BLOCK_M) * BLOCK_M

    b64, k, v, q_base, do_base, lse_base, delta_base = key_tile_setup(
        Q, K, V, DO, LSE, DELTA, b, h, bh, offs_n, offs_d, col_ok, Sq, sqb, sqh, skb, skh, skn, svb, svh, svn, sdob,
        sdoh)

    hk = 0  # (dropout's stream key)
    if DROPOUT:
        hk = stream_key(seed, bh)

    k_role = key_roles(ROLE, b64, Skv, offs_n, col_ok, MODE)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for m_start in range(q_lo, q_mid, BLOCK_M):
        offs_m = m_start + offs_m0
        row_ok = offs_m < Sq
        q_vis, glob_row = row_mask_data(ROLE, VIS, b64, Sq, offs_m, row_ok, qlen, G, MODE)
        allowedT = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, W, glob_row, q_vis, k_role, MODE, True)
        if MODE == 4:  # rows from q_mid on belong to the second loop (this tile of rows may reach past q_mid)
            allowedT = allowedT & (row_ok & (offs_m < q_mid))[None, :]
        elif MODE >= 2:
            allowedT = allowedT & row_ok[None, :]
        visit = True
        if MODE == 5:  # a query tile that sees none of these keys is skipped
            visit = tl.max(allowedT.to(tl.int32)) > 0
        if visit:
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
            pT = tl.where(allowedT, pT, 0.0)
            dpT = tl.dot(v, tl.trans(do))
            dv, dpT = add_dv(dv, pT, dpT, do, offs_m[None, :] * Skv + offs_n[:, None], hk, drop_threshold,
                             drop_scale, DROPOUT)
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
    for m_start in range(q2_lo, q_hi, BLOCK_M):
        offs_m = m_start + offs_m0
        row_ok = offs_m < Sq
        q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MODE == 4:  # global rows outside the window band (the first loop counted [q_lo, q_mid))
            glob_row = ((offs_m < q_lo) | (offs_m >= q_mid)) & (offs_m < qlen) & (offs_m >= qlen - G)
            pT = tl.where((offs_n < kv_len)[:, None] & glob_row[None, :], pT, 0.0)
        dpT = tl.dot(v, tl.trans(do))
        dv, dpT = add_dv(dv, pT, dpT, do, offs_m[None, :] * Skv + offs_n[:, None], hk, drop_threshold,
                         drop_scale, DROPOUT)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
    dk = dk * sm_scale
    out_off = bh.to(tl.int64) * Skv * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@kernel(do_not_specialize=_RUNTIME_INTS)
def _attn_bwd_one_tile(
    Q, K, V, O, DO, DQ, DK, DV, LSE, KL, ROLE, VIS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sdob, sdoh, sdom,
    H, Sq, Skv, qk_scale, sm_scale, seed, drop_threshold, drop_scale, W, G,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """The whole backward of one (b, h) whose Sq rows fit one BLOCK_M tile: every query is in this program, so
    each key tile's dK and dV are complete after one visit (stored at once) and dQ sums over the key tiles in
    registers. Per key tile P is recomputed once from the LSE: dV = P^T dO, dP = dO V^T, dS = P (dP - delta),
    dQ += dS K, dK = dS^T Q (5 matmuls; delta = rowsum(dO * O) here, no delta buffer, no atomics).
    Key tiles no row can see get zero dK/dV without their matmuls."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    qlen, kv_len = valid_lengths(KL, b, Skv, HAS_KL)
    # keys from kv_hi on are seen by no row (every visible j < kv_hi)
    if MODE <= 1:
        kv_hi = kv_len
    elif MODE == 2:
        kv_hi = tl.minimum(kv_len, Sq)
    elif MODE == 3:
        kv_hi = tl.minimum(Skv, Sq)  # j <= i or j == i, i < Sq
    else:
        kv_hi = Skv
    if DROPOUT:  # per-(b, h) stream key, as in the forward
        hk = stream_key(seed, bh)

    q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * sdob + h64 * sdoh + offs_m[:, None] * sdom + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    o = tl.load(O + b64 * sob + h64 * soh + offs_m[:, None] * som + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    lse = tl.load(LSE + bh.to(tl.int64) * Sq + offs_m, mask=row_ok, other=float("inf"))  # no keys: +inf, p = 0
    q_vis, glob_row = row_mask_data(ROLE, VIS, b64, Sq, offs_m, row_ok, qlen, G, MODE)
    k_base = K + b64 * skb + h64 * skh
    v_base = V + b64 * svb + h64 * svh
    out_base = bh.to(tl.int64) * Skv * HEAD_DIM

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n_start in range(0, kv_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        col_ok = offs_n < Skv
        # the element mask of the two-kernel path; rows past Sq are cleared here (dK and dV sum over rows)
        k_role = key_roles(ROLE, b64, Skv, offs_n, col_ok, MODE)
        allowed = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, W, glob_row, q_vis, k_role, MODE, False)
        if MODE >= 2:
            allowed = allowed & row_ok[:, None]
        k, v = masked_key_tile(k_base, v_base, offs_n, offs_d, col_ok, skn, svn)
        p = probabilities(q, k, lse, allowed, qk_scale)
        dp = tl.dot(do, tl.trans(v))
        if DROPOUT:
            keep = dropout_keep(offs_m[:, None] * Skv + offs_n[None, :], hk, drop_threshold)
            dv = tl.dot(tl.trans(tl.where(keep, p * drop_scale, 0.0).to(do.dtype)), do)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        else:
            dv = tl.dot(tl.trans(p.to(do.dtype)), do)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, k)
        dk = tl.dot(tl.trans(ds), q) * sm_scale
        out_off = out_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
    # keys no row sees: zero gradients (the outputs are not cleared beforehand)
    zeros = tl.zeros([BLOCK_N, HEAD_DIM], dtype=DK.dtype.element_ty)
    for n_start in range(tl.cdiv(kv_hi, BLOCK_N) * BLOCK_N, Skv, BLOCK_N):
        offs_n = n_start + offs_n0
        out_off = out_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(DK + out_off, zeros, mask=(offs_n < Skv)[:, None])
        tl.store(DV + out_off, zeros, mask=(offs_n < Skv)[:, None])
    dq = dq * sm_scale
    q_off = bh.to(tl.int64) * Sq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------------------
# launch wrappers

# The shared launcher's direct path serves calls whose every pointer is 16-byte aligned, every stride a
# multiple of 16 and every index within int32: the one specialisation all such calls share, so the key below
# need not spell out alignment. Other arguments take triton's JIT path at every call.
_launch_fwd = Launcher(_attn_fwd, "flash_attention.fwd")
_launch_dq = Launcher(_attn_bwd_dq, "flash_attention.bwd_dq")
_launch_dkdv = Launcher(_attn_bwd_dkdv, "flash_attention.bwd_dkdv")
_launch_one_tile = Launcher(_attn_bwd_one_tile, "flash_attention.bwd_one_tile")


def _fast_ok(tensors, strides) -> bool:
    return tensors[0].is_cuda and launch_aligned(tensors, strides)


def forward(q, k, v, key_lengths, mode: str, scale: float, seed: int, dropout_p: float,
            store_lse: bool, config=None, structured=None):
    """O (and the base-2 LSE, (B*H, Sq) fp32, when store_lse) for contiguous-last-dim q, k, v.
    `structured`: the masks.StructuredMask of the window and roles masks (None for the others)."""
    B, H, Sq, D = q.shape
    if config is None and D in TRITON_LONG_FWD_CONFIGS and triton_long.applies(mode, Sq, scale, structured):
        return triton_long.forward(q, k, v, key_lengths, mode, scale, seed, dropout_p, store_lse)
    Skv = k.shape[2]
    o = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device) if store_lse else o
    bm, bn, warps, stages = config or TRITON_FWD_CONFIGS[(D, length_bucket(Sq))]
    has_kl, kl, W, G, roles, vis = _mask_data(key_lengths, structured, o)
    dropout = dropout_p > 0.0
    strides = (*qkv_strides(q, k, v), H * Sq * D, Sq * D, D)
    code = MODE_CODE[mode]
    args = (q, k, v, o, lse, kl, roles, vis, *strides,
            H, Sq, Skv, scale * LOG2E, seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), W, G,
            code, has_kl, dropout, store_lse, bm, bn, D)
    grid = (cdiv(Sq, bm), B * H, 1)
    if _fast_ok((q, k, v, roles, kl), strides):
        key = (q.get_device(), q.dtype, code, has_kl, dropout, store_lse, bm, bn, D, warps, stages)
        _launch_fwd(key, grid, args, warps, stages)
    else:
        _launch_fwd.jit(grid, args, warps, stages)
    return o, (lse if store_lse else None)


def backward(do, q, k, v, o, lse, key_lengths, mode: str, scale: float, seed: int, dropout_p: float,
             dq_config=None, kv_config=None, structured=None, one_tile_config=None):
    """(dQ, dK, dV). One launch of the one-tile kernel where it is asked for (`one_tile_config`) or routed by
    default (head dim in TRITON_ONE_TILE_DEFAULT_DIMS, Sq and Skv within its BLOCK_M, no two-kernel config
    given); elsewhere two launches, dQ (which also writes delta = rowsum(dO*O)) then dK/dV."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    if one_tile_config is not None and not (Sq <= one_tile_config[0] and Skv <= one_tile_config[0]):
        raise ValueError(f"flash_attention: one_tile_config {one_tile_config} needs Sq and Skv <= its BLOCK_M "
                         f"{one_tile_config[0]}, got Sq {Sq}, Skv {Skv}")
    one_tile = one_tile_config or (TRITON_BWD_ONE_TILE_CONFIGS[D] if D in TRITON_ONE_TILE_DEFAULT_DIMS else None)
    if one_tile is not None and Sq <= one_tile[0] and Skv <= one_tile[0] and dq_config is None and kv_config is None:
        return _backward_one_tile(do, q, k, v, o, lse, key_lengths, mode, scale, seed, dropout_p, structured,
                                  one_tile)
    dq, dk, dv = _empty_grads(q, k, v)
    delta = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device)
    has_kl, kl, W, G, roles, vis = _mask_data(key_lengths, structured, delta)
    dropout = dropout_p > 0.0
    code = MODE_CODE[mode]
    dos = do.stride()
    s_qkv = qkv_strides(q, k, v)
    s_o = (H * Sq * D, Sq * D, D)
    s_do = (dos[0], dos[1], dos[2])
    common = (H, Sq, Skv, scale * LOG2E, scale, seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p),
              W, G, code, has_kl, dropout)
    fast = _fast_ok((q, k, v, do, kl, roles), s_qkv + s_do)
    dev = q.get_device()

    bm, bn, warps, stages = dq_config or TRITON_BWD_DQ_CONFIGS[(D, length_bucket(Sq))]
    args = (q, k, v, o, do, dq, lse, delta, kl, roles, vis, *s_qkv, *s_o, *s_do, *common, bm, bn, D)
    grid = (cdiv(Sq, bm), B * H, 1)
    if fast:
        _launch_dq((dev, q.dtype, code, has_kl, dropout, bm, bn, D, warps, stages), grid, args, warps, stages)
    else:
        _launch_dq.jit(grid, args, warps, stages)

    bucket = length_bucket(Sq)
    bm, bn, warps, stages = (kv_config or TRITON_BWD_KV_MASK_CONFIGS.get((mode, D, bucket))
                             or TRITON_BWD_KV_CONFIGS[(D, bucket)])
    args = (q, k, v, do, dk, dv, lse, delta, kl, roles, vis, *s_qkv, *s_do, *common, bm, bn, D)
    grid = (cdiv(Skv, bn), B * H, 1)
    if fast:
        _launch_dkdv((dev, q.dtype, code, has_kl, dropout, bm, bn, D, warps, stages), grid, args, warps, stages)
    else:
        _launch_dkdv.jit(grid, args, warps, stages)
    return dq, dk, dv


def _backward_one_tile(do, q, k, v, o, lse, key_lengths, mode, scale, seed, dropout_p, structured, config):
    """One launch, one program per (b, h): the one-tile kernel (no delta buffer, no atomics, no memset)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    bm, bn, warps, stages = config
    dq, dk, dv = _empty_grads(q, k, v)
    has_kl, kl, W, G, roles, vis = _mask_data(key_lengths, structured, lse)
    dropout = dropout_p > 0.0
    code = MODE_CODE[mode]
    dos = do.stride()
    strides = (*qkv_strides(q, k, v), H * Sq * D, Sq * D, D, dos[0], dos[1], dos[2])
    args = (q, k, v, o, do, dq, dk, dv, lse, kl, roles, vis, *strides,
            H, Sq, Skv, scale * LOG2E, scale, seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p),
            W, G, code, has_kl, dropout, bm, bn, D)
    grid = (B * H, 1, 1)
    if _fast_ok((q, k, v, do, kl, roles), strides):
        key = (q.get_device(), q.dtype, code, has_kl, dropout, bm, bn, D, warps, stages)
        _launch_one_tile(key, grid, args, warps, stages)
    else:
        _launch_one_tile.jit(grid, args, warps, stages)
    return dq, dk, dv


def _mask_data(key_lengths, structured, placeholder):
    """(has_kl, key lengths, W, G, role codes, visibility words) as the kernels take them; a tensor the mask does
    not use is `placeholder` (a tensor of the call, never read by the kernel)."""
    s = structured or NO_STRUCTURE
    has_kl = key_lengths is not None
    return (has_kl, key_lengths if has_kl else placeholder, s.window, s.global_queries,
            placeholder if s.codes is None else s.codes, placeholder if s.words is None else s.words)


def _empty_grads(q, k, v):
    """dQ, dK, dV in the contiguous (B, H, S, D) layout the kernels write (q, k, v may be strided views)."""
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=q.device),
            torch.empty(v.shape, dtype=v.dtype, device=q.device))


def compile_for(arch: int, which: str, D: int, dtype: str = "bf16", mode: str = "causal_valid", has_kl: bool = True,
                dropout: bool = True, store_lse: bool = True, config=None):
    """Compile one kernel ("fwd", "dq", "dkdv", "one_tile") ahead of time for CUDA compute capability `arch` (e.g. 90)
    without a GPU; returns triton's CompiledKernel (its .asm holds the PTX and cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = {"fwd": _attn_fwd, "dq": _attn_bwd_dq, "dkdv": _attn_bwd_dkdv, "one_tile": _attn_bwd_one_tile}[which].compiled
    constexprs = {"MODE": MODE_CODE[mode], "HAS_KL": has_kl, "DROPOUT": dropout, "HEAD_DIM": D}
    if which == "one_tile":
        bm, bn, warps, stages = config or TRITON_BWD_ONE_TILE_CONFIGS[D]
    else:
        tables = {"fwd": TRITON_FWD_CONFIGS, "dq": TRITON_BWD_DQ_CONFIGS, "dkdv": TRITON_BWD_KV_CONFIGS}
        bm, bn, warps, stages = config or tables[which][(D, 0)]
    constexprs.update(BLOCK_M=bm, BLOCK_N=bn)
    if which == "fwd":
        constexprs["STORE_LSE"] = store_lse
    signature = compile_signature(fn, dtype, constexprs, ("LSE", "DELTA"), ("KL", "ROLE", "VIS"))
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})
