# ruff: noqa: B023  (every lambda below is called inside the loop iteration that defines it)
"""Tile-config sweep for the long-sequence buckets (run on the GPU; prints one table, best first).

    python -m pcvr_lib.tune.attention --shapes 16x8x1024x64,4x16x4096x128 --dtype bf16
    python -m pcvr_lib.tune.attention --one-tile-only --shapes 8x8x128x64,256x8x110x32,256x4x128x16,64x8x128x128
    python -m pcvr_lib.tune.attention --skip-tilelang --mask window --kernels dkdv --shapes 256x4x320x16

`--mask` times every candidate under one of the models' masks (default none): a tile that wins unmasked can lose
where the mask skips tiles (a window of 64 keys computes half the scores of a 128-key tile). `--kernels dkdv`
times only the dK/dV candidates.

At S <= 128 it also times the one-tile backward's candidates (TRITON_ONE_TILE) against the two-kernel backward.

Times device time (CUDA events, median, no L2 flush, after 0.1 s of warm-up calls) of each candidate for
the forward kernel and each backward kernel of both backends, after checking the candidate's output against
the current default's.
The candidates are pcvr_lib.workloads.attention's. TileLang candidates are compiled in parallel processes first
(`python -m pcvr_lib.precompile flash_attention --tune` builds them into the disk cache ahead, on any machine).
The winners are copied by hand into the tables of pcvr_lib.kernels.attention.config, with the figures in
notes/attention.md.
"""

import argparse
import math
import multiprocessing as mp
import time

import torch

from pcvr_lib import precompile, timing
from pcvr_lib.kernels import _tilelang
from pcvr_lib.kernels.attention import tilelang_impl as ti
from pcvr_lib.kernels.attention import triton_impl as tr
from pcvr_lib.kernels.attention.masks import StructuredMask
from pcvr_lib.workloads import attention as workload
from pcvr_lib.workloads.attention import (
    TILELANG_BWD,
    TILELANG_FWD,
    TRITON_DQ,
    TRITON_DQ_DEFAULT,
    TRITON_FWD,
    TRITON_KV,
    TRITON_KV_DEFAULT,
    TRITON_ONE_TILE,
)

MASKS = ("none", "key_lengths", "window", "roles")


def mask_args(mask: str, B: int, S: int, device) -> tuple:
    """(key lengths, mode, structured mask) of the kernels for `mask` over a self-attention block of length S: key
    lengths workload.key_lengths (an empty row, full, partial, over-long ones; the perf suite draws its lengths at
    random instead), tokenformer's window as the perf suite's model case sets it (workload.PERF_WINDOW, the target
    as one global query) over those lengths, symbiosis' roles with ~20% padding keys (workload.structured_mask)."""
    if mask not in MASKS:
        raise ValueError(f"tune: --mask must be one of {', '.join(MASKS)}, got {mask!r}")
    if mask == "none":
        return None, "none", None
    if mask == "roles":
        rm = workload.structured_mask("roles", B, S, device=device)["role_mask"]
        return None, "roles", StructuredMask(codes=rm.codes, words=rm.words)
    kl = workload.key_lengths(B, S).to(device)
    if mask == "window":
        return kl, "window", StructuredMask(window=workload.PERF_WINDOW, global_queries=1)
    return kl, "key_lengths", None


