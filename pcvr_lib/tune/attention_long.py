# ruff: noqa: B023  (every lambda below is called inside the loop iteration that defines it)
"""Sweep of the long-sequence Triton kernels (triton_long.py) against the old kernels and cuDNN, on the GPU.

    timeout 290 python3 -m pcvr_lib.tune.attention_long --workers 15 --out $OUT/attention_long.json

For each shape (B16 H8 S1024 D64 and B4 H16 S4096 D128, unmasked and causal) x dtype (fp16, bf16) x
direction (fwd, fwd+bwd):
1. every candidate is first checked against the fp64 reference of batch row 0 with the flash rule
   (tolerance.flash_rule: 2x the error of SDPA in the same dtype + one ulp): output for fwd, output and
   dQ/dK/dV for fwd+bwd. A candidate that fails (or does not compile) is recorded and not timed;
2. device time (CUDA events, median of `--reps` after ~0.1 s of warm-up, pcvr_lib.timing's event timer)
   of: the new forward with each config of LONG_FWD; forward (the best passing new forward config) + the
   new backward with each config of LONG_BWD; the old kernels with their config.py tiles; cuDNN (SDPA
   forced to CUDNN_ATTENTION) in the same process.
Compiles run first in a process pool (Triton's disk cache), like `precompile`. The JSON is rewritten
after every case (a timeout keeps what was measured); the table printed last: case, pass count, best
config, device us, x cuDNN, old us. Winners go into TRITON_LONG_FWD_CONFIGS / _BWD_CONFIGS of
pcvr_lib.kernels.attention.config (a head dim whose old kernel wins is removed there, so the old kernel serves it).

On CPU (`--device cpu` under TRITON_INTERPRET=1, tests only) the same path runs through the interpreter;
its "us" are wall-clock times of the interpreter, not measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time

import torch
import torch.nn.functional as F

from pcvr_lib import timing
from pcvr_lib.kernels.attention import triton_impl as tr
from pcvr_lib.kernels.attention import triton_long as tlong
from pcvr_lib.kernels.attention.config import TRITON_BWD_DQ_CONFIGS, TRITON_BWD_KV_CONFIGS, TRITON_FWD_CONFIGS
from pcvr_lib.kernels.attention.reference import reference
from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error

# (BLOCK_M, BLOCK_N, warps, stages, TMA, warp-specialised loop); the first of each list is the default
LONG_FWD = {
    64: [(128, 64, 8, 3, False, False), (128, 64, 4, 3, False, False), (128, 128, 8, 3, False, False),
         (128, 64, 8, 3, True, False), (128, 64, 4, 3, True, False), (128, 128, 8, 2, True, False),
         (64, 64, 4, 3, True, False), (128, 128, 8, 3, True, False), (128, 64, 8, 3, True, True),
         (128, 64, 4, 3, True, True), (128, 128, 8, 3, True, True)],
    128: [(128, 64, 8, 3, False, False), (128, 64, 8, 3, True, False), (128, 64, 8, 2, True, False),
          (128, 128, 8, 2, True, False), (128, 64, 4, 3, True, False), (128, 64, 8, 3, True, True),
          (128, 128, 8, 2, True, True)],
}
# (BLOCK_M queries, BLOCK_N keys, warps, stages, TMA for q / dO)
LONG_BWD = {
    64: [(32, 128, 4, 3, False), (64, 128, 8, 2, False), (32, 64, 4, 3, False), (64, 64, 4, 2, False),
         (64, 128, 4, 2, False), (32, 128, 4, 2, False), (32, 128, 4, 3, True), (64, 128, 8, 2, True),
         (64, 128, 8, 3, True)],
    128: [(64, 128, 8, 2, False), (32, 128, 8, 2, False), (64, 64, 4, 2, False), (32, 64, 4, 2, False),
          (64, 64, 8, 2, False), (32, 128, 4, 2, False), (64, 128, 8, 2, True), (32, 128, 8, 2, True),
          (64, 64, 4, 2, True)],
}
SHAPES = [(16, 8, 1024, 64, "none"), (4, 16, 4096, 128, "none"), (16, 8, 1024, 64, "causal"),
          (4, 16, 4096, 128, "causal")]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _old_configs(D):
    return TRITON_FWD_CONFIGS[(D, 2)], TRITON_BWD_DQ_CONFIGS[(D, 2)], TRITON_BWD_KV_CONFIGS[(D, 2)]


def _compile_job(job):
    """Run one candidate on small CUDA tensors (fills Triton's disk cache): job = (kind, D, dtype, mode, cfg)."""
    kind, D, dtype, mode, cfg = job
    t0 = time.perf_counter()
    try:
        q, k, v, do = (torch.randn(1, 2, 700, D, device="cuda", dtype=dtype) for _ in range(4))  # a tail tile
        scale = 1.0 / math.sqrt(D)
        if kind == "long_fwd":
            tlong.forward(q, k, v, None, mode, scale, 0, 0.0, False, config=cfg)
            tlong.forward(q, k, v, None, mode, scale, 0, 0.0, True, config=cfg)
        elif kind == "long_bwd":
            o, lse = tlong.forward(q, k, v, None, mode, scale, 0, 0.0, True, config=LONG_FWD[D][0])
            tlong.backward(do, q, k, v, o, lse, None, mode, scale, 0, 0.0, config=cfg)
        else:
            fwd, dq, kv = cfg
            tr.forward(q, k, v, None, mode, scale, 0, 0.0, False, config=fwd)
            o, lse = tr.forward(q, k, v, None, mode, scale, 0, 0.0, True, config=fwd)
            tr.backward(do, q, k, v, o, lse, None, mode, scale, 0, 0.0, dq_config=dq, kv_config=kv)
        torch.cuda.synchronize()
        return job, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported; the candidate is then recorded as not compiling
        lines = str(exc).strip().splitlines()
        return job, time.perf_counter() - t0, f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


_CUDA_FAULT = ("cuda", "illegal", "misaligned", "launch failure")


def compile_all(jobs, workers: int) -> dict:
    """Run every job in a pool of spawned processes; returns {job: error} of the jobs that failed.

    A CUDA fault (e.g. a misaligned TMA access) poisons its process: the later jobs of that worker fail too.
    Those failures are retried, each in a fresh process; what still fails is left out of the sweep (it
    would poison the sweep's own process) and reported."""
    errors = {}
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        for job, _seconds, error in pool.imap_unordered(_compile_job, jobs):
            if error:
                errors[job] = error
    retry = [job for job, err in errors.items() if any(w in err.lower() for w in _CUDA_FAULT)]
    if retry:
        with mp.get_context("spawn").Pool(min(workers, len(retry)), maxtasksperchild=1) as pool:
            for job, _seconds, error in pool.imap_unordered(_compile_job, retry):
                if error:
                    errors[job] = error
                else:
                    del errors[job]
    for job, error in errors.items():
        print(f"compile {job[0]} D{job[1]} {dtype_name(job[2])} {job[3]} {job[4]}: {error}", flush=True)
    print(f"compiled {len(jobs)} variants in {time.perf_counter() - t0:.1f} s ({len(retry)} retried alone), "
          f"{len(errors)} failed", flush=True)
    return errors


def _device_seconds(fn, reps: int, device) -> float:
    if device.type != "cuda":  # interpreter smoke test: wall clock, not a measurement
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    timing.warm_gpu(fn, 0.1)
    return timing.median_event_seconds(fn, reps, lead_sleep=True)


def _flash_check(ours, ref, base_err, dtype, what):
    for name, a, r, e in zip(("out", "dq", "dk", "dv"), ours, ref, base_err, strict=False):
        flash_rule(a[:1], r, e, dtype, f"{what} {name}")


def sweep_case(B, H, S, D, mode, dtype, device, reps, fwd_cands, bwd_cands, with_old=True, broken=None):
    """Rows (dicts) of one shape x dtype, both directions. `broken`: {compile job: error} of candidates that
    failed in the compile pool (recorded, never run here)."""
    broken = broken or {}
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    causal = mode == "causal"
    # fp64 reference of batch row 0 (every row runs the same tile walk) and SDPA's own error there
    q64, k64, v64 = (t[:1].double().requires_grad_() for t in (q, k, v))
    ref_o = reference(q64, k64, v64, None, causal, False)
    ref = [ref_o.detach(), *torch.autograd.grad(ref_o, (q64, k64, v64), do[:1].double())]
    del q64, k64, v64, ref_o
    qs, ks, vs = (t[:1].clone().requires_grad_() for t in (q, k, v))
    so = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
    base = [so.detach(), *torch.autograd.grad(so, (qs, ks, vs), do[:1])]
    base_err = [max_abs_error(a, r) for a, r in zip(base, ref, strict=True)]
    del qs, ks, vs, so, base
    flops = 4 * B * H * S * S * D // (2 if causal else 1)
    case = f"B{B}xH{H}xS{S}xD{D} {mode} {dtype_name(dtype)}"
    rows = []

    def record(direction, kernel, cfg, run, check, job=None):
        row = {"case": case, "direction": direction, "kernel": kernel, "config": cfg, "pass": False,
               "error": None, "us": None, "tflops": None}
        try:
            if job in broken:
                raise RuntimeError(f"failed in the compile pool: {broken[job]}")
            check(run())
            row["pass"] = True
        except Exception as exc:  # noqa: BLE001 - a failing or non-compiling candidate is recorded, not timed
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
        if row["pass"]:
            us = _device_seconds(run, reps, device) * 1e6
            work = flops * (1 if direction == "fwd" else 3.5)
            row.update(us=round(us, 2), tflops=round(work / us / 1e6, 1))
        rows.append(row)
        return row

    def fwd_check(out):
        _flash_check([out[0]], ref, base_err, dtype, f"{case} fwd")

    def full_check(out):
        _flash_check(out, ref, base_err, dtype, f"{case} fwd+bwd")

    # forward
    for cfg in fwd_cands:
        record("fwd", "long", list(cfg), lambda: tlong.forward(q, k, v, None, mode, scale, 0, 0.0, False, config=cfg),
               fwd_check, ("long_fwd", D, dtype, mode, cfg))
    old_fwd, old_dq, old_kv = _old_configs(D)
    if with_old:
        record("fwd", "old", [list(old_fwd)], lambda: tr.forward(q, k, v, None, mode, scale, 0, 0.0, False,
                                                                 config=old_fwd), fwd_check,
               ("old", D, dtype, mode, (old_fwd, old_dq, old_kv)))
    passed = [r for r in rows if r["direction"] == "fwd" and r["kernel"] == "long" and r["pass"]]
    best_fwd = tuple(min(passed, key=lambda r: r["us"])["config"]) if passed else fwd_cands[0]

    # forward + backward (the new forward with its best config, then each backward config)
    def long_full(cfg):
        o, lse = tlong.forward(q, k, v, None, mode, scale, 0, 0.0, True, config=best_fwd)
        return (o, *tlong.backward(do, q, k, v, o, lse, None, mode, scale, 0, 0.0, config=cfg))

    for cfg in bwd_cands:
        record("fwd+bwd", "long", [list(best_fwd), list(cfg)], lambda: long_full(cfg), full_check,
               ("long_bwd", D, dtype, mode, cfg))

    def old_full():
        o, lse = tr.forward(q, k, v, None, mode, scale, 0, 0.0, True, config=old_fwd)
        return (o, *tr.backward(do, q, k, v, o, lse, None, mode, scale, 0, 0.0, dq_config=old_dq, kv_config=old_kv))

    if with_old:
        record("fwd+bwd", "old", [list(old_fwd), list(old_dq), list(old_kv)], old_full, full_check,
               ("old", D, dtype, mode, (old_fwd, old_dq, old_kv)))

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return [F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)]

        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def cudnn_full():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
            return (o, *torch.autograd.grad(o, (qg, kg, vg), do))

        with torch.no_grad():
            record("fwd", "cudnn", None, cudnn_fwd, fwd_check)
        record("fwd+bwd", "cudnn", None, cudnn_full, full_check)
    return rows


