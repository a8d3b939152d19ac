"""Tile configurations of the attention kernels per (head dim, bucket of Sq) (masks.length_bucket: Sq <= 128,
<= 512, longer). Triton: (BLOCK_M, BLOCK_N, num_warps, num_stages); TileLang: (block_M, block_N, threads,
num_stages). `python -m pcvr_lib.kernels.attention.tune` sweeps candidates; winners are copied here.
Head dim 16 (the models' d 64 / 4 heads): 64 x 64 tiles except the tuned dK/dV tile of bucket 1; head dim 48
runs padded to 64.
"""

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per (head dim, bucket of Sq). Buckets 1 and 2: the winners of
# `python -m pcvr_lib.kernels.attention.tune` on the H200 (2026-12-01, bf16, device time; notes/attention.md):
# forward B16 H8 S1024 D64 (128, 64, 8, 3) 126 us against 137 us for the earlier (128, 64, 4, 3) (second sweep,
# with warm-up; the first, cold one had ranked (128, 64, 4, 4) first); at B4 H16 S4096 D128 the earlier
# (128, 64, 8, 3) stayed best. Bucket 1 takes bucket 2's configs (not tuned).
TRITON_FWD_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (64, 64, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (64, 64, 4, 2),
    (32, 1): (128, 64, 8, 3), (64, 1): (128, 64, 8, 3), (128, 1): (128, 64, 8, 3),
    (32, 2): (128, 64, 8, 3), (64, 2): (128, 64, 8, 3), (128, 2): (128, 64, 8, 3),
}
# dq kernel (rows x keys) and dkdv kernel (queries x keys): (BLOCK_M, BLOCK_N, num_warps, num_stages).
# Tuned on the H200 (whole backward, device time): S1024 D64 dq (64, 64, 4, 2) + dK/dV (32, 64, 4, 3) against
# (128, 64, 8, 2) + (64, 128, 8, 2): 479 -> 438 and 450 -> 431 us; S4096 D128 dq (64, 64, 4, 2) against
# (64, 64, 8, 2): 6241 -> 4236 us (the 8-warp config had been picked from ptxas spill counts of triton 3.9,
# not timed), dK/dV (64, 128, 8, 2) against (32, 64, 4, 2): 6241 -> 5928 us.
TRITON_BWD_DQ_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (64, 64, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (64, 64, 8, 2),
    (32, 1): (64, 64, 4, 2), (64, 1): (64, 64, 4, 2), (128, 1): (64, 64, 4, 2),
    (32, 2): (64, 64, 4, 2), (64, 2): (64, 64, 4, 2), (128, 2): (64, 64, 4, 2),
}
# Head dim 16, bucket 1: `tune --shapes 256x4x256x16,256x4x512x16 --skip-tilelang` on the H200 (session 4, bf16,
# unmasked, device time; notes/attention.md): dK/dV (128, 128, 4, 2) 141.9 / 389.3 us for the whole backward
# against 201.1 / 574.4 with (64, 64, 4, 2); the forward's and dQ's 64 x 64 tiles stayed best (within 1%).
TRITON_BWD_KV_CONFIGS = {
    (16, 0): (64, 64, 4, 2), (16, 1): (128, 128, 4, 2), (16, 2): (64, 64, 4, 2),
    (32, 0): (64, 64, 4, 2), (64, 0): (64, 64, 4, 2), (128, 0): (32, 64, 4, 2),
    (32, 1): (32, 64, 4, 3), (64, 1): (32, 64, 4, 3), (128, 1): (64, 128, 8, 2),
    (32, 2): (32, 64, 4, 3), (64, 2): (32, 64, 4, 3), (128, 2): (64, 128, 8, 2),
}

# The one-tile backward (triton_impl._attn_bwd_one_tile): (BLOCK_M, BLOCK_N, num_warps, num_stages) per head
# dim. It runs where Sq <= BLOCK_M and Skv <= BLOCK_M: one program per (b, h) holds every query row and walks
# the key tiles of BLOCK_N (5 matmuls per tile pair instead of the two-kernel path's 7, one launch instead of
# two). H200 tune of 2026-12-01 (session 5, tree aacb54b, bf16, unmasked, device us, `tune --one-tile-only`;
# .benchmarks/h200/attention_tune_one_tile_s5.txt), best one-tile tile against the two-kernel backward:
# B256 H4 S128 D16 56.0 vs 124.6, B256 H8 S110 D32 119.6 vs 168.5, B8 H8 S128 D64 39.2 vs 54.7,
# B64 H8 S128 D128 111.6 vs 150.2 (gradients equal to the two-kernel ones in each case, max error 0).
TRITON_BWD_ONE_TILE_CONFIGS = {16: (128, 64, 4, 2), 32: (128, 64, 4, 2), 64: (128, 64, 8, 1), 128: (128, 32, 8, 1)}
# The head dims whose backward takes the one-tile kernel by default: every head dim it has a config for (it was
# 1.3-2.2x faster at each in the tune above, and `test_gpu_triton_one_tile` passed on the H200 on tree aacb54b).
TRITON_ONE_TILE_DEFAULT_DIMS: frozenset[int] = frozenset(TRITON_BWD_ONE_TILE_CONFIGS)

# The long bucket (Sq > 512) on Hopper, masks none / key lengths / causal / causal-valid (triton_long.py):
# forward (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA descriptors, warp-specialised loop) and backward
# (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA descriptors for q / dO) of the one-kernel-per-key-tile
# backward (dQ by fp32 atomics).
# A head dim missing here keeps the kernels above. Defaults: pointer loads, no warp specialisation (they
# compile with triton 3.6 and 3.9); `python -m pcvr_lib.kernels.attention.tune_long` picks the winners.
# H200 sweep of 2026-12-01 (session 3, bf16, `.benchmarks/h200/attention_long.json`): the forward defaults
# beat the old kernel (S1024 D64 91.0 vs 95.9 us, S4096 D128 1153 vs 1194); TMA (1122) and TMA + warp
# specialisation (1117) were within 3% at D128 and warp specialisation fails to compile at D64 under
# triton 3.6, so the defaults stay on pointer loads. The one-kernel backward was slower than the two-kernel
# one at every swept shape (best: S1024 481 vs 451 us, S4096 5195 vs 4983, causal 3185 vs 2742), so
# triton_impl.backward keeps the two-kernel backward; these configs serve the sweep and explicit calls.
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
# threads, stages, "fused")): H200 sweep of 2026-12-01 (session 3, bf16, `.benchmarks/h200/attention_long_tl.json`),
# fwd+bwd S1024 D64 639 us with (128, 128, 256, 2, "fused") and 684 with (64, 128, 256, 2, "fused") against 909
# for the two-kernel backward; S4096 D128 5541 with (64, 128, 256, 2, "fused") against 7616. Each default passed
# its masked and dropout variants in the H200 accuracy suite (`test_gpu_tilelang_long_candidates`: D128's in
# session 4, tree 53c23c8; D64's (128, 128) in session 5, tree aacb54b).
