"""TileLang kernels of `embedding_bag_mean`: forward, sparse (COO) and dense weight-gradient scatter.

Written in TileLang's explicit thread style (T.get_thread_binding + local buffers + T.vectorized):
a group of TPR threads owns one bag, each thread VEC consecutive columns loaded as one 16-byte vector.
Per chunk of UNROLL bag positions (config.TILELANG_UNROLL) the ids are read and checked first, then all UNROLL
row loads are issued unconditionally (an invalid id reads row 0, which stays in L1), then accumulated under the
mask, so UNROLL independent loads per thread are in flight. B, L, V (and the COO length) are TileLang
dynamic symbols: one compiled kernel serves every batch size and bag length. Kernels are compiled and
cached by the shared `_tilelang` runtime per (kind, D, dtypes, vector width); a launch calls the TVM-FFI
executable itself (one foreign call, on torch's current stream).
"""

import torch

from .._tilelang import LAUNCHERS, Kernels
from .config import TILELANG_THREADS, TILELANG_UNROLL, tilelang_geometry, vector_width


def build_forward(dim: int, dtype: str, idx_dtype: str, vec: int, save_counts: bool):
    """The forward PrimFunc (W, ids, out[, counts])."""
    import tilelang.language as T

    B = T.dynamic("B")
    L = T.dynamic("L")
    V = T.dynamic("V")
    tpr, block_b, chunks = tilelang_geometry(dim, vec)
    unroll = TILELANG_UNROLL

    @T.macro
    def body(W, ids, out, counts):
        with T.Kernel(T.ceildiv(B, block_b), threads=TILELANG_THREADS) as bx:
            tx = T.get_thread_binding()
            acc = T.alloc_local((vec,), "float32")
            buf = T.alloc_local((unroll, vec), dtype)
            rows = T.alloc_local((unroll,), idx_dtype)
            cnt = T.alloc_local((1,), "int32")
            b = bx * block_b + tx // tpr
            for ch in T.serial(chunks):
                c = ((tx % tpr) + ch * tpr) * vec
                if b < B and c < dim:
                    for v in T.vectorized(vec):
                        acc[v] = 0.0
                    cnt[0] = 0
                    for l0 in T.serial(T.ceildiv(L, unroll)):
                        for u in T.unroll(unroll):
                            r = T.if_then_else(l0 * unroll + u < L, ids[b, T.min(l0 * unroll + u, L - 1)], 0)
                            rows[u] = T.if_then_else(r > 0 and r < V, r, 0)
                        for u in T.unroll(unroll):
                            for v in T.vectorized(vec):
                                buf[u, v] = W[rows[u], c + v]
                        for u in T.unroll(unroll):
                            if rows[u] > 0:
                                cnt[0] += 1
                                for v in T.vectorized(vec):
                                    acc[v] += T.cast(buf[u, v], "float32")
                    for v in T.vectorized(vec):
                        out[b, c + v] = T.cast(acc[v] / T.cast(T.max(cnt[0], 1), "float32"), dtype)
                    if save_counts and tx % tpr == 0 and ch == 0:
                        counts[b] = cnt[0]

    if save_counts:

        @T.prim_func
        def fwd_train(W: T.Tensor((V, dim), dtype), ids: T.Tensor((B, L), idx_dtype),
                      out: T.Tensor((B, dim), dtype), counts: T.Tensor((B,), "int32")):
            body(W, ids, out, counts)

        return fwd_train

    @T.prim_func
    def fwd(W: T.Tensor((V, dim), dtype), ids: T.Tensor((B, L), idx_dtype), out: T.Tensor((B, dim), dtype)):
        body(W, ids, out, None)

    return fwd