def _time(fn, reps=20, warm_s=0.1) -> float:
    # Warm the clocks first: a cold GPU times the first candidates slower and ranks them differently.
    timing.warm_gpu(fn, warm_s)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _compile_tl(key):
    t0 = time.perf_counter()
    try:
        precompile.compile_variant("flash_attention", key[:-1], key[-1])
        return key, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
        return key, time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x8x1024x64,4x16x4096x128")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--skip-tilelang", action="store_true")
    parser.add_argument("--one-tile-only", action="store_true",
                        help="only the one-tile backward's candidates against the two-kernel backward (S <= 128)")
    parser.add_argument("--kernels", default="fwd,dq,dkdv",
                        help="Triton kernels whose candidates are timed: fwd, dq, dkdv (comma-separated; default all)")
    parser.add_argument("--mask", default="none", choices=MASKS,
                        help="the mask every candidate is timed under (the models' layouts; default none)")
    args = parser.parse_args(argv)
    kernels = set(args.kernels.split(","))
    if not kernels <= {"fwd", "dq", "dkdv"}:
        parser.error(f"--kernels: unknown {sorted(kernels - {'fwd', 'dq', 'dkdv'})}; choose from fwd, dq, dkdv")
    if args.one_tile_only:
        args.skip_tilelang = True
        kernels = set()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    arch = _tilelang.arch(torch.device("cuda"), arch_specific=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    if not args.skip_tilelang:
        keys = []
        has_kl, code = workload.mask_spec(args.mask)
        for *_, D in shapes:
            keys += [("fwd", D, dtype, code, has_kl, False, c, arch) for c in TILELANG_FWD.get(D, [])]
            keys += [(w, D, dtype, code, has_kl, False, c, arch) for c in TILELANG_BWD.get(D, [])
                     for w in ("dq", "dkdv")]
        with mp.get_context("spawn").Pool(args.workers) as pool:
            for key, seconds, error in pool.imap_unordered(_compile_tl, keys):
                print(f"tilelang compile {key[0]} D{key[1]} {key[-1]}: {seconds:.1f}s {error or ''}", flush=True)

    rows = []
    for B, H, S, D in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype) for _ in range(4))
        scale = 1.0 / math.sqrt(D)
        flops = 4 * B * H * S * S * D
        kl, mode, structured = mask_args(args.mask, B, S, q.device)
        ref_o, ref_lse = tr.forward(q, k, v, kl, mode, scale, 0, 0.0, True, structured=structured)
        ref_g = tr.backward(do, q, k, v, ref_o, ref_lse, kl, mode, scale, 0, 0.0, structured=structured)
        shape = f"B{B}xH{H}xS{S}xD{D}" + ("" if mode == "none" else f",{mode}")

        def record(name, cfg, fn, check, work):
            try:
                out = fn()
                torch.cuda.synchronize()
                err = check(out)
                us = _time(fn)
                rows.append((shape, name, cfg, us, work / (us * 1e-6) / 1e12, err))
                print(f"timed {shape} {name} {cfg}: {us:.1f} us, max err {err:.2e}", flush=True)  # kept if cut
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, continue
                rows.append((shape, name, cfg, float("nan"), float("nan"), f"{type(exc).__name__}"))

        def err_of(a, b):
            return float((a.float() - b.float()).abs().max())

        def fwd(impl, store_lse=False, **config):  # the sweep's problem (mask included) through one backend
            return impl.forward(q, k, v, kl, mode, scale, 0, 0.0, store_lse, structured=structured, **config)

        def bwd(impl, o, lse, **config):
            return impl.backward(do, q, k, v, o, lse, kl, mode, scale, 0, 0.0, structured=structured, **config)

        def grads_err(out):
            return max(err_of(a, b) for a, b in zip(out, ref_g, strict=True))

        for cfg in TRITON_FWD[D] if "fwd" in kernels else []:
            record("triton fwd", cfg, lambda c=cfg: fwd(tr, config=c), lambda out: err_of(out[0], ref_o), flops)
        for cfg in TRITON_DQ[D] if "dq" in kernels else []:
            record("triton bwd dq", cfg, lambda c=cfg: bwd(tr, ref_o, ref_lse, dq_config=c),
                   lambda out: err_of(out[0], ref_g[0]), 1.5 * flops)
        for cfg in TRITON_KV[D] if "dkdv" in kernels else []:
            record("triton bwd dq+dkdv", cfg, lambda c=cfg: bwd(tr, ref_o, ref_lse, kv_config=c),
                   lambda out: max(err_of(out[1], ref_g[1]), err_of(out[2], ref_g[2])), 2.5 * flops)
        if S <= 128:  # the one-tile backward against the two-kernel one at bucket 0's configs
            two = (TRITON_DQ_DEFAULT[D], TRITON_KV_DEFAULT[D])
            record("triton bwd 2 kernels", two, lambda: bwd(tr, ref_o, ref_lse, dq_config=two[0], kv_config=two[1]),
                   grads_err, 2.5 * flops)
            for cfg in [c for c in TRITON_ONE_TILE[D] if S <= c[0]]:
                record("triton bwd one-tile", cfg, lambda c=cfg: bwd(tr, ref_o, ref_lse, one_tile_config=c),
                       grads_err, 2.5 * flops)
        if args.skip_tilelang:
            continue
        for cfg in TILELANG_FWD.get(D, []):
            record("tilelang fwd", cfg, lambda c=cfg: fwd(ti, store_lse=True, config=c),
                   lambda out: err_of(out[0], ref_o), flops)
        tl_o, tl_lse = fwd(ti, store_lse=True)
        for cfg in TILELANG_BWD.get(D, []):
            record("tilelang bwd", cfg, lambda c=cfg: bwd(ti, tl_o, tl_lse, config=c), grads_err, 2.5 * flops)
    print(f"{'shape':<32} {'kernel':<20} {'config':<20} {'us':>9} {'TFLOP/s':>8} {'max err':>10}")
    for shape, name, cfg, us, tf, err in sorted(rows, key=lambda r: (r[0], r[1], r[3])):
        err_s = err if isinstance(err, str) else f"{err:.2e}"
        print(f"{shape:<32} {name:<20} {str(cfg):<20} {us:9.1f} {tf:8.1f} {err_s:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
