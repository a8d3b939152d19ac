"""Device functions (`_triton.helper`) shared by the attention Triton kernels of triton_impl.py and
triton_long.py: the valid lengths of a batch row, the key tiles a block of query rows visits, the dropout
hash, and the element mask of every MODE (masks.py: 1 none / key lengths, 2 causal, 3 causal-valid,
4 window, 5 roles). Compiled kernels inline them: the sm_90 PTX of every kernel variant is the one the
inline code gave, but for debug info (notes/attention.md, `tools/generated_code.py`).

Each helper does exactly the operations, in the order, that the kernels wrote inline, so that the generated
code does not move; that is why the mask takes its operands as the kernels hold them (per-row and per-key
vectors) and expands them itself.
"""

from __future__ import annotations

import triton.language as tl

from .._triton import helper


def qkv_strides(q, k, v) -> tuple:
    """Host side, for the launches: the (batch, head, row) strides of q, k and v (the last dim is contiguous)."""
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    return (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])


@helper
def valid_lengths(KL, b, Skv, HAS_KL: tl.constexpr):
    """(qlen, kv_len): the valid length L of masks.py (Skv without key lengths) and the keys that are valid."""
    qlen = Skv
    kv_len = Skv
    if HAS_KL:
        qlen = tl.maximum(tl.load(KL + b), 0)
        kv_len = tl.minimum(qlen, Skv)
    return qlen, kv_len


