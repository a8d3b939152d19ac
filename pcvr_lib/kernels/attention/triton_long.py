"""Flash attention in Triton for the long bucket (Sq > 512) on Hopper: forward and an FA2-style backward.

The forward is used by triton_impl.forward for the masks none, key_lengths, causal and causal_valid (with or
without dropout) when config.TRITON_LONG_FWD_CONFIGS holds an entry for the head dim; the window and roles
masks and every shorter sequence keep triton_impl's kernels. The backward is not routed: the H200 sweep
measured it slower than triton_impl's two-kernel backward (config.py); `backward` serves the sweep
(tune_long) and explicit calls.

Forward (`_fwd_long`): the same mask contract and tile walk as triton_impl._attn_fwd (unmasked key tiles
first, then the diagonal / key-length edge tiles; the key-tile range, element mask and dropout hash are the
shared helpers of triton_common.py), with:
- the softmax scale folded into exp2 (`exp2(qk * qk_scale - m)`, one FMA per score; needs scale > 0, the
  host falls back to triton_impl otherwise);
- the accumulator update as `tl.dot(p, v, acc)`;
- optionally (USE_TMA) Q, K, V read through device-side tensor descriptors (TMA on sm_90; the descriptor of
  each (b, h) is built in the kernel, `triton.set_allocator` gives it its scratch), out-of-range rows read
  as zeros;
- optionally (WARP_SPEC) the unmasked loop as `tl.range(..., warp_specialize=True)` (triton 3.9 compiles
  it for sm_90 without warp-specialised code in the PTX: no setmaxnreg; what 3.6 does is for the sweep);
- causal masks: row blocks launched last-first (the heaviest first, a shorter tail).

Backward (`_bwd_long`): one program per key tile computes dK and dV over the query tiles that see it and
adds its share of dQ into an fp32 buffer with atomics (5 matmuls per tile pair instead of the 7 of the
dQ + dK/dV pair in triton_impl). delta = rowsum(dO * O) comes from a small preprocess kernel. **Not
deterministic**: the order of the fp32 atomic adds into dQ varies between runs (dQ differs in the last
bits); dK and dV are deterministic. Deterministic mode is not offered for the long bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import Launcher, cdiv, kernel
from .config import TRITON_LONG_BWD_CONFIGS, TRITON_LONG_FWD_CONFIGS
from .masks import LOG2E, MODE_CODE, dropout_threshold
from .triton_common import (
    add_dv,
    compile_signature,
    dropout_keep,
    element_mask,
    key_block,
    key_tile_range,
    key_tile_setup,
    launch_aligned,
    masked_key_tile,
    masked_softmax_step,
    program_tile,
    qkv_strides,
    store_output,
    stream_key,
    valid_lengths,
)

_RUNTIME_INTS = ["H", "Sq", "Skv", "seed", "drop_threshold"]
LONG_MODES = ("none", "key_lengths", "causal", "causal_valid")


@kernel(do_not_specialize=_RUNTIME_INTS)
def _fwd_long(
    Q, K, V, O, LSE, KL,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    H, Sq, Skv, qk_scale, seed, drop_threshold, drop_scale,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr, STORE_LSE: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if MODE >= 2:  # causal: the last row blocks see the most keys; start them first (shorter tail)
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh, b, h, m_start, offs_m, offs_d, offs_n0 = program_tile(pid_m, H, BLOCK_M, BLOCK_N, HEAD_DIM)

    # key tiles of this row block: [kv_lo, full_hi) need no element mask, [full_hi, kv_hi) do (masks.py)
    qlen, kv_len = valid_lengths(KL, b, Skv, HAS_KL)
    kv_lo, full_hi, kv_hi = key_tile_range(m_start, qlen, kv_len, Skv, 0, 0, MODE, BLOCK_M, BLOCK_N)

    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    row_ok = offs_m < Sq
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[Sq, HEAD_DIM], strides=[sqm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Skv, HEAD_DIM], strides=[skn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[Skv, HEAD_DIM], strides=[svn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        q = q_desc.load([m_start, 0])
    else:
        q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    if DROPOUT:
        hk = stream_key(seed, bh)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    for n_start in tl.range(kv_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPEC):
        if USE_TMA:
            k = k_desc.load([n_start, 0])
            v = v_desc.load([n_start, 0])
        else:
            offs_n = n_start + offs_n0
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :])
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(offs_m[:, None] * Skv + n_start + offs_n0[None, :], hk, drop_threshold), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    for n_start in tl.range(tl.maximum(full_hi, kv_lo), kv_hi, BLOCK_N):
        offs_n = n_start + offs_n0
        col_ok = offs_n < Skv
        allowed = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, 0, 0, 0, 0, MODE, False)
        if USE_TMA:
            k = k_desc.load([n_start, 0])
            v = v_desc.load([n_start, 0])
        else:
            k, v = masked_key_tile(k_base, v_base, offs_n, offs_d, col_ok, skn, svn)
        s = tl.where(allowed, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        p, alpha, m_new, l_i = masked_softmax_step(s, m_i, l_i)
        if DROPOUT:
            p = tl.where(dropout_keep(offs_m[:, None] * Skv + offs_n[None, :], hk, drop_threshold), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    store_output(O, LSE, acc, m_i, l_i, b, h, bh, offs_m, offs_d, row_ok, Sq, sob, soh, som, drop_scale, STORE_LSE)


@kernel(do_not_specialize=["Sq"])
def _bwd_delta(O, DO, DELTA, DQ, sob, soh, som, sdob, sdoh, sdom, H, Sq,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta = rowsum(dO * O) per row (fp32), and the fp32 dQ accumulator of those rows zeroed."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * Sq + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    tl.store(DQ + bh.to(tl.int64) * Sq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32), mask=row_ok[:, None])


@kernel(do_not_specialize=_RUNTIME_INTS)
def _bwd_long(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, KL,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    H, Sq, Skv, qk_scale, sm_scale, seed, drop_threshold, drop_scale,
    MODE: tl.constexpr, HAS_KL: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """dK, dV of one key tile over the query tiles that see it; dQ += dS K of each pair (fp32 atomics)."""
    bh, b, h, n_start, offs_n, offs_d, offs_m0, col_ok, qlen, kv_len, edge = key_block(
        tl.program_id(0), KL, H, Skv, HAS_KL, BLOCK_N, BLOCK_M, HEAD_DIM)
    # query tiles [q_lo, q_hi); those before q_mid (diagonal, padded keys) or reaching past q_full (padded
    # query rows of causal-valid) take the element mask
    q_full = Sq + BLOCK_M
    if MODE <= 1:
        q_lo = 0
        q_hi = tl.where(n_start < kv_len, Sq, 0)
        q_mid = tl.where(edge, q_hi, 0)
    elif MODE == 2:
        q_lo = (n_start // BLOCK_M) * BLOCK_M
        q_hi = tl.where(n_start < kv_len, Sq, 0)
        q_mid = tl.where(edge, q_hi, tl.minimum(q_hi, ((n_start + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M))
    else:
        # causal-valid: rows >= qlen see only themselves, so past max(qlen, tile end) nobody sees this tile
        q_lo = (n_start // BLOCK_M) * BLOCK_M
        q_hi = tl.minimum(Sq, tl.maximum(qlen, n_start + BLOCK_N))
        q_mid = tl.where(edge, q_hi, tl.minimum(q_hi, ((n_start + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M))
        if qlen < Sq:
            q_full = qlen

    b64, k, v, q_base, do_base, lse_base, delta_base = key_tile_setup(
        Q, K, V, DO, LSE, DELTA, b, h, bh, offs_n, offs_d, col_ok, Sq, sqb, sqh, skb, skh, skn, svb, svh, svn, sdob,
        sdoh)
    dq_base = DQ + bh.to(tl.int64) * Sq * HEAD_DIM
    if USE_TMA:  # q and dO tiles through TMA (rows past Sq read as zeros, as the masked loads below)
        q_desc = tl.make_tensor_descriptor(q_base, shape=[Sq, HEAD_DIM], strides=[sqm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        do_desc = tl.make_tensor_descriptor(do_base, shape=[Sq, HEAD_DIM], strides=[sdom, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM])

    hk = 0  # (dropout's stream key)
    if DROPOUT:
        hk = stream_key(seed, bh)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for m_start in tl.range(q_lo, q_hi, BLOCK_M):
        offs_m = m_start + offs_m0
        row_ok = offs_m < Sq
        if USE_TMA:
            q = q_desc.load([m_start, 0])
            do = do_desc.load([m_start, 0])
        else:
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if (m_start < q_mid) | (m_start + BLOCK_M > q_full):  # diagonal / edge tiles: the element mask
            allowedT = element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, 0, 0, 0, 0, MODE, True)
            if MODE >= 2:
                allowedT = allowedT & row_ok[None, :]
            pT = tl.where(allowedT, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do))
        dv, dpT = add_dv(dv, pT, dpT, do, offs_m[None, :] * Skv + offs_n[:, None], hk, drop_threshold,
                         drop_scale, DROPOUT)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q)
        dq_part = tl.dot(tl.trans(dsT), k) * sm_scale
        tl.atomic_add(dq_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq_part, mask=row_ok[:, None],
                      sem="relaxed")
    dk = dk * sm_scale
    out_off = bh.to(tl.int64) * Skv * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


_launch_fwd = Launcher(_fwd_long, "flash_attention.long_fwd")
_launch_delta = Launcher(_bwd_delta, "flash_attention.long_delta")
_launch_bwd = Launcher(_bwd_long, "flash_attention.long_bwd")
_DELTA_BLOCK = 64
_allocator_set = False


def _tma_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need global scratch (128 bytes per program) from triton's allocator."""
    global _allocator_set
    if not _allocator_set:
        triton.set_allocator(_tma_allocator)
        _allocator_set = True


