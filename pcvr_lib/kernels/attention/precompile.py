"""Compile attention kernel variants in parallel processes, filling Triton's and TileLang's disk caches.

A TileLang kernel takes seconds to compile (nvcc dominates), a Triton kernel about one, and a process
compiles one at a time; the test and benchmark suites need many variants. Warming them first in a pool
of processes turns the suites' own compilations into disk-cache hits. Each variant is warmed by calling
`flash_attention` on tiny tensors of the same head dim, dtype, mask mode, dropout and length bucket
(inference forward, training forward and backward), so the cache keys are exactly the suite's. Usage
(on a GPU machine):

    python -m pcvr_lib.kernels.attention.precompile --workers 14 \
        "triton,tilelang:64:fp16,bf16:none,key_lengths:0:0,1,2" "tilelang:128:bf16:none:0:2"

Each spec is backends:dims:dtypes:modes:dropout(0/1):buckets (bucket 0: Sq <= 128, 1: <= 512, 2: longer).

`--arch sm_90a` compiles the TileLang variants of the specs without a GPU (for that architecture, into
TileLang's disk cache, TILELANG_CACHE_DIR): a CPU machine can fill the cache that a GPU session then
carries and loads in seconds instead of compiling for minutes. Also `--tune` adds tune.py's candidates.
"""

import argparse
import itertools
import multiprocessing as mp
import sys
import time

MODE_KWARGS = {
    "none": dict(kl=False, causal=False, causal_valid=False),
    "key_lengths": dict(kl=True, causal=False, causal_valid=False),
    "causal": dict(kl=False, causal=True, causal_valid=False),
    "causal_kl": dict(kl=True, causal=True, causal_valid=False),
    "causal_valid": dict(kl=True, causal=False, causal_valid=True),
}
BUCKET_LENGTH = {0: 64, 1: 256, 2: 640}
_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def parse_spec(spec: str) -> list[tuple]:
    try:
        backends, dims, dtypes, modes, dropouts, buckets = spec.split(":")
    except ValueError:
        raise ValueError(f"bad spec {spec!r}: want backends:dims:dtypes:modes:dropout:buckets") from None
    for mode in modes.split(","):
        if mode not in MODE_KWARGS:
            raise ValueError(f"bad spec {spec!r}: unknown mode {mode!r} (known: {', '.join(MODE_KWARGS)})")
    return list(itertools.product(
        backends.split(","), [int(d) for d in dims.split(",")], dtypes.split(","), modes.split(","),
        [bool(int(x)) for x in dropouts.split(",")], [int(b) for b in buckets.split(",")],
    ))


