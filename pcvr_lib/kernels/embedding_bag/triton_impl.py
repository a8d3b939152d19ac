"""Triton kernels of `embedding_bag_mean`: forward, sparse (COO) and dense weight-gradient scatter.

Design (see notes/kernels-embedding.md):
- One program owns BLOCK_B bags and walks the bag length L in chunks of BLOCK_L, loading a
  [BLOCK_B, BLOCK_L, BLOCK_D] tile of gathered rows at once, so many independent row loads are in
  flight (the operator is a latency-bound gather). Accumulation is fp32.
- B, L and V are run-time arguments that are never specialised (a new batch size or bag length does
  not recompile); D is a compile-time constant so row offsets are provably multiples of D and the row
  loads become 16-byte vector loads.
- Ids are read in their own dtype (int32 or int64): no conversion pass on the host or the device.
- Launched through the shared `_triton.Launcher`: after a key's first launch the compiled kernel is called
  directly, which skips Triton's per-call argument binding and cache-key hashing.
"""

from __future__ import annotations

import torch

try:  # the package is optional: the registry reports it missing
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    tl = None

from .._triton import Launcher, helper, next_pow2
from .._triton import kernel as dual_kernel
from .config import launch_config

if tl is not None:

    @dual_kernel(do_not_specialize=["B", "L", "V"])
    def _fwd_kernel(
        w_ptr,
        ids_ptr,
        out_ptr,
        cnt_ptr,
        B,
        L,
        V,
        D: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SAVE_COUNTS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rb = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        bmask = rb < B
        rl = tl.arange(0, BLOCK_L)
        rd = tl.arange(0, BLOCK_D)
        dmask = rd < D
        ids_rows = ids_ptr + rb.to(tl.int64)[:, None] * L
        acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
        cnt = tl.zeros([BLOCK_B], dtype=tl.int32)
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=bmask[:, None] & lmask[None, :], other=0)
            valid = (idx > 0) & (idx < V)
            cnt += tl.sum(valid.to(tl.int32), axis=1)
            row = tl.where(valid, idx, 0).to(tl.int64) * D
            rows = tl.load(
                w_ptr + row[:, :, None] + rd[None, None, :],
                mask=valid[:, :, None] & dmask[None, None, :],
                other=0.0,
            )
            acc += tl.sum(rows.to(tl.float32), axis=1)
        inv = 1.0 / tl.maximum(cnt, 1).to(tl.float32)
        out = acc * inv[:, None]
        out_ptrs = out_ptr + rb.to(tl.int64)[:, None] * D + rd[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=bmask[:, None] & dmask[None, :])
        if SAVE_COUNTS:
            tl.store(cnt_ptr + rb, cnt, mask=bmask)

    @dual_kernel(do_not_specialize=["B", "L", "V"])
    def _bwd_keys_kernel(
        ids_ptr,
        key_ptr,
        B,
        L,
        V,
        BLOCK_B: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        # The row of entry (b, l) of the gradient: its id when valid, else anchor[b], a valid id of the same
        # bag (0 if none), so that a padding position adds a zero to a row the bag touches anyway.
        pid = tl.program_id(0)
        rb = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        bmask = rb < B
        rl = tl.arange(0, BLOCK_L)
        ids_rows = ids_ptr + rb.to(tl.int64)[:, None] * L
        anchor = tl.full([BLOCK_B], 0, dtype=tl.int64)
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=bmask[:, None] & lmask[None, :], other=0)
            valid = (idx > 0) & (idx < V)
            anchor = tl.maximum(anchor, tl.max(tl.where(valid, idx, 0).to(tl.int64), axis=1))
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            m2 = bmask[:, None] & lmask[None, :]
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=m2, other=0)
            valid = (idx > 0) & (idx < V)
            entry = rb.to(tl.int64)[:, None] * L + (l0 + rl)[None, :]
            key = tl.where(valid, idx.to(tl.int64), anchor[:, None])
            tl.store(key_ptr + entry, key.to(key_ptr.dtype.element_ty), mask=m2)

    @helper
    def _segmented_sum(a, a_opened, b, b_opened):
        # scan operator of a sum that restarts where a segment opens: (value, opened) pairs
        return tl.where(b_opened != 0, b, a + b), a_opened | b_opened

    @dual_kernel(do_not_specialize=["N", "L", "V"])
    def _merge_kernel(
        key_ptr,
        order_ptr,
        slot_ptr,
        ids_ptr,
        cnt_ptr,
        g_ptr,
        rows_ptr,
        val_ptr,
        head_ptr,
        tail_ptr,
        N,
        L,
        V,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program c sums the gradient entries at sorted positions [c*CHUNK, (c+1)*CHUNK) by segment (one
        # segment per distinct row, in slot order). A segment that opens and closes in the chunk is written to
        # its slot, rounded once. A segment crossing a chunk edge leaves fp32 partial sums: tail[c] (it opens
        # in chunk c and goes on) and head[c'] (chunk c' begins inside it); _merge_edges_kernel adds them.
        # Program c also zeroes the slots of its range past the number of distinct rows.
        c = tl.program_id(0)
        p = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        pmask = p < N
        rd = tl.arange(0, BLOCK_D)
        dmask = rd < D
        key = tl.load(key_ptr + p, mask=pmask, other=-1)
        prev = tl.load(key_ptr + p - 1, mask=pmask & (p > 0), other=-1)
        after = tl.load(key_ptr + p + 1, mask=(p + 1) < N, other=-1)
        opens = pmask & ((p == 0) | (key != prev))
        closes = pmask & ((p == N - 1) | (key != after))
        slot = tl.load(slot_ptr + p, mask=pmask, other=0).to(tl.int64)
        entry = tl.load(order_ptr + p, mask=pmask, other=0)
        bag = entry // L
        idx = tl.load(ids_ptr + entry, mask=pmask, other=0)
        valid = pmask & (idx > 0) & (idx < V)
        cnt = tl.load(cnt_ptr + bag, mask=valid, other=1)
        inv = 1.0 / tl.maximum(cnt, 1).to(tl.float32)
        g = tl.load(g_ptr + bag[:, None] * D + rd[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        value = g.to(tl.float32) * inv[:, None]
        opened = tl.broadcast_to(opens.to(tl.int32)[:, None], [CHUNK, BLOCK_D])
        sums, opened = tl.associative_scan((value, opened), 0, _segmented_sum)
        # opened: a segment opens at or before this position inside the chunk, so this position's does
        began_here = tl.max(opened, axis=1) != 0
        last = pmask & ((p % CHUNK == CHUNK - 1) | (p == N - 1))
        whole = closes & began_here
        out_ptrs = slot[:, None] * D + rd[None, :]
        tl.store(val_ptr + out_ptrs, sums.to(val_ptr.dtype.element_ty), mask=whole[:, None] & dmask[None, :])
        tl.store(rows_ptr + slot, key.to(tl.int64), mask=whole)
        edge_ptrs = c.to(tl.int64) * D + tl.zeros_like(p)[:, None] + rd[None, :]
        head = pmask & (closes | last) & (~began_here)
        tl.store(head_ptr + edge_ptrs, sums, mask=head[:, None] & dmask[None, :])
        tail = last & began_here & (~closes)
        tl.store(tail_ptr + edge_ptrs, sums, mask=tail[:, None] & dmask[None, :])
        count = tl.load(slot_ptr + N - 1).to(tl.int64) + 1
        unused = pmask & (p >= count)
        tl.store(val_ptr + p[:, None] * D + rd[None, :], tl.zeros([CHUNK, BLOCK_D], dtype=val_ptr.dtype.element_ty),
                 mask=unused[:, None] & dmask[None, :])
        tl.store(rows_ptr + p, tl.zeros([CHUNK], dtype=tl.int64), mask=unused)

    @dual_kernel(do_not_specialize=["N"])
    def _merge_edges_kernel(
        key_ptr,
        slot_ptr,
        rows_ptr,
        val_ptr,
        head_ptr,
        tail_ptr,
        N,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        WALK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program c finishes the segment that opens in chunk c and goes on past it (if any): tail[c] plus the
        # head partials of the following chunks that begin inside it, read WALK chunks at a time, in order.
        c = tl.program_id(0)
        first = c.to(tl.int64) * CHUNK
        last = tl.minimum(first + CHUNK, N) - 1
        slot = tl.load(slot_ptr + last)
        before = tl.load(slot_ptr + first - 1, mask=first > 0, other=-1)
        after = tl.load(slot_ptr + last + 1, mask=last + 1 < N, other=-1)
        if (before != slot) & (after == slot):
            rd = tl.arange(0, BLOCK_D)
            dmask = rd < D
            acc = tl.load(tail_ptr + c.to(tl.int64) * D + rd, mask=dmask, other=0.0)
            rw = tl.arange(0, WALK)
            nxt = c.to(tl.int64) + 1
            going = before != slot
            while going:
                chunk = nxt + rw
                starts = chunk * CHUNK
                inside = (starts < N) & (tl.load(slot_ptr + starts, mask=starts < N, other=-1) == slot)
                part = tl.load(head_ptr + chunk[:, None] * D + rd[None, :], mask=inside[:, None] & dmask[None, :],
                               other=0.0)
                acc += tl.sum(part, axis=0)
                going = tl.sum(inside.to(tl.int32), axis=0) == WALK
                nxt += WALK
            tl.store(val_ptr + slot.to(tl.int64) * D + rd, acc.to(val_ptr.dtype.element_ty), mask=dmask)
            tl.store(rows_ptr + slot, tl.load(key_ptr + last).to(tl.int64))

    @dual_kernel(do_not_specialize=["B", "L", "V"])
    def _bwd_dense_kernel(
        ids_ptr,
        cnt_ptr,
        g_ptr,
        grad_ptr,
        B,
        L,
        V,
        D: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rb = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        bmask = rb < B
        rl = tl.arange(0, BLOCK_L)
        rd = tl.arange(0, BLOCK_D)
        dmask = rd < D
        cnt = tl.load(cnt_ptr + rb, mask=bmask, other=0)
        inv = 1.0 / tl.maximum(cnt, 1).to(tl.float32)
        g = tl.load(g_ptr + rb.to(tl.int64)[:, None] * D + rd[None, :], mask=bmask[:, None] & dmask[None, :])
        val = g.to(tl.float32) * inv[:, None]
        ids_rows = ids_ptr + rb.to(tl.int64)[:, None] * L
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=bmask[:, None] & lmask[None, :], other=0)
            valid = (idx > 0) & (idx < V)
            row = tl.where(valid, idx, 0).to(tl.int64) * D
            tl.atomic_add(grad_ptr + row[:, :, None] + rd[None, None, :],
                          tl.broadcast_to(val[:, None, :], [BLOCK_B, BLOCK_L, BLOCK_D]),
                          mask=valid[:, :, None] & dmask[None, None, :], sem="relaxed")


_CONFIGS: dict[tuple, object] = {}


def _config(batch, bag, dim, elem_bytes):
    """launch_config memoised by (bag, dim, element size): it never depends on the batch size."""
    key = (bag, dim, elem_bytes)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = launch_config(batch, bag, dim, elem_bytes)
    return cfg


def _align_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Device index and the 16-byte alignment of both pointers (Triton specialises on it)."""
    return a.get_device(), a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0


if tl is not None:
    _launch_fwd = Launcher(_fwd_kernel, "embedding_bag_mean.fwd")
    _launch_bwd_keys = Launcher(_bwd_keys_kernel, "embedding_bag_mean.bwd_keys")
    _launch_merge = Launcher(_merge_kernel, "embedding_bag_mean.merge")
    _launch_merge_edges = Launcher(_merge_edges_kernel, "embedding_bag_mean.merge_edges")
    _launch_bwd_dense = Launcher(_bwd_dense_kernel, "embedding_bag_mean.bwd_dense")


def forward(weight: torch.Tensor, ids: torch.Tensor, save_counts: bool, cfg=None):
    """(out, counts or None); counts are int32 valid-id counts per bag, kept for the backward.
    `cfg` overrides the launch heuristic (used by the tile sweep)."""
    num_rows, dim = weight.shape
    batch, bag = ids.shape
    out = weight.new_empty((batch, dim))
    counts = weight.new_empty((batch,), dtype=torch.int32) if save_counts else out
    cfg = cfg or _config(batch, bag, dim, weight.element_size())
    grid = (-(-batch // cfg.block_b), 1, 1)
    args = (weight, ids, out, counts, batch, bag, num_rows, dim, cfg.block_b, cfg.block_l, cfg.block_d,
            save_counts)
    key = (weight.dtype, ids.dtype, dim, cfg.block_b, cfg.block_l, save_counts, _align_key(weight, ids),
           cfg.num_warps)
    _launch_fwd(key, grid, args, cfg.num_warps)
    return out, (counts if save_counts else None)


def merge_chunk(dim: int) -> int:
    """Sorted gradient entries one merge program sums: a [chunk, next_pow2(dim)] fp32 tile of about 4096."""
    return max(16, min(64, 4096 // next_pow2(dim)))


_MERGE_PLANS: dict[tuple, tuple] = {}


def _merge_plan(bag: int, dim: int) -> tuple:
    """(keys kernel's launch config, merge chunk, BLOCK_D), memoised: a backward pays one dict lookup for them."""
    plan = _MERGE_PLANS.get((bag, dim))
    if plan is None:
        plan = _MERGE_PLANS[(bag, dim)] = (launch_config(1, bag, dim, 4), merge_chunk(dim), next_pow2(dim))
    return plan


def backward_merged(ids, counts, grad_out, num_rows: int, weight_dtype):
    """The sparse weight gradient merged, without a device-to-host sync: (rows int64 [B*L], values [B*L, D] in
    `weight_dtype`), layout in __init__. The entries' rows are sorted (torch.sort of int32 keys); a cumulative
    sum numbers the distinct rows (the slots); _merge_kernel gathers each entry's grad_out[b] / count[b] in
    sorted order and sums it by segment in fp32, rounding once; no fp32 piece per entry is written."""
    batch, bag = ids.shape
    dim = grad_out.shape[1]
    n = batch * bag
    device = ids.device
    cfg, chunk, block_d = _merge_plan(bag, dim)
    # (fresh allocations are 16-byte aligned; the inputs' alignment is part of every launch key)
    inputs = (ids.dtype, grad_out.dtype, weight_dtype, dim, ids.get_device(), ids.data_ptr() % 16 == 0,
              grad_out.data_ptr() % 16 == 0, counts.data_ptr() % 16 == 0, num_rows <= 2**31 - 1, n <= 2**31 - 1)
    keys = torch.empty((n,), dtype=torch.int32 if inputs[-2] else torch.int64, device=device)
    _launch_bwd_keys((inputs, cfg), (-(-batch // cfg.block_b), 1, 1),
                     (ids, keys, batch, bag, num_rows, cfg.block_b, cfg.block_l), cfg.num_warps)
    keys, order = torch.sort(keys)
    slot = torch.empty((n,), dtype=torch.int32 if inputs[-1] else torch.int64, device=device)
    slot[:1] = 0
    torch.cumsum(keys[1:] != keys[:-1], 0, dtype=slot.dtype, out=slot[1:])
    rows = torch.empty((n,), dtype=torch.int64, device=device)
    values = torch.empty((n, dim), dtype=weight_dtype, device=device)
    chunks = -(-n // chunk)
    head = torch.empty((chunks, dim), dtype=torch.float32, device=device)
    tail = torch.empty((chunks, dim), dtype=torch.float32, device=device)
    _launch_merge(inputs, (chunks, 1, 1), (keys, order, slot, ids, counts, grad_out, rows, values, head, tail, n,
                                           bag, num_rows, dim, chunk, block_d), 4)
    _launch_merge_edges(inputs, (chunks, 1, 1), (keys, slot, rows, values, head, tail, n, dim, chunk, chunk, block_d),
                        4)
    return rows, values


def backward_dense(ids, counts, grad_out, num_rows: int, weight_dtype):
    """Dense (V, D) weight gradient: fp32 atomics, then one cast when the weight is not fp32."""
    batch, bag = ids.shape
    dim = grad_out.shape[1]
    grad = torch.zeros((num_rows, dim), dtype=torch.float32, device=ids.device)
    cfg = _config(batch, bag, dim, 4)
    grid = (-(-batch // cfg.block_b), 1, 1)
    args = (ids, counts, grad_out, grad, batch, bag, num_rows, dim, cfg.block_b, cfg.block_l, cfg.block_d)
    key = (grad_out.dtype, ids.dtype, dim, cfg.block_b, cfg.block_l, _align_key(ids, grad_out), cfg.num_warps)
    _launch_bwd_dense(key, grid, args, cfg.num_warps)
    return grad if weight_dtype == torch.float32 else grad.to(weight_dtype)


def compile_for(arch: int, name: str, dim: int, dtype: str = "bf16"):
    """Compile one sparse-backward kernel ("keys", "merge", "merge_edges") ahead of time for CUDA compute
    capability `arch` (e.g. 90) without a GPU, as a launch with int64 ids, int32 keys and slots, a `dtype`
    weight of width `dim` and 16-byte aligned pointers would specialise it. Returns triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = {"keys": _bwd_keys_kernel, "merge": _merge_kernel, "merge_edges": _merge_edges_kernel}[name].compiled
    cfg = launch_config(1, 8, dim, 4)
    chunk = merge_chunk(dim)
    constexprs = {"D": dim, "CHUNK": chunk, "WALK": chunk, "BLOCK_D": next_pow2(dim), "BLOCK_B": cfg.block_b,
                  "BLOCK_L": cfg.block_l}
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    pointers = {"ids_ptr": "*i64", "key_ptr": "*i32", "slot_ptr": "*i32", "order_ptr": "*i64", "cnt_ptr": "*i32",
                "g_ptr": f"*{dtype}", "rows_ptr": "*i64", "val_ptr": f"*{dtype}", "head_ptr": "*fp32",
                "tail_ptr": "*fp32"}
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32") for arg in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg in pointers}
    return triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4})