@helper
def key_tile_range(m_start, qlen, kv_len, Skv, W, G, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """(kv_lo, full_hi, kv_hi) of the row block at m_start: its rows see keys below kv_hi only; the key tiles
    [kv_lo, full_hi) need no element mask, [max(full_hi, kv_lo), kv_hi) do (the kernels' masked loop)."""
    kv_lo = 0
    if MODE <= 1:
        kv_hi = kv_len
        full_hi = (kv_len // BLOCK_N) * BLOCK_N
    elif MODE == 2:
        kv_hi = tl.minimum(kv_len, m_start + BLOCK_M)
        full_hi = (tl.minimum(kv_len, m_start + 1) // BLOCK_N) * BLOCK_N
    elif MODE == 3:
        # causal-valid: rows i < qlen see keys j <= i; a padded row i >= qlen sees only key i
        kv_hi = tl.minimum(Skv, m_start + BLOCK_M)
        if m_start + BLOCK_M <= qlen:
            full_hi = (tl.minimum(Skv, m_start + 1) // BLOCK_N) * BLOCK_N
        else:
            full_hi = 0
        if m_start >= qlen:
            kv_lo = (m_start // BLOCK_N) * BLOCK_N
    elif MODE == 4:
        # window: valid rows see keys (i - W, i], the last G valid rows every valid key, padded rows themselves;
        # only the key tiles in that band are visited (every one through the masked loop)
        kv_hi = tl.minimum(Skv, m_start + BLOCK_M)
        full_hi = 0
        kv_lo = (tl.maximum(m_start - W + 1, 0) // BLOCK_N) * BLOCK_N
        if m_start >= qlen:
            kv_lo = (m_start // BLOCK_N) * BLOCK_N
        elif m_start + BLOCK_M > qlen - G:
            kv_lo = 0
            kv_hi = tl.maximum(kv_hi, kv_len)
    else:
        # roles: any key may be visible; the masked loop skips tiles its rows cannot see at all
        kv_hi = Skv
        full_hi = 0
    return kv_lo, full_hi, kv_hi


@helper
def row_mask_data(ROLE, VIS, b64, Sq, offs_m, row_ok, qlen, G, MODE: tl.constexpr):
    """(q_vis, glob_row), what element_mask needs of the rows offs_m: roles, the visibility word of each
    query's role (bit s: it sees role s); window, whether the row is one of the last G valid (global) rows.
    0 where MODE has none."""
    q_vis = 0
    glob_row = 0
    if MODE == 5:
        q_vis = tl.load(VIS + (tl.load(ROLE + b64 * Sq + offs_m, mask=row_ok, other=0) & 31))
    if MODE == 4:
        glob_row = (offs_m < qlen) & (offs_m >= qlen - G)
    return q_vis, glob_row


@helper
def key_roles(ROLE, b64, Skv, offs_n, col_ok, MODE: tl.constexpr):
    """The role code of each key offs_n, what element_mask needs of the keys (roles mask; bit 5 set: padding).
    0 where MODE has none."""
    k_role = 0
    if MODE == 5:
        k_role = tl.load(ROLE + b64 * Skv + offs_n, mask=col_ok, other=32)
    return k_role


@helper
def _mix(x):
    """One round of the counter hash of masks.py (uint32)."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@helper
def stream_key(seed, bh):
    """The dropout stream key of one (b, h): the hash of seed + bh * golden-ratio constant."""
    return _mix(seed.to(tl.uint32) + bh.to(tl.uint32) * 0x61C88647)


@helper
def dropout_keep(idx, hk, drop_threshold):
    """Which elements dropout keeps; idx = i * Skv + j of each (query i, key j), hk the stream key."""
    return (_mix(idx.to(tl.uint32) ^ hk) >> 8) >= drop_threshold


@helper
def add_dv(dv, pT, dpT, do, idx, hk, drop_threshold, drop_scale, DROPOUT: tl.constexpr):
    """One (key tile, query tile) step of the dK/dV kernels, transposed: (dv + P^T dO, dP^T) with dropout's
    kept elements scaled by 1 / (1 - p) and the dropped ones zero in both (idx and hk as for dropout_keep;
    hk is read only with DROPOUT)."""
    if DROPOUT:
        keep = dropout_keep(idx, hk, drop_threshold)
        dv += tl.dot(tl.where(keep, pT * drop_scale, 0.0).to(do.dtype), do)
        dpT = tl.where(keep, dpT * drop_scale, 0.0)
    else:
        dv += tl.dot(pT.to(do.dtype), do)
    return dv, dpT


@helper
def _rows(x, KEYS_FIRST: tl.constexpr):
    """A per-query vector on the query axis of a [queries, keys] tile, or of a [keys, queries] one."""
    if KEYS_FIRST:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@helper
def _keys(x, KEYS_FIRST: tl.constexpr):
    """A per-key vector on the key axis of a [queries, keys] tile, or of a [keys, queries] one."""
    if KEYS_FIRST:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@helper
def element_mask(offs_m, offs_n, row_ok, col_ok, qlen, kv_len, W, glob_row, q_vis, k_role,
                 MODE: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Which (query offs_m, key offs_n) pairs MODE lets through, as a [queries, keys] tile ([keys, queries]
    with KEYS_FIRST). glob_row (window: the global query rows) and q_vis / k_role (roles: the visibility word
    of each query's role, each key's role code) are read only by their MODE (pass 0 otherwise).
    Rows past Sq are cleared only by MODE 1: the forward and dQ kernels never store them; the kernels that
    sum over rows (dK / dV) clear them after the call (`& row_ok`)."""
    if MODE <= 1:
        allowed = _keys(offs_n < kv_len, KEYS_FIRST) & _rows(row_ok, KEYS_FIRST)
    elif MODE == 2:
        allowed = (_keys(offs_n, KEYS_FIRST) <= _rows(offs_m, KEYS_FIRST)) & _keys(offs_n < kv_len, KEYS_FIRST)
    elif MODE == 3:
        allowed = ((_keys(offs_n, KEYS_FIRST) <= _rows(offs_m, KEYS_FIRST)) & _rows(offs_m < qlen, KEYS_FIRST)) | (
            _keys(offs_n, KEYS_FIRST) == _rows(offs_m, KEYS_FIRST))
        allowed = allowed & _keys(col_ok, KEYS_FIRST)
    elif MODE == 4:
        allowed = ((_keys(offs_n, KEYS_FIRST) <= _rows(offs_m, KEYS_FIRST))
                   & (_keys(offs_n, KEYS_FIRST) > _rows(offs_m, KEYS_FIRST) - W)
                   & _rows(offs_m < qlen, KEYS_FIRST)) | (
            _rows(glob_row, KEYS_FIRST) & _keys(offs_n < kv_len, KEYS_FIRST)) | (
            _keys(offs_n, KEYS_FIRST) == _rows(offs_m, KEYS_FIRST))
        allowed = allowed & _keys(col_ok, KEYS_FIRST)
    else:
        allowed = (((_rows(q_vis, KEYS_FIRST) >> (_keys(k_role, KEYS_FIRST) & 31)) & 1) != 0) & _keys(
            k_role < 32, KEYS_FIRST)
        allowed = (allowed | (_keys(offs_n, KEYS_FIRST) == _rows(offs_m, KEYS_FIRST))) & _keys(col_ok, KEYS_FIRST)
    return allowed
