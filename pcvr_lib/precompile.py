"""Build every kernel the suites use ahead of time, from the ops' workload manifests.

    python -m pcvr_lib.precompile [OP ...] [--arch sm_90a] [--workers N] [--tune] [--models] [--run-triton]

TileLang compiles one kernel in seconds (nvcc dominates) and keeps it in its disk cache
(TILELANG_CACHE_DIR, default ~/.tilelang/cache), so a later process only loads it. This compiles the
TileLang variants of each op's workload (pcvr_lib.workloads) in `workers` processes, for `--arch` (default:
the local GPU's, or sm_90a for the H200 without one: each op takes the form it is compiled with, sm_90 for the norms and
the embedding, sm_90a for attention). No GPU is needed: a CPU machine fills the cache a GPU session then
carries. OPs: rms_norm layer_norm embedding_bag_mean flash_attention (default: all). `--tune` adds the
attention tile sweep's candidates; `--models` keeps only the models' variants (the model-level benchmark's,
recorded by pcvr_lib.workloads.model_kernels; the full manifest includes them).
`--run-triton` (GPU only) also runs every Triton attention variant once in the pool, filling Triton's
disk cache (the norms' and embedding's few Triton kernels compile at first use in about a second each).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import sys
import time

import torch

from pcvr_lib.kernels import _tilelang, dispatch
from pcvr_lib.workloads import attention, embedding_bag, norms
from pcvr_lib.workloads.model_kernels import MODEL_VARIANTS

OPS = ("rms_norm", "layer_norm", "embedding_bag_mean", "flash_attention")


def _manifest(op: str, tune: bool) -> list[tuple]:
    if op in ("rms_norm", "layer_norm"):
        return norms.tilelang_variants(op)
    if op == "embedding_bag_mean":
        return embedding_bag.tilelang_variants()
    return attention.tilelang_variants(tune)


def tilelang_jobs(ops, arch: str, tune: bool = False, models_only: bool = False) -> list[tuple]:
    """(op, variant, arch) of every TileLang kernel in the manifests of `ops`, the models' variants included
    (`models_only`: only those, the variants of perf_tests/test_models.py)."""
    jobs = []
    for op in ops:
        variants = [] if models_only else list(_manifest(op, tune))
        known = set(variants)
        variants += [v for v in MODEL_VARIANTS[op] if v not in known]
        jobs += [(op, variant, arch) for variant in variants]
    return jobs


def compile_variant(op: str, variant: tuple, arch: str):
    """Compile one TileLang kernel of `op` without running it: variant = (kind, ...) as in the op's manifest
    (kind e.g. "fwd_train"; torch dtypes), for `arch` as the op takes it (sm_90a -> sm_90 but for attention).
    Returns the JITKernel."""
    kernels = importlib.import_module(f"{dispatch.get_op(op).package}.tilelang_impl").KERNELS
    return kernels.compile((f"{op}.{variant[0]}", *variant[1:]), arch)


def compile_job(job) -> tuple:
    """Compile one TileLang kernel: job = (op, variant, arch). Returns (job, seconds, error or None)."""
    t0 = time.perf_counter()
    try:
        compile_variant(*job)
        return job, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported and counted; the suite then fails on that variant
        lines = str(exc).strip().splitlines()
        return job, time.perf_counter() - t0, f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def run_triton_job(variant) -> tuple:
    """Run one Triton attention variant on the GPU (compiles it into Triton's disk cache)."""
    t0 = time.perf_counter()
    try:
        attention.run_once("triton", *variant)
        return variant, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported and counted
        lines = str(exc).strip().splitlines()
        return variant, time.perf_counter() - t0, f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def run_pool(fn, jobs, workers: int, what: str) -> int:
    """`fn` over `jobs` in `workers` spawned processes (no CUDA state forked); prints one line per job and a
    total; returns the number of failures."""
    t0 = time.perf_counter()
    failures = loaded = 0
    with mp.get_context("spawn").Pool(max(1, workers)) as pool:
        for job, seconds, error in pool.imap_unordered(fn, jobs):
            failures += bool(error)
            loaded += seconds < 1.0
            print(f"{what} {job}: {seconds:.1f}s {error or ''}", flush=True)
    print(f"{what}: {len(jobs)} variants ready in {time.perf_counter() - t0:.1f}s with {workers} workers "
          f"({loaded} under 1 s: disk-cache loads), {failures} failed", flush=True)
    return failures


def default_arch() -> str:
    return _tilelang.arch(torch.device("cuda")) if torch.cuda.is_available() else "sm_90a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"operators (default: all of {', '.join(OPS)})")
    parser.add_argument("--arch", help="TileLang architecture, e.g. sm_90a (default: the local GPU's, else sm_90a)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tune", action="store_true", help="also the attention tile sweep's TileLang candidates")
    parser.add_argument("--models", action="store_true",
                        help="only the models' variants (perf_tests/test_models.py; pcvr_lib.workloads.model_kernels)")
    parser.add_argument("--run-triton", action="store_true", help="also run every Triton attention variant (GPU)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        parser.error(f"unknown operator(s) {', '.join(unknown)}; known: {', '.join(OPS)}")
    ops = args.ops or list(OPS)
    failures = run_pool(compile_job, tilelang_jobs(ops, args.arch or default_arch(), args.tune, args.models),
                        args.workers,
                        "tilelang")
    if args.run_triton and "flash_attention" in ops:
        failures += run_pool(run_triton_job, attention.variants("triton"), args.workers, "triton")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
