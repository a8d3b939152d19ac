"""H200 sweep of the TileLang long-sequence candidates against Triton and cuDNN.

    python tools/attention_long_tl.py [--out DIR] [--shapes 16x8x1024x64,4x16x4096x128] [--dtypes fp16,bf16]

For each shape and dtype: every candidate is first checked against the fp64 reference by the flash rule
(tolerance.flash_rule: 2x the error of SDPA's default dispatch + one ulp), then timed. Device time: the
profiler's kernel sum over `--calls` back-to-back calls (after 0.2 s of warm-up calls, L2 warm as in
tune.py), through the backends' kernel entry points (no autograd), so the host's launch cost stays out;
cuDNN through SDPA with autograd (its kernels only are counted). fwd+bwd = forward + backward kernels of one
step (TileLang: the default forward with each backward candidate, and the best forward with the best
backward). Every TileLang candidate must be in the carried disk cache (a compile on the H200 host costs
30-80 s each): `python -m pcvr_lib.precompile flash_attention --arch sm_90a --tune`. A candidate
that fails the check or raises is reported and never timed. Writes `attention_long_tl.json` to `--out`
(default $OUT, else .), rewritten after every row, and prints one table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcvr_lib import timing  # noqa: E402
from pcvr_lib.kernels import compile_log  # noqa: E402
from pcvr_lib.kernels.attention import config  # noqa: E402
from pcvr_lib.kernels.attention import tilelang_impl as ti  # noqa: E402
from pcvr_lib.kernels.attention import triton_impl as tr  # noqa: E402
from pcvr_lib.kernels.attention.masks import length_bucket  # noqa: E402
from pcvr_lib.kernels.attention.reference import reference  # noqa: E402
from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error  # noqa: E402
from pcvr_lib.workloads import attention as workload  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def device_seconds(fn, calls: int) -> float:
    """Kernel time per call: warm the clocks for 0.2 s, then the profiler's CUDA kernel sum over `calls`."""
    from torch.profiler import ProfilerActivity, profile

    timing.warm_gpu(fn, 0.2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return timing.kernel_seconds(prof.events()) / calls


class Recorder:
    """Checks, then times, one candidate; keeps the rows (a failure is a row with "error", never timed)."""

    def __init__(self, calls: int, path: str):
        self.calls = calls
        self.path = path
        self.rows: list[dict] = []

    def __call__(self, case: dict, backend: str, cfg, fn, check) -> dict:
        row = {**case, "backend": backend, "config": None if cfg is None else str(cfg)}
        flops = row.pop("flops")
        try:
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            row["max_err"], row["max_rel_err"] = check(got)
            us = device_seconds(fn, self.calls) * 1e6
            row["device_us"] = round(us, 1)
            row["tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
        except Exception as exc:  # noqa: BLE001 - a failed candidate is reported, the sweep goes on
            lines = str(exc).strip().splitlines()
            row["error"] = f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write()  # after every row: a later crash (a faulting kernel poisons the context) keeps these
        return row

    def write(self, meta: dict | None = None) -> None:
        with open(self.path, "w") as f:
            json.dump({"meta": meta or {}, "rows": self.rows}, f, indent=1)


def sweep_case(record: Recorder, B: int, H: int, S: int, D: int, dname: str, device: str = "cuda") -> None:
    """Every backend and candidate of one (shape, dtype), forward then forward+backward."""
    shape, dt, bucket, scale = f"B{B}xH{H}xS{S}xD{D}", DTYPES[dname], length_bucket(S), 1.0 / math.sqrt(D)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g, device=device).to(dt) for _ in range(4))
    # fp64 reference and the error of SDPA's default dispatch in this dtype (the flash rule's baseline)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_o = reference(q64, k64, v64, None, False, False)
    ref = [ref_o.detach(), *torch.autograd.grad(ref_o, (q64, k64, v64), do.double())]
    del q64, k64, v64, ref_o
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs)
    base = [max_abs_error(a, r) for a, r in zip([out, *torch.autograd.grad(out, (qs, ks, vs), do)], ref, strict=True)]
    del out

    def check(got):
        errs = [flash_rule(a, r, e, dt, name) for a, r, e, name in
                zip(got, ref[:len(got)], base[:len(got)], ("out", "dq", "dk", "dv")[:len(got)], strict=True)]
        return max(e[0] for e in errs), max(e[1] for e in errs)

    def fwd(mod, cfg=None):
        kw = {"config": cfg} if cfg else {}
        return lambda: mod.forward(q, k, v, None, "none", scale, 0, 0.0, False, **kw)[:1]

    def step(mod, fcfg=None, bcfg=None):
        def call():
            o, lse = mod.forward(q, k, v, None, "none", scale, 0, 0.0, True, **({"config": fcfg} if fcfg else {}))
            return (o, *mod.backward(do, q, k, v, o, lse, None, "none", scale, 0, 0.0,
                                     **({"config": bcfg} if bcfg else {})))
        return call

    def cudnn(direction):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                if direction == "fwd":
                    return (F.scaled_dot_product_attention(q, k, v),)
                o = F.scaled_dot_product_attention(qs, ks, vs)
                return (o, *torch.autograd.grad(o, (qs, ks, vs), do))
        return call

    case = {"shape": shape, "dtype": dname, "dir": "fwd", "flops": workload.flops(B, H, S, D, "none", "fwd")}
    record(case, "cudnn", None, cudnn("fwd"), check)
    record(case, "triton", "default", fwd(tr), check)  # the long bucket's dispatch (triton_long where it applies)
    fwd_default = config.TILELANG_FWD_CONFIGS[(D, bucket)]
    best_fwd = None
    for cfg in [fwd_default, *[c for c in workload.TILELANG_FWD_LONG.get(D, []) if c != fwd_default]]:
        row = record(case, "tilelang", cfg, fwd(ti, cfg), check)
        if "device_us" in row and (best_fwd is None or row["device_us"] < best_fwd[1]):
            best_fwd = (cfg, row["device_us"])

    case = {**case, "dir": "fwd+bwd", "flops": workload.flops(B, H, S, D, "none", "fwd+bwd")}
    record(case, "cudnn", None, cudnn("fwd+bwd"), check)
    record(case, "triton", "default", step(tr), check)
    bwd_default = config.TILELANG_BWD_CONFIGS[(D, bucket)]
    best_bwd = None
    for cfg in [bwd_default, *[c for c in workload.TILELANG_BWD_LONG.get(D, []) if c != bwd_default]]:
        row = record(case, "tilelang", f"fwd {fwd_default}, bwd {cfg}", step(ti, fwd_default, cfg), check)
        if "device_us" in row and (best_bwd is None or row["device_us"] < best_bwd[1]):
            best_bwd = (cfg, row["device_us"])
    if best_fwd and best_bwd and best_fwd[0] != fwd_default:
        record(case, "tilelang", f"fwd {best_fwd[0]}, bwd {best_bwd[0]}", step(ti, *best_fwd[:1], best_bwd[0]), check)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="16x8x1024x64,4x16x4096x128")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_long_tl.json")
    record = Recorder(args.calls, path)
    for spec in args.shapes.split(","):
        B, H, S, D = (int(x) for x in spec.split("x"))
        for dname in args.dtypes.split(","):
            sweep_case(record, B, H, S, D, dname)
            torch.cuda.empty_cache()
    record.write({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "timing": f"profiler kernel sum / {args.calls} calls, L2 warm, after 0.2 s of warm-up calls",
                  "tilelang_compile_s": round(compile_log.total("tilelang"), 1),
                  "tilelang_kernels_built": compile_log.count("tilelang"),
                  # over 5 s: compiled on this host, not loaded from the carried cache
                  "tilelang_compiled_here": [str(key) for key, sec in compile_log.SECONDS.items()
                                             if key[0] == "tilelang" and sec > 5.0]})
    print(f"wrote {path}")
    print(table(record.rows))
    return 0


def table(rows) -> str:
    """One line per row: device us, TFLOP/s, and the ratio to Triton's device time of the same case."""
    triton = {(r["shape"], r["dtype"], r["dir"]): r.get("device_us") for r in rows if r["backend"] == "triton"}
    lines = [f"{'shape':<18} {'dt':<4} {'dir':<7} {'backend':<8} {'config':<60} {'us':>8} {'TF/s':>6} {'/triton':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:<18} {r['dtype']:<4} {r['dir']:<7} {r['backend']:<8} {str(r['config']):<60} "
                         f"FAILED {r['error'][:80]}")
            continue
        t = triton.get((r["shape"], r["dtype"], r["dir"]))
        ratio = f"{r['device_us'] / t:7.2f}" if t else "      -"
        lines.append(f"{r['shape']:<18} {r['dtype']:<4} {r['dir']:<7} {r['backend']:<8} {str(r['config']):<60} "
                     f"{r['device_us']:8.1f} {r['tflops']:6.1f} {ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
