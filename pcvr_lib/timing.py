"""Timing support for the benchmarks: the GPU timer for pytest-benchmark, ceilings, machine info.

`bench_gpu(benchmark, fn)` makes pytest-benchmark's statistics the per-call time a user sees: each round
flushes L2 and waits for the GPU to go idle (setup, outside the timed region), then makes `calls`
back-to-back calls between two CUDA events; the statistic is the elapsed event time divided by `calls`.
Host work is included (the GPU starts idle, so a slow wrapper shows up), no CUDA graph is used.
Beside it, `extra_info` gets the device-only time (CUDA-graph replay of the same call, or the sum of
kernel times from the profiler when the call cannot be captured) and the host-only enqueue time, so a
slow host path can never hide behind a fast kernel.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable

L2_FLUSH_BYTES = 256 << 20  # several times the H200's 50 MB L2, as triton's do_bench uses


# ---------------------------------------------------------------- machine info


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken optional package is reported, not fatal
        return None


def _nvidia_smi(fields: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [part.strip() for part in out.strip().splitlines()[0].split(",")] if out.strip() else None


def update_machine_info(machine_info: dict) -> None:
    """Add library versions, the accelerator, its clocks and (when measured) the ceilings."""
    import torch

    machine_info["cpu_count"] = os.cpu_count()
    machine_info["libraries"] = {
        name: _version(name)
        for name in ("torch", "triton", "tilelang", "liger_kernel", "pyarrow", "numpy")
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
        smi = _nvidia_smi("driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit")
        if smi:
            keys = ("driver", "sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz",
                    "power_limit_w")
            gpu.update(dict(zip(keys, smi, strict=False)))
        machine_info["gpu"] = gpu
        if _CEILINGS:
            machine_info["ceilings"] = dict(next(iter(_CEILINGS.values())))
    else:
        machine_info["gpu"] = None


def assert_comparable(machine_info_a: dict, machine_info_b: dict) -> None:
    """Refuse (ValueError) to compare two runs measured on different accelerators.

    Only the device name counts: clocks and driver drift between runs of one machine type are noise the
    comparison threshold must absorb, not a reason to refuse.
    """
    def name(info: dict) -> str:
        gpu = (info or {}).get("gpu") or {}
        return gpu.get("name") or "no GPU"

    a, b = name(machine_info_a), name(machine_info_b)
    if a != b:
        raise ValueError(f"refusing to compare benchmark runs from different accelerators: {a!r} vs {b!r}")


# ---------------------------------------------------------------- bytes, FLOPs, rates


def nbytes(*tensors) -> int:
    """Bytes of the given tensors (each counted once, as one read or one write)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


# ---------------------------------------------------------------- ceilings

_CEILINGS: dict[str, dict] = {}


_LEAD_SLEEP_CYCLES = 1_000_000  # 0.5 ms at 2 GHz: longer than any host enqueue that follows


