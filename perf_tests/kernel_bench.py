"""Shared case runner for the kernel benchmarks (norms, embedding bag, attention).

Every case: skip with the registry's reason when the backend cannot run here; check the result
against the fp64 reference FIRST (a mismatch fails the case, nothing is timed); time with
`pcvr_lib.timing.bench_gpu`; fill `extra_info` with bytes, GB/s, fraction of the measured copy ceiling,
speedup vs torch eager measured in the same run, speedup vs the best peer measured in the same run,
max errors and compile seconds.

Speedups need the baselines' times: parametrize so that "torch" comes first and the peers
("torch_compile", "liger") before our backends. When torch eager has not run yet for a case key (e.g.
`-k triton`), the runner times it itself with the same timer, untouched by pytest-benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pcvr_lib import timing
from pcvr_lib.kernels import registry
from pcvr_lib.kernels.tolerance import DTYPE_NAMES

PEERS = ("torch", "torch_compile", "liger")
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items() if dtype != torch.float64}  # "fp16" -> torch.float16


@dataclass(frozen=True)
class CaseKey:
    """What is computed, independent of who computes it."""

    op: str
    shape: str  # e.g. "65536x1024"
    dtype: str  # fp16 | bf16 | fp32
    direction: str  # fwd | fwd+bwd

    def case_id(self, backend: str) -> str:
        """Readable stable id: op=rms_norm,backend=triton,shape=65536x1024,dtype=bf16,dir=fwd."""
        return f"op={self.op},backend={backend},shape={self.shape},dtype={self.dtype},dir={self.direction}"


# per-call seconds measured in this session: key -> backend -> seconds
_TIMES: dict[CaseKey, dict[str, float]] = {}


def require_gpu_backend(op: str, backend: str) -> torch.device:
    """Skip (with the reason) unless a CUDA device is here and `backend` of `op` can run on it.

    With PCVR_BENCH_DEADLINE (a Unix time) set, cases starting after it skip, so a time-limited run
    still ends normally and writes its JSON.
    """
    deadline = os.environ.get("PCVR_BENCH_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("time budget of this run (PCVR_BENCH_DEADLINE) used up")
    if not torch.cuda.is_available():
        pytest.skip(f"{backend}: no CUDA device (GPU benchmark)")
    ok, reason = registry.backend_status(op, backend, "cuda") if backend in registry.op_backends(op) else (
        _peer_status(backend))
    if not ok:
        pytest.skip(reason)
    return torch.device("cuda")


def _peer_status(backend: str) -> tuple[bool, str]:
    info = registry.BACKENDS[backend]
    if info.package:
        problem = registry.package_problem(info.package)
        if problem:
            return False, f"{backend}: {problem}"
    return True, "ok"


def quick_time(fn: Callable[[], object]) -> float:
    """Per-call seconds with bench_gpu's method, outside pytest-benchmark (for a missing baseline)."""
    fn()
    torch.cuda.synchronize()
    device_s, _method = timing.device_time(fn)
    n = timing.choose_calls(device_s)
    clock = timing.CudaEventClock(calls=n)
    samples = []
    for _ in range(10):
        timing.flush_l2()
        torch.cuda.synchronize()
        t0 = clock()
        for _ in range(n):
            fn()
        samples.append(clock() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def timed_first_call(fn: Callable[[], object]) -> tuple[object, float]:
    """Run `fn` once, returning (result, seconds incl. any compilation) after synchronising."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run_case(benchmark, *, key: CaseKey, backend: str, call: Callable[[], object],
             check: Callable[[], tuple[float, float]], bytes_moved: int, flops: int | None = None,
             compile_s: float | None = None, torch_call: Callable[[], object] | None = None,
             rounds: int = 30, graph: bool = True) -> dict:
    """Check, then time one case; returns the extra_info it recorded.

    `check()` runs the backend on fresh (poisoned) outputs and asserts them against the fp64 reference,
    returning (max abs error, max rel error); it raises on a mismatch, which fails the case untimed.
    `torch_call` times torch eager for the same key when that case has not run in this session.
    """
    benchmark.group = f"{key.op} {key.shape} {key.dtype} {key.direction}"
    benchmark.extra_info.update({"op": key.op, "backend": backend, "shape": key.shape, "dtype": key.dtype,
                                 "dir": key.direction})
    max_abs, max_rel = check()
    benchmark.extra_info.update({"max_abs_error": max_abs, "max_rel_error": max_rel})

    timing_info = timing.bench_gpu(benchmark, call, rounds=rounds, graph=graph)
    per_call_s = timing_info["per_call_us"] / 1e6
    if not benchmark.enabled:
        return dict(benchmark.extra_info)

    _TIMES.setdefault(key, {})[backend] = per_call_s
    ceilings = timing.measure_ceilings()
    info = {
        "bytes": bytes_moved,
        "gbps": round(timing.gbps(bytes_moved, per_call_s), 1),
        "device_gbps": round(timing.gbps(bytes_moved, timing_info["device_us"] / 1e6), 1),
        "copy_ceiling_gbps": ceilings["copy_gbps"],
        "fraction_of_copy_ceiling": round(timing.gbps(bytes_moved, per_call_s) / ceilings["copy_gbps"], 4),
        "compile_s": None if compile_s is None else round(compile_s, 3),
    }
    if flops:
        info["flops"] = flops
        info["tflops"] = round(timing.tflops(flops, per_call_s), 2)
        info["matmul_ceiling_tflops"] = ceilings["matmul_bf16_tflops"]
    if "torch" not in _TIMES[key] and torch_call is not None:
        _TIMES[key]["torch"] = quick_time(torch_call)
        info["torch_time_source"] = "quick_time (torch case not run in this session)"
    if "torch" in _TIMES[key]:
        info["torch_us"] = round(_TIMES[key]["torch"] * 1e6, 3)
        info["speedup_vs_torch"] = round(_TIMES[key]["torch"] / per_call_s, 3)
    peers = {b: t for b, t in _TIMES[key].items() if b in PEERS and b != backend}
    if peers and backend not in PEERS:
        best = min(peers, key=peers.get)
        info["best_peer"] = best
        info["best_peer_us"] = round(peers[best] * 1e6, 3)
        info["speedup_vs_best_peer"] = round(peers[best] / per_call_s, 3)
    benchmark.extra_info.update(info)
    return dict(benchmark.extra_info)


def session_times() -> dict[CaseKey, dict[str, float]]:
    """Per-call seconds of every case timed so far (used for the summary table)."""
    return _TIMES


def summary_rows(data: dict) -> list[dict]:
    """One row per benchmark of a pytest-benchmark JSON, with the fields of the summary table."""
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "op" not in info:
            continue
        rows.append({
            "case": f"{info['op']} {info['shape']} {info['dtype']} {info['dir']}",
            "backend": info["backend"],
            "per_call_us": bench["stats"]["median"] * 1e6,
            "device_us": info.get("device_us"),
            "host_us": info.get("host_us"),
            "ceiling": info.get("fraction_of_copy_ceiling"),
            "vs_torch": info.get("speedup_vs_torch"),
            "vs_peer": info.get("speedup_vs_best_peer"),
            "err": info.get("max_rel_error"),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{'case':<34} {'backend':<13} {'per-call us':>11} {'device us':>9} {'host us':>8} "
             f"{'%copy':>6} {'x torch':>7} {'x peer':>6} {'rel err':>8}"]
    for r in rows:
        lines.append(
            f"{r['case']:<34} {r['backend']:<13} {r['per_call_us']:>11.2f} {num(r['device_us'], '9.2f')} "
            f"{num(r['host_us'], '8.2f')} {num(None if r['ceiling'] is None else 100 * r['ceiling'], '6.1f')} "
            f"{num(r['vs_torch'], '7.2f')} {num(r['vs_peer'], '6.2f')} {num(r['err'], '8.1e')}")
    return "\n".join(lines)


OURS = ("triton", "tilelang", "cuembed")


def case_table(data: dict) -> str:
    """Markdown, one row per (direction, op, shape, dtype): every backend's per-call us [device us], the best
    of ours as a fraction of the copy ceiling and against torch and the best peer, Triton/TileLang device."""
    cases: dict = {}
    for bench in data.get("benchmarks", []):
        e = bench.get("extra_info", {})
        if "op" not in e or "[" in e["op"]:  # tile-sweep variants have their own labels
            continue
        shape = e["shape"] + (f",dist={e['dist']}" if "dist" in e else "")
        cases.setdefault((e["dir"], e["op"], shape, e["dtype"]), {})[e["backend"]] = (
            bench["stats"]["median"] * 1e6, e.get("device_us"), e.get("fraction_of_copy_ceiling"))
    backends = [b for b in (*PEERS, *OURS) if any(b in by for by in cases.values())]
    lines = []
    for direction in sorted({k[0] for k in cases}, key=("fwd", "fwd+bwd").index):
        lines += [f"\n{direction}: per-call us [device us]\n",
                  "| op | shape | dtype | " + " | ".join(backends) + " | best ours % copy | vs torch | vs best peer | "
                  "triton/tilelang device |", "|---" * (len(backends) + 7) + "|"]
        for (dr, op, shape, dtype), by in cases.items():
            if dr != direction:
                continue
            cells = [f"{by[b][0]:.1f} [{by[b][1]:.1f}]" if b in by and by[b][1] is not None else "-" for b in backends]
            ours = {b: by[b] for b in OURS if b in by}
            peers = {b: by[b] for b in PEERS if b in by}
            best = min(ours, key=lambda b: ours[b][0]) if ours else None
            peer = min(peers, key=lambda b: peers[b][0]) if peers else None
            frac = f"{100 * ours[best][2]:.1f}% ({best})" if best and ours[best][2] is not None else "-"
            vs_torch = f"{by['torch'][0] / ours[best][0]:.2f}x" if best and "torch" in by else "-"
            vs_peer = f"{peers[peer][0] / ours[best][0]:.2f}x ({peer})" if best and peer else "-"
            ratio = (f"{ours['triton'][1] / ours['tilelang'][1]:.2f}" if {"triton", "tilelang"} <= ours.keys()
                     and ours["tilelang"][1] else "-")
            lines.append(f"| {op} | {shape} | {dtype} | " + " | ".join(cells) + f" | {frac} | {vs_torch} | {vs_peer} "
                         f"| {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m perf_tests.kernel_bench results.json [--by-case]
    with open(sys.argv[1]) as fh:
        loaded = json.load(fh)
    print(case_table(loaded) if "--by-case" in sys.argv[2:] else format_table(summary_rows(loaded)))
