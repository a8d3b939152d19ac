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

from .._triton import Launcher
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
    def _bwd_sparse_kernel(
        ids_ptr,
        cnt_ptr,
        g_ptr,
        idx_out_ptr,
        val_out_ptr,
        B,
        L,
        V,
        D: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Entry (b, l) of the fixed-size COO (B*L entries, no host sync): (id, g[b] / count[b]) for a
        # valid id, else (anchor[b], 0) where anchor[b] is a valid id of the same bag (0 if none).
        pid = tl.program_id(0)
        rb = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        bmask = rb < B
        rl = tl.arange(0, BLOCK_L)
        rd = tl.arange(0, BLOCK_D)
        dmask = rd < D
        ids_rows = ids_ptr + rb.to(tl.int64)[:, None] * L
        anchor = tl.full([BLOCK_B], 0, dtype=tl.int64)
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=bmask[:, None] & lmask[None, :], other=0)
            valid = (idx > 0) & (idx < V)
            anchor = tl.maximum(anchor, tl.max(tl.where(valid, idx, 0).to(tl.int64), axis=1))
        cnt = tl.load(cnt_ptr + rb, mask=bmask, other=0)
        inv = 1.0 / tl.maximum(cnt, 1).to(tl.float32)
        g = tl.load(g_ptr + rb.to(tl.int64)[:, None] * D + rd[None, :], mask=bmask[:, None] & dmask[None, :])
        val = g.to(tl.float32) * inv[:, None]  # fp32 pieces: rounded once, after the duplicates are summed
        zero = tl.zeros_like(val)
        for l0 in range(0, L, BLOCK_L):
            lmask = (l0 + rl) < L
            m2 = bmask[:, None] & lmask[None, :]
            idx = tl.load(ids_rows + (l0 + rl)[None, :], mask=m2, other=0)
            valid = (idx > 0) & (idx < V)
            slot = rb.to(tl.int64)[:, None] * L + (l0 + rl)[None, :]
            tl.store(idx_out_ptr + slot, tl.where(valid, idx.to(tl.int64), anchor[:, None]), mask=m2)
            vals = tl.where(valid[:, :, None], val[:, None, :], zero[:, None, :])
            tl.store(val_out_ptr + slot[:, :, None] * D + rd[None, None, :], vals,
                     mask=m2[:, :, None] & dmask[None, None, :])

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
    _launch_bwd_sparse = Launcher(_bwd_sparse_kernel, "embedding_bag_mean.bwd_sparse")
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


def backward_sparse(ids, counts, grad_out, num_rows: int, weight_dtype):
    """Fixed-size COO pieces (indices int64 [B*L], values fp32 [B*L, D]); layout in __init__. `weight_dtype` is
    not used: the pieces stay fp32 until coalesced_rows sums them (one rounding)."""
    batch, bag = ids.shape
    dim = grad_out.shape[1]
    indices = torch.empty((batch * bag,), dtype=torch.int64, device=ids.device)
    values = grad_out.new_empty((batch * bag, dim), dtype=torch.float32)
    cfg = _config(batch, bag, dim, 4)
    grid = (-(-batch // cfg.block_b), 1, 1)
    args = (ids, counts, grad_out, indices, values, batch, bag, num_rows, dim, cfg.block_b, cfg.block_l,
            cfg.block_d)
    key = (grad_out.dtype, ids.dtype, dim, cfg.block_b, cfg.block_l, _align_key(ids, grad_out),
           cfg.num_warps)
    _launch_bwd_sparse(key, grid, args, cfg.num_warps)
    return indices, values


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
