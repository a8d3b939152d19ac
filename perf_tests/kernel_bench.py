"""Shared case runner for the kernel benchmarks (norms, embedding bag, attention).

Every case: skip with the dispatcher's (or the peers table's) reason when the backend cannot run here; check the result
against the fp64 reference FIRST (a mismatch fails the case, nothing is timed); time with
`pcvr_lib.timing.bench_gpu`; fill `extra_info` with bytes, GB/s, fraction of the measured copy ceiling,
speedup vs torch eager measured in the same run, speedup vs the best peer measured in the same run,
max errors and compile seconds, what the call returns (part of the workload's fingerprint) and the sources it
runs (`pcvr_lib.sources`: a peer's are a library's, ours are digested).

Speedups need the baselines' times: parametrize so that "torch" comes first and the other peers
(perf_tests/peers.py) before our backends. When torch eager has not run yet for a case key (e.g.
`-k triton`), the runner times it itself with the same timer, untouched by pytest-benchmark.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pcvr_lib import sources, timing
from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.tolerance import DTYPE_NAMES
from perf_tests import peers

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
    if backend in dispatch.op_backends(op):
        ok, reason = dispatch.backend_status(op, backend, "cuda")
    elif peers.is_peer(backend):
        ok, reason = peers.status(backend, "cuda")
    else:
        raise ValueError(f"{op}: {backend!r} is neither a backend of ours ({', '.join(dispatch.op_backends(op))}) "
                         f"nor a peer ({', '.join(peers.PEERS)})")
    if not ok:
        pytest.skip(reason)
    return torch.device("cuda")


def quick_time(fn: Callable[[], object]) -> float:
    """Per-call seconds with bench_gpu's method, outside pytest-benchmark (for a missing baseline)."""
    fn()
    torch.cuda.synchronize()
    return timing.per_call_seconds(fn, timing.choose_calls(timing.estimate_seconds(fn)))


def timed_first_call(fn: Callable[[], object]) -> tuple[object, float]:
    """Run `fn` once, returning (result, seconds incl. any compilation) after synchronising."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run_case(benchmark, *, key: CaseKey, backend: str, call: Callable[[], object],
             check: Callable[[], tuple[float, float]], bytes_moved: int, returns: str, flops: int | None = None,
             compile_s: float | None = None, torch_call: Callable[[], object] | None = None,
             rounds: int = 30, graph: bool = True) -> dict:
    """Check, then time one case; returns the extra_info it recorded.

    `check()` runs the backend on fresh (poisoned) outputs and asserts them against the fp64 reference,
    returning (max abs error, max rel error); it raises on a mismatch, which fails the case untimed.
    `torch_call` times torch eager for the same key when that case has not run in this session.
    `returns` says what `call` returns (e.g. "out, dq, dk, dv"): two calls that return different things are
    different workloads, so it is part of the fingerprint (pcvr_lib.compare.WORKLOAD_KEYS).
    """
    benchmark.group = f"{key.op} {key.shape} {key.dtype} {key.direction}"
    benchmark.extra_info.update({"op": key.op, "backend": backend, "shape": key.shape, "dtype": key.dtype,
                                 "dir": key.direction, "returns": returns,
                                 **sources.stamp(sources.kernel_subject(key.op, backend, not peers.is_peer(backend)))})
    max_abs, max_rel = check()
    benchmark.extra_info.update({"max_abs_error": max_abs, "max_rel_error": max_rel})

    timing_info = timing.bench_gpu(benchmark, call, rounds=rounds, graph=graph, gated=peers.gated(backend))
    if not benchmark.enabled:
        return dict(benchmark.extra_info)
    per_call_s = timing_info["per_call_us"] / 1e6

    _TIMES.setdefault(key, {})[backend] = per_call_s
    ceilings = timing.measure_ceilings()
    # a rate above the copy ceiling is a measuring error (warm L2, wrong byte count): the case fails
    device_gbps = timing.check_ceiling(key.case_id(backend), bytes_moved, timing_info["device_us"] / 1e6,
                                       ceilings["copy_gbps"])
    info = {
        "bytes": bytes_moved,
        "gbps": round(timing.gbps(bytes_moved, per_call_s), 1),
        "device_gbps": round(device_gbps, 1),
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
    peer_times = {b: t for b, t in _TIMES[key].items() if peers.is_peer(b) and b != backend}
    if peer_times and not peers.is_peer(backend):
        best = min(peer_times, key=peer_times.get)
        info["best_peer"] = best
        info["best_peer_us"] = round(peer_times[best] * 1e6, 3)
        info["speedup_vs_best_peer"] = round(peer_times[best] / per_call_s, 3)
    benchmark.extra_info.update(info)
    return dict(benchmark.extra_info)


def session_times() -> dict[CaseKey, dict[str, float]]:
    """Per-call seconds of every case timed so far (used for the summary table)."""
    return _TIMES
