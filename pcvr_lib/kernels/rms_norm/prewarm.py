"""Compile, in parallel processes, every TileLang norm kernel the accuracy and benchmark suites use.

TileLang compiles one kernel in ~3-10 s (nvcc) and keeps it in its disk cache (TILELANG_CACHE_DIR);
running this first lets a GPU session load the kernels instead of compiling them one by one:

    python -m pcvr_lib.kernels.rms_norm.prewarm [--workers 16]

No GPU is needed (kernels are built for sm_90). The width lists here are the suites' manifest.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

# accuracy_tests/test_norms.py: odd and small widths in every dtype, big rows in fp16/bf16
ACCURACY_WIDTHS = (1, 96, 127, 128, 385, 400)
BIG_WIDTHS = (1024, 4096, 16384)
RECOMPILE_WIDTH = 333  # the row-count test (fp16)
NAN_WIDTH = 200  # the NaN-row test (fp32, inference kernel)
# perf_tests/test_kernels.py
PERF_WIDTHS = (128, 1024, 4096)

KINDS = ("fwd_infer", "fwd_train", "bwd")
OPS = ("rms_norm", "layer_norm")


def suite_specs() -> list[tuple[str, str, int, str]]:
    specs = set()
    for op in OPS:
        for kind in KINDS:
            for width in ACCURACY_WIDTHS:
                for dtype in ("float32", "float16", "bfloat16"):
                    specs.add((op, kind, width, dtype))
            for width in BIG_WIDTHS + PERF_WIDTHS:
                for dtype in ("float16", "bfloat16"):
                    specs.add((op, kind, width, dtype))
            specs.add((op, kind, RECOMPILE_WIDTH, "float16"))
        specs.add((op, "fwd_infer", NAN_WIDTH, "float32"))
    return sorted(specs)


def compile_one(spec: tuple[str, str, int, str]) -> float:
    import torch

    from pcvr_lib.kernels.layer_norm import tilelang_kernels as ln
    from pcvr_lib.kernels.rms_norm import tilelang_kernels as rms

    op, kind, width, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    mod = rms if op == "rms_norm" else ln
    t0 = time.perf_counter()
    if kind == "bwd":
        mod.backward_kernel(width, dtype)
    else:
        mod.forward_kernel(width, dtype, kind == "fwd_train")
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    specs = suite_specs()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        seconds = list(pool.map(compile_one, specs))
    cached = sum(s < 1.0 for s in seconds)
    print(f"tilelang norm kernels: {len(specs)} ready in {time.perf_counter() - t0:.1f} s with "
          f"{args.workers} workers ({cached} from the disk cache, {len(specs) - cached} compiled, "
          f"{sum(seconds):.1f} s of compile time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