def applies(mode: str, Sq: int, scale: float, structured) -> bool:
    """Whether a call may take the long kernels (triton_impl also needs the head dim in the config table)."""
    return Sq > 512 and structured is None and mode in LONG_MODES and scale > 0


def forward(q, k, v, key_lengths, mode: str, scale: float, seed: int, dropout_p: float, store_lse: bool,
            config=None):
    """(O, base-2 LSE (B*H, Sq) fp32 or None); config (BLOCK_M, BLOCK_N, warps, stages, use_tma, warp_spec)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    o = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device) if store_lse else o
    bm, bn, warps, stages, use_tma, warp_spec = config or TRITON_LONG_FWD_CONFIGS[D]
    has_kl = key_lengths is not None
    dropout = dropout_p > 0.0
    strides = (*qkv_strides(q, k, v), H * Sq * D, Sq * D, D)
    code = MODE_CODE[mode]
    kl = key_lengths if has_kl else o
    fast = q.is_cuda and launch_aligned((q, k, v, kl), strides)
    if use_tma and not (fast or not q.is_cuda):  # TMA needs 16-byte aligned bases and row strides
        use_tma = False
    if use_tma and q.is_cuda:
        _ensure_allocator()
    args = (q, k, v, o, lse, kl, *strides, H, Sq, Skv, scale * LOG2E, seed, dropout_threshold(dropout_p),
            1.0 / (1.0 - dropout_p), code, has_kl, dropout, store_lse, bool(use_tma), bool(warp_spec), bm, bn, D)
    grid = (cdiv(Sq, bm), B * H, 1)
    if fast:
        key = (q.get_device(), q.dtype, code, has_kl, dropout, store_lse, use_tma, warp_spec, bm, bn, D, warps,
               stages)
        _launch_fwd(key, grid, args, warps, stages)
    else:
        _launch_fwd.jit(grid, args, warps, stages)
    return o, (lse if store_lse else None)


def backward(do, q, k, v, o, lse, key_lengths, mode: str, scale: float, seed: int, dropout_p: float, config=None):
    """(dQ, dK, dV): delta + dQ zeroing, then one launch per key tile; dQ is summed in fp32 with atomics
    (not deterministic in its last bits). config (BLOCK_M, BLOCK_N, warps, stages, TMA)."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq32 = torch.empty((B, H, Sq, D), dtype=torch.float32, device=q.device)
    dk = torch.empty((B, H, Skv, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, H, Skv, D), dtype=v.dtype, device=q.device)
    delta = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device)
    has_kl = key_lengths is not None
    kl = key_lengths if has_kl else delta
    dropout = dropout_p > 0.0
    code = MODE_CODE[mode]
    os_, dos = o.stride(), do.stride()
    s_qkv = qkv_strides(q, k, v)
    s_do = (dos[0], dos[1], dos[2])
    dev = q.get_device()
    fast = q.is_cuda and launch_aligned((q, k, v, do, o, kl), s_qkv + s_do + os_[:3])

    args = (o, do, delta, dq32, os_[0], os_[1], os_[2], *s_do, H, Sq, _DELTA_BLOCK, D)
    grid = (cdiv(Sq, _DELTA_BLOCK), B * H, 1)
    if fast:
        _launch_delta((dev, q.dtype, D), grid, args, 4, 1)
    else:
        _launch_delta.jit(grid, args, 4, 1)

    bm, bn, warps, stages, use_tma = config or TRITON_LONG_BWD_CONFIGS[D]
    use_tma = bool(use_tma) and (fast or not q.is_cuda)  # TMA needs 16-byte aligned bases and row strides
    if use_tma and q.is_cuda:
        _ensure_allocator()
    args = (q, k, v, do, dq32, dk, dv, lse, delta, kl, *s_qkv, *s_do, H, Sq, Skv, scale * LOG2E, scale, seed,
            dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), code, has_kl, dropout, use_tma, bm, bn, D)
    grid = (cdiv(Skv, bn), B * H, 1)
    if fast:
        _launch_bwd((dev, q.dtype, code, has_kl, dropout, use_tma, bm, bn, D, warps, stages), grid, args, warps,
                    stages)
    else:
        _launch_bwd.jit(grid, args, warps, stages)
    return dq32.to(q.dtype), dk, dv


def compile_for(arch: int, which: str, D: int, dtype: str = "bf16", mode: str = "causal_valid", has_kl: bool = True,
                dropout: bool = True, config=None):
    """Compile "fwd" or "bwd" ahead of time for compute capability `arch` without a GPU (CompiledKernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = {"fwd": _fwd_long, "bwd": _bwd_long}[which].compiled
    if which == "fwd":
        bm, bn, warps, stages, use_tma, warp_spec = config or TRITON_LONG_FWD_CONFIGS[D]
    else:
        bm, bn, warps, stages, use_tma = config or TRITON_LONG_BWD_CONFIGS[D]
    constexprs = {"MODE": MODE_CODE[mode], "HAS_KL": has_kl, "DROPOUT": dropout, "BLOCK_M": bm, "BLOCK_N": bn,
                  "HEAD_DIM": D}
    constexprs["USE_TMA"] = bool(use_tma)
    if which == "fwd":
        constexprs.update(STORE_LSE=True, WARP_SPEC=bool(warp_spec))
    signature = compile_signature(fn, dtype, constexprs, ("LSE", "DELTA", "DQ"), ("KL",))
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})
