"""Tile configurations of the attention kernels per (head dim, bucket of Sq) (masks.length_bucket: Sq <= 128,
<= 512, longer). Triton: (BLOCK_M, BLOCK_N, num_warps, num_stages); TileLang: (block_M, block_N, threads,
num_stages). `python -m pcvr_lib.tune.attention` sweeps candidates; winners are copied here.
Head dim 16 (the models' d 64 / 4 heads): 64 x 64 tiles except the tuned dK/dV tile of bucket 1; head dim 48
runs padded to 64.
"""

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per (head dim, bucket of Sq). Buckets 1 and 2: the winners of the
# tile sweep on the H200 (bf16, device time; bucket 1 takes bucket 2's configs); figures in notes/attention.md.
TRITON_FWD_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (64, 64, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (64, 64, 4, 2),
    (32, 1): (128, 64, 8, 3), (64, 1): (128, 64, 8, 3), (128, 1): (128, 64, 8, 3),
    (32, 2): (128, 64, 8, 3), (64, 2): (128, 64, 8, 3), (128, 2): (128, 64, 8, 3),
}
# dq kernel (rows x keys) and dkdv kernel (queries x keys): (BLOCK_M, BLOCK_N, num_warps, num_stages), the
# sweep's winners for the whole backward by device time (notes/attention.md).
TRITON_BWD_DQ_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (64, 64, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (64, 64, 8, 2),
    (32, 1): (64, 64, 4, 2), (64, 1): (64, 64, 4, 2), (128, 1): (64, 64, 4, 2),
    (32, 2): (64, 64, 4, 2), (64, 2): (64, 64, 4, 2), (128, 2): (64, 64, 4, 2),
}
# Head dim 16, bucket 1: the 128 x 128 dK/dV tile won the unmasked sweep at S256 and S512 (the forward's and
# dQ's 64 x 64 tiles stayed best there).
TRITON_BWD_KV_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (128, 128, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (32, 64, 4, 2),
    (32, 1): (32, 64, 4, 3), (64, 1): (32, 64, 4, 3), (128, 1): (64, 128, 8, 2),
    (32, 2): (32, 64, 4, 3), (64, 2): (32, 64, 4, 3), (128, 2): (64, 128, 8, 2),
}
# Per-mask exceptions to TRITON_BWD_KV_CONFIGS, (mask mode, head dim, bucket) -> tile: tokenformer's window of 64
# keys leaves most of a 128 x 128 tile masked; its whole fwd+bwd ran about 1.5x slower on the H200 after the
# unmasked sweep moved head dim 16 to that tile (notes/attention.md), so the window keeps 64 x 64.
TRITON_BWD_KV_MASK_CONFIGS = {("window", 16, 1): (64, 64, 4, 2)}

# The one-tile backward (triton_impl._attn_bwd_one_tile): (BLOCK_M, BLOCK_N, num_warps, num_stages) per head
# dim. It runs where Sq <= BLOCK_M and Skv <= BLOCK_M: one program per (b, h) holds every query row and walks
# the key tiles of BLOCK_N (5 matmuls per tile pair instead of the two-kernel path's 7, one launch instead of
# two). The sweep's best tile per head dim (`tune --one-tile-only`; 1.3-2.2x faster than the two-kernel
# backward at the models' shapes, gradients equal).
TRITON_BWD_ONE_TILE_CONFIGS = {16: (128, 64, 4, 2), 32: (128, 64, 4, 2), 64: (128, 64, 8, 1), 128: (128, 32, 8, 1)}
# The head dims whose backward takes the one-tile kernel by default: every head dim it has a config for.
TRITON_ONE_TILE_DEFAULT_DIMS: frozenset[int] = frozenset(TRITON_BWD_ONE_TILE_CONFIGS)

# The long bucket (Sq > 512) on Hopper, masks none / key lengths / causal / causal-valid (triton_long.py):
# forward (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA descriptors, warp-specialised loop) and backward
# (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA descriptors for q / dO) of the one-kernel-per-key-tile
# backward (dQ by fp32 atomics). A head dim missing here keeps the kernels above. The forward defaults use
# pointer loads without warp specialisation: TMA and warp specialisation were within 3% at D128, and warp
# specialisation does not compile at D64 under triton 3.6. The one-kernel backward was slower than the
# two-kernel one at every swept shape, so triton_impl.backward keeps the two-kernel backward; its configs serve
# the sweep (`python -m pcvr_lib.tune.attention_long`) and explicit calls. Figures: notes/attention.md.
TRITON_LONG_FWD_CONFIGS = {64: (128, 64, 8, 3, False, False), 128: (128, 64, 8, 3, False, False)}
TRITON_LONG_BWD_CONFIGS = {64: (64, 64, 4, 2, False), 128: (64, 128, 8, 2, False)}

# (block_M, block_N, threads, num_stages) per (head dim, bucket of Sq)
TILELANG_FWD_CONFIGS = {
    (16, 0): (64, 64, 128, 1), (16, 1): (64, 64, 128, 2), (16, 2): (64, 64, 128, 2),
    (32, 0): (64, 64, 128, 1), (64, 0): (64, 64, 128, 1), (128, 0): (64, 64, 128, 1),
    (32, 1): (128, 128, 256, 2), (64, 1): (128, 128, 256, 2), (128, 1): (128, 128, 256, 2),
    (32, 2): (128, 128, 256, 2), (64, 2): (128, 128, 256, 2), (128, 2): (128, 128, 256, 2),
}
TILELANG_BWD_CONFIGS = {  # shared by the dQ kernel (rows x keys) and the dK/dV kernel (keys x rows)
    (16, 0): (64, 64, 128, 1), (16, 1): (64, 64, 128, 2), (16, 2): (64, 64, 128, 2),
    (32, 0): (64, 64, 128, 1), (64, 0): (64, 64, 128, 1), (128, 0): (64, 64, 128, 1),
    (32, 1): (64, 64, 128, 2), (64, 1): (64, 64, 128, 2), (128, 1): (64, 64, 128, 2),
    (32, 2): (64, 64, 128, 2), (64, 2): (128, 128, 256, 2, "fused"), (128, 2): (64, 128, 256, 2, "fused"),
}
# The long bucket at D64 and D128 takes the fused backward (dK/dV per key block, dQ by atomics; config (bm, bn,
# threads, stages, "fused")): 1.3-1.4x faster than the two-kernel backward in the H200 sweep, and every default
# passes its masked and dropout variants in the GPU accuracy suite (notes/attention.md).


def backward_kernels(config: tuple) -> tuple[str, ...]:
    """The TileLang backward kernels a tile config names: the fused kernel, or dQ then dK/dV."""
    return ("fused",) if len(config) > 4 and config[4] == "fused" else ("dq", "dkdv")


def tilelang_stat_rows(sq: int) -> int:
    """Rows of the TileLang kernels' row statistics (LSE, delta): padded to whole 128-row tiles, so every tile
    load stays in bounds and the rows stay 16-byte aligned, as the bulk-copy (TMA) descriptors require."""
    return (sq + 127) // 128 * 128
