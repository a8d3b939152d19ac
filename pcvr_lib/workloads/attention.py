"""The attention workload: the cases the accuracy tests, the benchmarks and the tile sweeps run, their inputs,
FLOPs and bytes, and the kernel variants those cases need (the manifest of
`python -m pcvr_lib.precompile flash_attention`). The fp64 reference is pcvr_lib.kernels.attention.reference.
"""

from __future__ import annotations

import torch

from pcvr_lib.kernels.attention import flash_attention
from pcvr_lib.kernels.attention.config import (
    TILELANG_BWD_CONFIGS,
    TILELANG_FWD_CONFIGS,
    TRITON_BWD_DQ_CONFIGS,
    TRITON_BWD_KV_CONFIGS,
    TRITON_ONE_TILE_DEFAULT_DIMS,
    backward_kernels,
)
from pcvr_lib.kernels.attention.masks import MODE_CODE, length_bucket, mode_name, role_mask

# mask name -> (uses key lengths, causal, causal_valid)
MODES = {
    "none": (False, False, False),
    "key_lengths": (True, False, False),
    "causal": (False, True, False),
    "causal_kl": (True, True, False),
    "causal_valid": (True, False, True),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the masks no (B, S, S) tensor describes in the kernels (Triton and torch only): name -> window, global
# queries, key lengths (None: roles). "window": tokenformer's causal window + the global last valid query;
# "window_g3": three global queries without key lengths; "roles": symbiosis' role rule + key validity.
STRUCTURED = {"window": (8, 1, True), "window_g3": (5, 3, False), "roles": None}

# symbiosis' roles (models-ii.md section 2): CLS 0, candidate 1, user 2, item 3, dense 4, missing 5,
# events 6, stats 7. CLS, candidate and stats see every role; field tokens (user, item, dense, missing)
# every role but events; events every role but user and dense.
SYMBIOSIS_VISIBILITY = torch.ones(8, 8, dtype=torch.bool)
SYMBIOSIS_VISIBILITY[2:6, 6] = False
SYMBIOSIS_VISIBILITY[6, 2] = False
SYMBIOSIS_VISIBILITY[6, 4] = False
# the stream of 110 tokens: CLS, candidate, 7 user, 4 item, 3 dense, 3 missing, 90 events, stats
SYMBIOSIS_LAYOUT = [0, 1] + [2] * 7 + [3] * 4 + [4] * 3 + [5] * 3 + [6] * 90 + [7]

# the one-tile backward's shapes (Sq, Skv <= config.TRITON_BWD_ONE_TILE_CONFIGS' BLOCK_M, 128): the PCVR shape's
# S128 D64 key lengths, symbiosis' roles at S110 D32, D16 and D128 at the tile's edge, dropout. In GPU_CASES they
# run the default backward, the one-tile one at the head dims config.TRITON_ONE_TILE_DEFAULT_DIMS routes (every
# dim of ONE_TILE_GPU_CASES: accuracy_tests/test_attention_gpu.py checks that they are all GPU cases routed so).
ONE_TILE_EDGE_CASES = (
    [(8, 2, 128, 128, 64, dt, "key_lengths", 0.0) for dt in ("fp16", "bf16")]
    + [(4, 2, 128, 128, 16, "bf16", mode, 0.0) for mode in ("window", "causal_valid")]
    + [(4, 2, 128, 128, 128, dt, mode, 0.0) for dt, mode in (("bf16", "causal_valid"), ("fp16", "key_lengths"))]
    + [(8, 2, 128, 128, 64, "bf16", "key_lengths", 0.2), (3, 2, 110, 110, 32, "bf16", "roles", 0.2),
       (4, 2, 100, 100, 16, "fp16", "window", 0.3), (4, 2, 101, 128, 128, "bf16", "causal", 0.3)]
)

# accuracy_tests/test_attention.py, on a GPU: (B, H, Sq, Skv, D, dtype, mode, dropout p)
GPU_CASES = (
    [(5, 2, sq, skv, 64, dt, mode, 0.0) for (sq, skv) in [(17, 17), (127, 129)]
     for dt in ("fp16", "bf16") for mode in MODES]
    + [(5, 2, 129, 127, 64, "bf16", mode, 0.0) for mode in MODES]
    + [(5, 2, 65, 65, d, "bf16", "key_lengths", 0.0) for d in (32, 128)]
    + [(5, 2, 1, 1, 64, "fp16", "causal_valid", 0.0), (5, 2, 1, 17, 64, "fp16", "key_lengths", 0.0),
       (2, 2, 1000, 1000, 64, "fp16", "causal_valid", 0.0), (2, 2, 1000, 1000, 64, "bf16", "none", 0.0),
       (2, 1, 600, 1000, 128, "bf16", "none", 0.0)]
    + [(5, 2, 33, 47, 64, dt, mode, 0.3) for dt in ("fp16", "bf16") for mode in ("key_lengths", "causal_valid")]
    # head dims 16 and 48 in every mode, the structured masks at the models' shapes and odd ones
    + [(5, 2, 37, 37, d, "bf16", mode, 0.0) for d in (16, 48) for mode in (*MODES, *STRUCTURED)]
    + [(3, 2, 110, 110, 32, "bf16", "roles", 0.0), (4, 2, 320, 320, 16, "bf16", "window", 0.0),
       (5, 1, 130, 130, 16, "fp16", "window_g3", 0.0), (5, 2, 130, 130, 48, "bf16", "key_lengths", 0.0),
       (3, 2, 600, 600, 16, "bf16", "window", 0.0), (3, 2, 300, 300, 64, "bf16", "roles", 0.0)]
    + [(5, 2, 45, 45, 16, "bf16", mode, 0.3) for mode in ("window", "roles")]
    # head dim 16 in bucket 1 (its own dK/dV tile, 128 x 128) in every mode, a tail tile and dropout
    + [(3, 2, 200, 200, 16, "bf16", mode, 0.0) for mode in MODES]
    + [(3, 2, 257, 300, 16, "fp16", "key_lengths", 0.2), (3, 2, 300, 257, 16, "bf16", "causal_valid", 0.2)]
    # long sequences: triton_long's kernels (Sq > 512), every mask they take, Sq != Skv, dropout,
    # a tail tile (Sq, Skv not multiples of 128), and several key tiles' dQ atomics onto one row block
    + [(3, 2, 700, 700, d, dt, mode, 0.0) for d in (64, 128) for dt in ("fp16", "bf16") for mode in MODES]
    + [(2, 2, 600, 1030, 64, "bf16", "key_lengths", 0.0), (2, 2, 1030, 600, 128, "fp16", "causal", 0.0),
       (2, 2, 777, 777, 64, "bf16", "causal_valid", 0.2), (2, 2, 777, 900, 128, "fp16", "none", 0.2)]
    + ONE_TILE_EDGE_CASES
)
ONE_TILE_GPU_CASES = ONE_TILE_EDGE_CASES + [(5, 2, 17, 17, 64, "bf16", mode, 0.0) for mode in MODES]
# TileLang compiles each variant (head dim, dtype, mask mode, dropout, tile config) for seconds, so its GPU
# matrix covers every mode, head dim, bucket, odd length and dropout once, not every combination.
TILELANG_CASES = (
    [(5, 2, 17, 17, 64, "bf16", mode, 0.0) for mode in MODES]
    + [(5, 2, 127, 129, 64, "fp16", "key_lengths", 0.0), (5, 2, 1, 17, 64, "fp16", "key_lengths", 0.0),
       (5, 2, 1, 1, 64, "bf16", "causal_valid", 0.0), (5, 2, 65, 65, 32, "bf16", "key_lengths", 0.0),
       (2, 2, 1000, 1000, 64, "bf16", "none", 0.0), (2, 1, 600, 1000, 128, "bf16", "none", 0.0),
       (5, 2, 33, 47, 64, "bf16", "causal_valid", 0.3)]
    # head dims 16 and 48, the structured masks (the models' shapes and a multi-tile one)
    + [(5, 2, 37, 37, 16, "bf16", "key_lengths", 0.0), (5, 2, 37, 37, 48, "bf16", "causal_valid", 0.0),
       (3, 2, 110, 110, 32, "bf16", "roles", 0.0), (4, 2, 320, 320, 16, "bf16", "window", 0.0),
       (5, 1, 130, 130, 16, "bf16", "window_g3", 0.0)]
)
# the long-sequence candidates (TILELANG_FWD_LONG / TILELANG_BWD_LONG below, first of each), run with
# the bucket's config replaced: (case as above, forward config, backward config)
TILELANG_LONG_CASES = [
    ((2, 2, 1000, 1000, 64, "bf16", "causal_valid", 0.3), (128, 128, 256, 2), (128, 128, 256, 2, "fused")),
    ((2, 2, 1000, 1000, 64, "fp16", "key_lengths", 0.0), (128, 128, 256, 2, "fa3"), (128, 128, 256, 2, "fused")),
    ((2, 2, 1000, 1000, 64, "bf16", "causal", 0.0), (128, 128, 256, 2), (64, 128, 256, 2, "fused")),
    ((2, 1, 600, 1000, 128, "bf16", "causal", 0.0), (128, 128, 256, 2, "fa3"), (64, 128, 256, 2, "fused")),
    ((2, 2, 777, 777, 128, "fp16", "none", 0.0), (128, 128, 256, 2, "fa3"), (64, 128, 256, 2, "fused")),
]
# the row-count test's calls (bucket 0, fp16, key lengths)
RECOMPILE_CASE = (2, 2, 100, 100, 64, "fp16", "key_lengths", 0.0)

# perf_tests/test_attention.py: name, B, H, S, D, masks, directions (the PCVR shape, a wide batch, two long ones)
PERF_SHAPES = [
    ("B8xH8xS128xD64", 8, 8, 128, 64, ("key_lengths", "none"), ("fwd", "fwd+bwd")),
    ("B64xH8xS256xD64", 64, 8, 256, 64, ("none", "key_lengths"), ("fwd",)),
    ("B16xH8xS1024xD64", 16, 8, 1024, 64, ("none",), ("fwd", "fwd+bwd")),
    ("B4xH16xS4096xD128", 4, 16, 4096, 128, ("none",), ("fwd", "fwd+bwd")),
]
# TileLang's benchmark cases are the targets' (PCVR with key lengths, and the two long shapes)
PERF_TILELANG_SKIP = {("B8xH8xS128xD64", "none"), ("B64xH8xS256xD64", "none"), ("B64xH8xS256xD64", "key_lengths")}
CPU_PERF_SHAPES = [("B2xH2xS16xD32", 2, 2, 16, 32, ("key_lengths",), ("fwd", "fwd+bwd"))]
# the models' shapes (models-ii.md section 5), bf16: symbiosis' role mask, the key-length blocks
# (d 64 / 4 heads), tokenformer's causal window 64 + the global target query (with key lengths)
MODEL_PERF_SHAPES = [
    ("B256xH8xS110xD32", 256, 8, 110, 32, ("roles",), ("fwd", "fwd+bwd")),
    ("B256xH4xS256xD16", 256, 4, 256, 16, ("key_lengths",), ("fwd", "fwd+bwd")),
    ("B256xH4xS512xD16", 256, 4, 512, 16, ("key_lengths",), ("fwd", "fwd+bwd")),
    ("B256xH4xS320xD16", 256, 4, 320, 16, ("window",), ("fwd", "fwd+bwd")),
]
PERF_WINDOW = 64  # tokenformer's window (one global query: the target)


def key_lengths(batch: int, skv: int) -> torch.Tensor:
    """Key lengths covering an all-padding row (0), full rows, a partial row and an over-long one."""
    pattern = [0, skv, skv // 2 + 1, skv + 5, 1]
    return torch.tensor([pattern[i % len(pattern)] for i in range(batch)], dtype=torch.int32)


def structured_mask(mode: str, B: int, S: int, seed: int = 0, window: int | None = None, device="cpu") -> dict:
    """flash_attention's keyword arguments of a STRUCTURED mask for a self-attention block of length S.
    roles: symbiosis' layout at S = 110 (random roles otherwise), ~20% of the keys padding (every key of
    the last row when B >= 3: its tokens see themselves only)."""
    if mode == "roles":
        g = torch.Generator().manual_seed(seed)
        if S == len(SYMBIOSIS_LAYOUT):
            roles = torch.tensor(SYMBIOSIS_LAYOUT).expand(B, S).clone()
        else:
            roles = torch.randint(0, 8, (B, S), generator=g)
        valid = torch.rand(B, S, generator=g) > 0.2
        if B >= 3:
            valid[-1] = False
        return {"role_mask": role_mask(roles.to(device), SYMBIOSIS_VISIBILITY.to(device), valid.to(device))}
    w, n_global, use_kl = STRUCTURED[mode]
    kw = {"window": window or w, "global_queries": n_global}
    if use_kl:
        kw["key_lengths"] = key_lengths(B, S).to(device)
    return kw


def inputs(B, H, Sq, Skv, D, dtype, seed) -> list[torch.Tensor]:
    """[q, k, v, grad_out] drawn on the CPU from `seed`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, H, Skv, D, generator=g)
    v = torch.randn(B, H, Skv, D, generator=g)
    do = torch.randn(B, H, Sq, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def flops(B, H, S, D, mask: str, direction: str) -> int:
    """4*B*H*S*S*D forward, 3.5x that for fwd+bwd, half for the causal masks (key padding not subtracted)."""
    n = 4 * B * H * S * S * D
    if direction != "fwd":
        n = int(n * 3.5)
    _, causal, causal_valid = MODES[mask]
    return n // 2 if causal or causal_valid else n


def bytes_moved(B, H, S, D, elem_bytes: int, direction: str) -> int:
    return 4 * B * H * S * D * elem_bytes * (1 if direction == "fwd" else 2)


def mask_spec(mode: str) -> tuple[bool, int]:
    """(uses key lengths, kernel mode code) of a mask name of MODES or STRUCTURED."""
    if mode == "roles":
        return False, MODE_CODE["roles"]
    if mode in STRUCTURED:
        return STRUCTURED[mode][2], MODE_CODE["window"]
    use_kl, causal, causal_valid = MODES[mode]
    return use_kl, MODE_CODE[mode_name(True if use_kl else None, causal, causal_valid)]


def _padded_dim(D: int) -> int:
    return 64 if D == 48 else D  # the entry point pads head dim 48 to 64


def variants(backend: str) -> list[tuple]:
    """(D, dtype, mask mode, dropout, length bucket) of every case of `backend` in the suites."""
    cases = GPU_CASES if backend == "triton" else TILELANG_CASES
    out = {(_padded_dim(D), DTYPES[dt], mode, p > 0, length_bucket(sq)) for (_, _, sq, _, D, dt, mode, p) in cases}
    _, _, sq, _, D, dt, mode, p = RECOMPILE_CASE
    out.add((D, DTYPES[dt], mode, False, length_bucket(sq)))
    for name, _, _, S, D, masks, _ in PERF_SHAPES:
        for mask in masks:
            if backend == "triton" or (name, mask) not in PERF_TILELANG_SKIP:
                out.update((D, dt, mask, False, length_bucket(S)) for dt in DTYPES.values())
    out.update((D, torch.bfloat16, mask, False, length_bucket(S))
               for _, _, _, S, D, masks, _ in MODEL_PERF_SHAPES for mask in masks)
    return sorted(out, key=str)


def tilelang_variants(tune: bool = False) -> list[tuple]:
    """(kernel, D, dtype, mode code, key lengths, dropout, tile config) of the TileLang kernels the suites
    use, TILELANG_LONG_CASES included (and, with `tune`, the tile sweep's candidates: bf16, no mask; the
    long-sequence ones in fp16 too)."""
    out = set()
    for D, dtype, mode, dropout, bucket in variants("tilelang"):
        use_kl, code = mask_spec(mode)
        out.add(("fwd", D, dtype, code, use_kl, dropout, TILELANG_FWD_CONFIGS[(D, bucket)]))
        bwd = TILELANG_BWD_CONFIGS[(D, bucket)]
        out.update((w, D, dtype, code, use_kl, dropout, bwd) for w in backward_kernels(bwd))
    for (_, _, _, _, D, dt, mode, p), fwd_cfg, bwd_cfg in TILELANG_LONG_CASES:
        use_kl, code = mask_spec(mode)
        out.add(("fwd", D, DTYPES[dt], code, use_kl, p > 0, fwd_cfg))
        out.update((w, D, DTYPES[dt], code, use_kl, p > 0, bwd_cfg) for w in backward_kernels(bwd_cfg))
    if tune:
        for D in TILELANG_FWD:
            out.update(("fwd", D, torch.bfloat16, 1, False, False, c) for c in TILELANG_FWD[D])
            out.update((w, D, torch.bfloat16, 1, False, False, c) for c in TILELANG_BWD[D] for w in ("dq", "dkdv"))
            for dtype in (torch.float16, torch.bfloat16):
                out.update(("fwd", D, dtype, 1, False, False, c) for c in TILELANG_FWD_LONG[D])
                out.update(("fused", D, dtype, 1, False, False, c) for c in TILELANG_BWD_LONG[D])
    return sorted(out, key=str)


def run_once(backend: str, D: int, dtype: torch.dtype, mode: str, dropout: bool, bucket: int, device="cuda") -> None:
    """Inference forward, training forward and backward of one variant on tiny CUDA tensors (compiles it; Triton's
    bucket 0 twice where the one-tile backward is routed for D and the mask allows Sq != Skv: the one-tile
    backward at Skv <= 128, the two-kernel one past). `device` "cpu": Triton's interpreter (the tests check which
    kernels a variant warms)."""
    shapes = [{0: (64, 64), 1: (256, 256), 2: (640, 640)}[bucket]]
    if (backend == "triton" and bucket == 0 and mode not in STRUCTURED
            and D in TRITON_ONE_TILE_DEFAULT_DIMS):
        shapes.append((64, 160))  # Skv past the one-tile backward's 128: bucket 0's two-kernel backward
    for Sq, Skv in shapes:
        q = torch.randn(1, 1, Sq, D, device=device, dtype=dtype)
        k, v = (torch.randn(1, 1, Skv, D, device=device, dtype=dtype) for _ in range(2))
        if mode in STRUCTURED:
            args = structured_mask(mode, 1, Sq, device=device)
        else:
            use_kl, causal, causal_valid = MODES[mode]
            kl = torch.tensor([Skv - 3], device=device, dtype=torch.int32) if use_kl else None
            args = dict(key_lengths=kl, causal=causal, causal_valid=causal_valid)
        args.update(dropout_p=0.25 if dropout else 0.0, training=dropout, backend=backend,
                    generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            flash_attention(q, k, v, **args)
        q.requires_grad_()
        flash_attention(q, k, v, **args).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ the tile sweep's candidates
# (python -m pcvr_lib.tune.attention; Triton: (BLOCK_M, BLOCK_N, num_warps, num_stages), TileLang: (block_M,
# block_N, threads, num_stages[, schedule]); the first of each list is timed first)
TRITON_DQ_DEFAULT = {D: TRITON_BWD_DQ_CONFIGS[(D, 0)] for D in (16, 32, 64, 128)}
TRITON_KV_DEFAULT = {D: TRITON_BWD_KV_CONFIGS[(D, 0)] for D in (16, 32, 64, 128)}

# the models' head sizes (16, 32), Triton only: `--skip-tilelang --shapes 256x4x512x16,...`
_SMALL_D = [(64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 4, 2), (64, 128, 4, 2), (128, 64, 8, 3), (32, 64, 4, 2),
            # at D16 the softmax, not the matmul, bounds the forward: fewer warps, narrower key tiles
            (64, 64, 2, 2), (64, 32, 4, 2), (128, 32, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
TRITON_FWD = {16: _SMALL_D, 32: _SMALL_D,
              64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3),
                   (128, 64, 4, 4)],
              128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)]}
TRITON_DQ = {16: _SMALL_D, 32: _SMALL_D,
             64: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 8, 2), (128, 64, 4, 3)],
             128: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)]}
TRITON_KV = {16: _SMALL_D, 32: _SMALL_D,
             64: [(64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2), (32, 64, 4, 3)],
             128: [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2)]}
# the one-tile backward (Sq, Skv <= BLOCK_M; config.TRITON_BWD_ONE_TILE_CONFIGS, untimed when written): timed
# at shapes with S <= 128 against the two-kernel backward's bucket-0 configs (first: the table's default;
# BLOCK_M 64 runs only at S <= 64; the 8-warp 128 x 64 tiles at D64/D128 spill in ptxas, timed anyway)
TRITON_ONE_TILE = {16: [(128, 64, 8, 1), (128, 128, 8, 1), (128, 32, 4, 1), (128, 64, 4, 2), (64, 64, 4, 1)],
                   32: [(128, 64, 8, 1), (128, 32, 8, 1), (128, 128, 8, 1), (128, 64, 4, 2), (64, 64, 4, 1)],
                   64: [(128, 32, 8, 1), (128, 64, 8, 1), (128, 32, 8, 2), (128, 32, 4, 2), (64, 32, 4, 1)],
                   128: [(128, 32, 8, 1), (128, 32, 8, 2), (128, 64, 8, 1), (64, 32, 4, 1)]}
TILELANG_FWD = {64: [(128, 128, 256, 2), (128, 64, 256, 2), (64, 64, 128, 2)],
                128: [(128, 128, 256, 2), (128, 64, 256, 2), (64, 64, 128, 2)]}
TILELANG_BWD = {64: [(64, 64, 128, 2), (128, 64, 256, 2), (64, 128, 256, 2)],
                128: [(64, 64, 128, 2), (128, 64, 256, 2), (64, 32, 128, 2)]}
# the long sequences (notes/attention.md "TileLang long sequences"): the Hopper example's ordered forward pipeline
# ("fa3") and the fused backward (dK/dV per key block, dQ by atomics; "fused"), fp16 and bf16; D64 also the
# plain pipeline with one consumer warpgroup for 128 rows (fewer registers per CTA than 256 threads)
TILELANG_FWD_LONG = {64: [(128, 128, 256, 2, "fa3"), (128, 64, 256, 2, "fa3"), (128, 64, 128, 2)],
                     128: [(128, 128, 256, 2, "fa3"), (128, 64, 256, 2, "fa3")]}
TILELANG_BWD_LONG = {64: [(64, 128, 256, 2, "fused"), (128, 128, 256, 2, "fused"), (64, 64, 128, 2, "fused")],
                     128: [(64, 128, 256, 2, "fused"), (32, 128, 256, 2, "fused"), (64, 64, 128, 2, "fused")]}