def dtype_name(dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def summary(rows) -> list[dict]:
    """Per (case, direction): the best passing new config, its device us, x cuDNN, the old kernel's us."""
    out = []
    keys = sorted({(r["case"], r["direction"]) for r in rows})
    for case, direction in keys:
        group = [r for r in rows if r["case"] == case and r["direction"] == direction]
        longs = [r for r in group if r["kernel"] == "long"]
        ok = [r for r in longs if r["pass"]]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        cudnn = next((r["us"] for r in group if r["kernel"] == "cudnn" and r["pass"]), None)
        old = next((r["us"] for r in group if r["kernel"] == "old" and r["pass"]), None)
        out.append({"case": case, "direction": direction, "passed": f"{len(ok)}/{len(longs)}",
                    "best_config": best["config"] if best else None, "us": best["us"] if best else None,
                    "x_cudnn": round(cudnn / best["us"], 3) if best and cudnn else None,
                    "cudnn_us": cudnn, "old_us": old,
                    "old_x_cudnn": round(cudnn / old, 3) if old and cudnn else None})
    return out


def print_table(summ) -> None:
    print(f"{'case':<32} {'dir':<8} {'pass':>5} {'best config':<48} {'us':>9} {'x cuDNN':>8} {'cuDNN us':>9} "
          f"{'old us':>9} {'old x':>6}")
    for s in summ:
        def f(x, spec):
            return format(x, spec) if x is not None else "-"
        print(f"{s['case']:<32} {s['direction']:<8} {s['passed']:>5} {str(s['best_config']):<48} "
              f"{f(s['us'], '9.1f')} {f(s['x_cudnn'], '8.3f')} {f(s['cudnn_us'], '9.1f')} {f(s['old_us'], '9.1f')} "
              f"{f(s['old_x_cudnn'], '6.3f')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_long.json"))
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--shapes", default=None,
                        help="BxHxSxD:mode,... (default: SHAPES, the long shapes unmasked and causal)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-candidates", type=int, default=None, help="first N of each list (smoke tests)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = SHAPES
    if args.shapes:
        shapes = []
        for item in args.shapes.split(","):
            dims, mode = item.split(":")
            shapes.append((*(int(x) for x in dims.split("x")), mode))
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    n = args.max_candidates
    fwd_c = {D: LONG_FWD[D][:n] for D in LONG_FWD}
    bwd_c = {D: LONG_BWD[D][:n] for D in LONG_BWD}

    broken = {}
    if device.type == "cuda" and args.workers > 0:
        jobs = []
        for D, mode in sorted({(s[3], s[4]) for s in shapes}):
            for dt in dtypes:
                jobs += [("long_fwd", D, dt, mode, c) for c in fwd_c[D]]
                jobs += [("long_bwd", D, dt, mode, c) for c in bwd_c[D]]
                jobs.append(("old", D, dt, mode, _old_configs(D)))
        broken = compile_all(jobs, args.workers)

    rows = []
    t_start = time.perf_counter()
    for B, H, S, D, mode in shapes:
        for dt in dtypes:
            t0 = time.perf_counter()
            rows += sweep_case(B, H, S, D, mode, dt, device, args.reps, fwd_c[D], bwd_c[D], broken=broken)
            print(f"case B{B}xH{H}xS{S}xD{D} {mode} {dtype_name(dt)}: {time.perf_counter() - t0:.1f} s", flush=True)
            doc = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                   "triton": __import__("triton").__version__, "torch": torch.__version__,
                   "reps": args.reps, "rows": rows, "summary": summary(rows)}
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(doc, fh, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"sweep {time.perf_counter() - t_start:.1f} s; JSON {args.out}; median device us of {args.reps} reps")
    for r in rows:
        if not r["pass"]:
            print(f"FAILED {r['case']} {r['direction']} {r['kernel']} {r['config']}: {r['error']}")
    print_table(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