def _median_event_seconds(fn: Callable[[], None], reps: int, lead_sleep: bool = False) -> float:
    """Median event time of `fn`. With `lead_sleep`, the GPU spins first, so the host has enqueued the
    start event, `fn` and the end event before the GPU reaches them: host launch latency stays out."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_sleep:
            torch.cuda._sleep(_LEAD_SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_seconds(device) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return _median_event_seconds(lambda: dst.copy_(src), reps=20)


def _matmul_seconds(device, n: int) -> float:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    return _median_event_seconds(lambda: torch.matmul(a, b), reps=20)


def measure_ceilings(device=None) -> dict:
    """Device-to-device copy GB/s (bytes read + written) and bf16 8192^3 matmul TFLOP/s, once per session."""
    import torch

    device = torch.device(device if device is not None else "cuda")
    key = str(device)
    if key in _CEILINGS:
        return _CEILINGS[key]
    with torch.cuda.device(device):
        copy_s = _copy_seconds(device)
        n = 8192
        mm_s = _matmul_seconds(device, n)
        torch.cuda.empty_cache()
    _CEILINGS[key] = {
        "copy_gbps": round(gbps(2 * (1 << 30), copy_s), 1),
        "matmul_bf16_tflops": round(tflops(2 * n**3, mm_s), 1),
        "device": torch.cuda.get_device_name(device),
    }
    return _CEILINGS[key]


# ---------------------------------------------------------------- the timer


@functools.cache
def _flush_buffer(device_index: int):
    import torch

    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def flush_l2(device=None) -> None:
    """Overwrite a buffer several times the L2 size, evicting earlier data (asynchronous)."""
    import torch

    index = torch.device(device if device is not None else "cuda").index
    _flush_buffer(torch.cuda.current_device() if index is None else index).zero_()


class CudaEventClock:
    """A pytest-benchmark timer that advances by CUDA-event time divided by `calls`.

    pytest-benchmark calls the timer once before and once after the target; the first call records a
    start event, the second an end event, waits for it, and advances the clock by the elapsed time.
    """

    def __init__(self, calls: int = 1):
        self.calls = calls
        self.now = 0.0
        self._start = None

    def __call__(self) -> float:
        import torch

        if self._start is None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return self.now
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.now += self._start.elapsed_time(end) / 1e3 / self.calls
        self._start = None
        return self.now


def device_time_graph(fn: Callable[[], object], replays: int = 20, calls: int = 1) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph (launch gaps removed, no L2 flush)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per_replay = _median_event_seconds(graph.replay, reps=replays, lead_sleep=True)
    del graph
    return per_replay / calls


def device_time_profiler(fn: Callable[[], object], calls: int = 10) -> float:
    """Seconds per call of GPU kernel time summed from the torch profiler (for uncapturable calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total_us += evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
    return total_us / 1e6 / calls


def device_time(fn: Callable[[], object], graph: bool = True) -> tuple[float, str]:
    """(seconds per call of device work, method): CUDA-graph replay, else the profiler's kernel sum,
    else (profiler unavailable, e.g. under gVisor) event time over back-to-back calls."""
    import torch

    if graph:
        try:
            return device_time_graph(fn), "cuda_graph"
        except Exception:  # noqa: BLE001 - some calls cannot be captured; measure them another way
            torch.cuda.synchronize()
    try:
        seconds = device_time_profiler(fn)
        if seconds > 0:
            return seconds, "profiler_kernel_sum"
    except Exception:  # noqa: BLE001 - no CUPTI here
        torch.cuda.synchronize()
    calls = 20
    seconds = _median_event_seconds(lambda: [fn() for _ in range(calls)], reps=5, lead_sleep=True) / calls
    return seconds, "events_back_to_back"


def host_time(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host enqueue seconds per call, wall seconds per call until the GPU is done), back to back."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls, (t2 - t0) / calls


def do_bench_seconds(fn: Callable[[], object]) -> float | None:
    """triton.testing.do_bench's median (L2 flushed per call, events; how the peers were published)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return do_bench(fn, warmup=5, rep=25, return_mode="median") / 1e3


def choose_calls(device_seconds: float, round_seconds: float = 1e-3, max_calls: int = 100) -> int:
    """Back-to-back calls per round so one round lasts about `round_seconds` of device time."""
    if not device_seconds > 0 or math.isinf(device_seconds):
        return 1
    return max(1, min(max_calls, math.ceil(round_seconds / device_seconds)))


def bench_gpu(benchmark, fn: Callable[[], object], *, setup: Callable[[], None] | None = None,
              rounds: int = 30, warmup_rounds: int = 3, flush_l2_cache: bool = True,
              calls: int | None = None, graph: bool = True) -> dict:
    """Time `fn` for pytest-benchmark on the current CUDA device; returns the timing extra_info.

    Statistics: per-call seconds over `calls` back-to-back calls per round (chosen from the device time
    so a round is ~1 ms), L2 flushed and the GPU idle before each round. extra_info: `device_us`
    (see `device_time`), `per_call_us`
    (median of the statistic), `host_us` (enqueue only), `wall_us` (back-to-back wall time per call),
    `per_call_over_device`, `calls_per_round`, `timer`, `do_bench_us` (triton's do_bench median, the
    method behind the published peer numbers: its L2 flush hides host work shorter than the flush).
    """
    import torch

    fn()  # compile / autotune / first-touch outside everything
    torch.cuda.synchronize()
    device_s, device_method = device_time(fn, graph)
    n = calls or choose_calls(device_s)
    host_s, wall_s = host_time(fn, max(n, 10))
    do_bench_s = do_bench_seconds(fn)

    def round_setup():
        if setup is not None:
            setup()
        if flush_l2_cache:
            flush_l2()
        torch.cuda.synchronize()  # the round starts on an idle GPU: host work is inside the timing

    def target():
        for _ in range(n):
            fn()

    if benchmark.enabled:
        benchmark._timer = CudaEventClock(calls=n)
    benchmark.pedantic(target, setup=round_setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)

    per_call_s = benchmark.stats.stats.median if benchmark.enabled and benchmark.stats else float("nan")
    info = {
        "timer": "cuda_events_per_call",
        "calls_per_round": n,
        "l2_flushed": flush_l2_cache,
        "per_call_us": round(per_call_s * 1e6, 3),
        "device_us": round(device_s * 1e6, 3),
        "device_time_method": device_method,
        "host_us": round(host_s * 1e6, 3),
        "wall_us": round(wall_s * 1e6, 3),
        "per_call_over_device": round(per_call_s / device_s, 4) if device_s > 0 else None,
        "do_bench_us": None if do_bench_s is None else round(do_bench_s * 1e6, 3),
    }
    benchmark.extra_info.update(info)
    return info