def build_backward_sparse(dim: int, dtype: str, idx_dtype: str, vec: int):
    """Fixed-size COO scatter (B*L entries, no host sync): entry (b, l) is (id, g[b] / count[b]) for a
    valid id, else (anchor[b], 0) with anchor[b] a valid id of the same bag (0 when it has none). The pieces
    are fp32 (rounded once, after coalesced_rows sums the duplicates); `vec` is g's load width."""
    import tilelang.language as T

    B = T.dynamic("B")
    L = T.dynamic("L")
    tpr, block_b, chunks = tilelang_geometry(dim, vec)

    @T.prim_func
    def bwd_sparse(ids: T.Tensor((B, L), idx_dtype), counts: T.Tensor((B,), "int32"),
                   g: T.Tensor((B, dim), dtype), idx_out: T.Tensor((B * L,), "int64"),
                   val_out: T.Tensor((B * L, dim), "float32"), num_rows: T.int64):
        with T.Kernel(T.ceildiv(B, block_b), threads=TILELANG_THREADS) as bx:
            tx = T.get_thread_binding()
            val = T.alloc_local((vec,), "float32")
            anchor = T.alloc_local((1,), "int64")
            b = bx * block_b + tx // tpr
            for ch in T.serial(chunks):
                c = ((tx % tpr) + ch * tpr) * vec
                if b < B and c < dim:
                    inv = 1.0 / T.cast(T.max(counts[b], 1), "float32")
                    for v in T.vectorized(vec):
                        val[v] = T.cast(g[b, c + v], "float32") * inv
                    anchor[0] = 0
                    for l in T.serial(L):
                        r = T.cast(ids[b, l], "int64")
                        if r > 0 and r < num_rows:
                            anchor[0] = T.max(anchor[0], r)
                    for l in T.serial(L):
                        r = T.cast(ids[b, l], "int64")
                        slot = T.cast(b, "int64") * L + l
                        if r > 0 and r < num_rows:
                            if tx % tpr == 0 and ch == 0:
                                idx_out[slot] = r
                            for v in T.vectorized(vec):
                                val_out[slot, c + v] = val[v]
                        else:
                            if tx % tpr == 0 and ch == 0:
                                idx_out[slot] = anchor[0]
                            for v in T.vectorized(vec):
                                val_out[slot, c + v] = T.cast(0, "float32")

    return bwd_sparse


def build_backward_dense(dim: int, dtype: str, idx_dtype: str):
    """Dense fp32 (V, D) gradient by atomic adds (one per element)."""
    import tilelang.language as T

    B = T.dynamic("B")
    L = T.dynamic("L")
    V = T.dynamic("V")
    tpr, block_b, chunks = tilelang_geometry(dim, 1)

    @T.prim_func
    def bwd_dense(ids: T.Tensor((B, L), idx_dtype), counts: T.Tensor((B,), "int32"),
                  g: T.Tensor((B, dim), dtype), grad: T.Tensor((V, dim), "float32")):
        with T.Kernel(T.ceildiv(B, block_b), threads=TILELANG_THREADS) as bx:
            tx = T.get_thread_binding()
            b = bx * block_b + tx // tpr
            for ch in T.serial(chunks):
                c = (tx % tpr) + ch * tpr
                if b < B and c < dim:
                    val = T.cast(g[b, c], "float32") / T.cast(T.max(counts[b], 1), "float32")
                    for l in T.serial(L):
                        r = ids[b, l]
                        if r > 0 and r < V:
                            T.atomic_add(grad[r, c], val)

    return bwd_dense


KERNELS = Kernels({
    "embedding_bag_mean.fwd": lambda dim, w, i, vec: build_forward(dim, w, i, vec, False),
    "embedding_bag_mean.fwd_train": lambda dim, w, i, vec: build_forward(dim, w, i, vec, True),
    "embedding_bag_mean.bwd_sparse": build_backward_sparse,
    "embedding_bag_mean.bwd_dense": lambda dim, w, i, vec: build_backward_dense(dim, w, i),
})


def forward(weight: torch.Tensor, ids: torch.Tensor, save_counts: bool):
    batch = ids.shape[0]
    dim = weight.shape[1]
    out = weight.new_empty((batch, dim))
    vec = vector_width(dim, weight.element_size(), weight.data_ptr())
    key = ("embedding_bag_mean.fwd_train" if save_counts else "embedding_bag_mean.fwd", dim, weight.dtype,
           ids.dtype, vec, ids.get_device())
    exe = LAUNCHERS.get(key) or KERNELS.first(key, ids.device)
    if save_counts:
        counts = weight.new_empty((batch,), dtype=torch.int32)
        exe(weight, ids, out, counts)
        return out, counts
    exe(weight, ids, out)
    return out, None


def backward_sparse(ids, counts, grad_out, num_rows: int, weight_dtype):
    batch, bag = ids.shape
    dim = grad_out.shape[1]
    g = grad_out if grad_out.dtype == weight_dtype else grad_out.to(weight_dtype)
    indices = torch.empty((batch * bag,), dtype=torch.int64, device=ids.device)
    values = g.new_empty((batch * bag, dim), dtype=torch.float32)
    vec = vector_width(dim, g.element_size(), g.data_ptr())
    key = ("embedding_bag_mean.bwd_sparse", dim, weight_dtype, ids.dtype, vec, ids.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, ids.device))(ids, counts, g, indices, values, num_rows)
    return indices, values


def backward_dense(ids, counts, grad_out, num_rows: int, weight_dtype):
    dim = grad_out.shape[1]
    grad = torch.zeros((num_rows, dim), dtype=torch.float32, device=ids.device)
    key = ("embedding_bag_mean.bwd_dense", dim, grad_out.dtype, ids.dtype, 1, ids.get_device())
    (LAUNCHERS.get(key) or KERNELS.first(key, ids.device))(ids, counts, grad_out, grad)
    return grad if weight_dtype == torch.float32 else grad.to(weight_dtype)
