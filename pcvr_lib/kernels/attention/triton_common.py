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


def launch_aligned(tensors, strides) -> bool:
    """Host side: whether every pointer and stride is a multiple of 16 and the first two tensors have fewer than
    2**31 elements (int32 indexing): what the cached launch keys assume."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    for x in strides:
        bits |= x
    return not (bits & 15) and tensors[0].numel() < 2**31 and tensors[1].numel() < 2**31


def compile_signature(fn, dtype: str, constexprs: dict, fp32_pointers, i32_pointers) -> dict:
    """Host side, for compiling without a GPU: triton's signature of a kernel's arguments (tensors of `dtype`
    but the fp32 and int32 pointers named, fp32 scales, int32 others)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in fp32_pointers:
            signature[name] = "*fp32"
        elif name in i32_pointers:
            signature[name] = "*i32"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):
            signature[name] = f"*{dtype}"
        elif name in ("qk_scale", "sm_scale", "drop_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


@helper
def program_tile(pid, H, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program `pid` of grid axis 0 and the (b, h) of axis 1: (bh, b, h, start, offs_a, offs_d, offs_b0), offs_a
    the BLOCK_A indices the program owns (query rows, or keys in the key-tile kernels), offs_b0 the first tile of
    the other axis."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = pid * BLOCK_A
    offs_a = start + tl.arange(0, BLOCK_A)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_b0 = tl.arange(0, BLOCK_B)
    return bh, b, h, start, offs_a, offs_d, offs_b0


@helper
def masked_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax over scores `s` that are -inf where masked: (p, alpha, m_new, l_i). A
    fully masked row stays at p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@helper
def store_output(O, LSE, acc, m_i, l_i, b, h, bh, offs_m, offs_d, row_ok, Sq, sob, soh, som, drop_scale,
                 STORE_LSE: tl.constexpr):
    """The forward's epilogue: O = acc / l (zeros for a row that saw no key, dropout's 1/(1-p) folded in) and
    the base-2 LSE (inf for such a row)."""
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, drop_scale / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    o_base = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if STORE_LSE:
        lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


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


@helper
def masked_key_tile(k_base, v_base, offs_n, offs_d, col_ok, skn, svn):
    """The (k, v) tiles of keys offs_n, zeros past Skv."""
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    return k, v


@helper
def probabilities(q, k, lse, allowed, qk_scale):
    """The attention weights P of a (query tile, key tile) pair recomputed from the base-2 LSE, 0 where masked."""
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    return tl.where(allowed, p, 0.0)


@helper
def key_tile_setup(Q, K, V, DO, LSE, DELTA, b, h, bh, offs_n, offs_d, col_ok, Sq, sqb, sqh, skb, skh, skn, svb,
                   svh, svn, sdob, sdoh):
    """A key-tile kernel's start: its k and v tiles and the bases of q, dO, the LSE and delta of its (b, h)."""
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    k = tl.load(K + b64 * skb + h64 * skh + offs_n[:, None] * skn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b64 * svb + h64 * svh + offs_n[:, None] * svn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    q_base = Q + b64 * sqb + h64 * sqh
    do_base = DO + b64 * sdob + h64 * sdoh
    lse_base = LSE + bh.to(tl.int64) * Sq
    delta_base = DELTA + bh.to(tl.int64) * Sq
    return b64, k, v, q_base, do_base, lse_base, delta_base


@helper
def key_block(pid_n, KL, H, Skv, HAS_KL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
              HEAD_DIM: tl.constexpr):
    """A key-tile program's coordinates (program_tile over keys) and its batch row's lengths: (bh, b, h, n_start,
    offs_n, offs_d, offs_m0, col_ok, qlen, kv_len, edge), `edge` when some keys of the tile are padding."""
    bh, b, h, n_start, offs_n, offs_d, offs_m0 = program_tile(pid_n, H, BLOCK_N, BLOCK_M, HEAD_DIM)
    col_ok = offs_n < Skv
    qlen, kv_len = valid_lengths(KL, b, Skv, HAS_KL)
    edge = n_start + BLOCK_N > kv_len
    return bh, b, h, n_start, offs_n, offs_d, offs_m0, col_ok, qlen, kv_len, edge


@helper
def add_dq(dq, p, do, k, v, delta, offs_m, offs_n, Skv, hk, drop_threshold, drop_scale, DROPOUT: tl.constexpr):
    """dQ += dS K for one key tile: dP = dO V^T (through dropout's keep mask), dS = P (dP - delta)."""
    dp = tl.dot(do, tl.trans(v))
    if DROPOUT:
        keep = dropout_keep(offs_m[:, None] * Skv + offs_n[None, :], hk, drop_threshold)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)