def warm(variant) -> tuple:
    """Compile one variant by running it on tiny tensors; returns (variant, seconds, error or None)."""
    import torch

    from pcvr_lib.kernels.attention import flash_attention

    backend, D, dtype_name, mode, dropout, bucket = variant
    t0 = time.perf_counter()
    try:
        dtype = getattr(torch, _DTYPES[dtype_name])
        S = BUCKET_LENGTH[bucket]
        kw = MODE_KWARGS[mode]
        q, k, v = (torch.randn(1, 1, S, D, device="cuda", dtype=dtype) for _ in range(3))
        kl = torch.tensor([S - 3], device="cuda", dtype=torch.int32) if kw["kl"] else None
        args = dict(key_lengths=kl, causal=kw["causal"], causal_valid=kw["causal_valid"],
                    dropout_p=0.25 if dropout else 0.0, training=dropout, backend=backend,
                    generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            flash_attention(q, k, v, **args)
        q.requires_grad_()
        flash_attention(q, k, v, **args).sum().backward()
        torch.cuda.synchronize()
        return variant, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported; the suite then fails on that variant itself
        lines = str(exc).strip().splitlines()
        return variant, time.perf_counter() - t0, f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def compile_tilelang_for(job) -> tuple:
    """Compile one TileLang kernel for an architecture without running it: job = (arch, which, D, dtype name,
    mode code, has key lengths, dropout, config). Returns (job, seconds, error or None)."""
    from . import tilelang_impl as ti

    arch, *key = job
    t0 = time.perf_counter()
    try:
        ti.compiled.__wrapped__(*key, target={"kind": "cuda", "arch": arch})  # uncached: a dict target
        return job, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported and counted
        lines = str(exc).strip().splitlines()
        return job, time.perf_counter() - t0, f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def tilelang_jobs(variants, arch: str, tune: bool) -> list[tuple]:
    """The (arch, kernel key) jobs of the TileLang variants (and of tune.py's candidates when `tune`)."""
    from . import tilelang_impl as ti
    from .masks import MODE_CODE, mode_name

    jobs = set()
    for backend, D, dtype_name, mode, dropout, bucket in variants:
        if backend != "tilelang":
            continue
        kw = MODE_KWARGS[mode]
        name = mode_name(True if kw["kl"] else None, kw["causal"], kw["causal_valid"])
        variant = (D, _DTYPES[dtype_name], MODE_CODE[name], kw["kl"], dropout)
        jobs.add((arch, "fwd", *variant, ti.FWD_CONFIGS[(D, bucket)]))
        jobs.update((arch, which, *variant, ti.BWD_CONFIGS[(D, bucket)]) for which in ("dq", "dkdv"))
    if tune:
        from .tune import TILELANG_BWD, TILELANG_FWD

        for D in TILELANG_FWD:  # tune.py's default dtype (bf16), no mask
            jobs.update((arch, "fwd", D, "bfloat16", 1, False, False, c) for c in TILELANG_FWD[D])
            jobs.update((arch, w, D, "bfloat16", 1, False, False, c) for c in TILELANG_BWD[D] for w in ("dq", "dkdv"))
    return sorted(jobs, key=str)


def precompile_for_arch(jobs, workers: int) -> int:
    """Compile TileLang `jobs` (tilelang_jobs) in `workers` processes, no GPU needed; returns failures."""
    t0 = time.perf_counter()
    failures = 0
    with mp.get_context("spawn").Pool(workers) as pool:
        for job, seconds, error in pool.imap_unordered(compile_tilelang_for, jobs):
            failures += bool(error)
            print(f"compile {job[1:]} for {job[0]}: {seconds:.1f}s {error or ''}", flush=True)
    print(f"compile: {len(jobs)} TileLang kernels in {time.perf_counter() - t0:.1f}s, {failures} failed", flush=True)
    return failures


def precompile(variants, workers: int) -> int:
    """Warm `variants` with `workers` spawned processes; returns the number of failures."""
    t0 = time.perf_counter()
    failures = 0
    with mp.get_context("spawn").Pool(workers) as pool:  # spawn: no CUDA state is forked
        for variant, seconds, error in pool.imap_unordered(warm, variants):
            if error:
                failures += 1
                print(f"precompile FAILED {variant}: {error}", flush=True)
            else:
                print(f"precompile {variant}: {seconds:.1f}s", flush=True)
    print(f"precompile: {len(variants)} variants in {time.perf_counter() - t0:.1f}s, {failures} failed", flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="backends:dims:dtypes:modes:dropout:buckets")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--arch", help="compile the TileLang variants for this architecture (e.g. sm_90a) "
                        "without a GPU, instead of warming everything on the local GPU")
    parser.add_argument("--tune", action="store_true", help="with --arch: also tune.py's TileLang candidates")
    args = parser.parse_args(argv)
    variants = sorted({v for spec in args.specs for v in parse_spec(spec)}, key=str)
    if args.arch:
        return 1 if precompile_for_arch(tilelang_jobs(variants, args.arch, args.tune), args.workers) else 0
    return 1 if precompile(variants, args.workers) else 0


if __name__ == "__main__":
    sys.exit(main())
