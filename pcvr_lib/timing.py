"""The one timer module: GPU and CPU timers for pytest-benchmark, ceilings, machine info.

GPU cases (`bench_gpu`): pytest-benchmark's statistics are device time per call (the number that holds
still between runs, so `--benchmark-compare-fail` and `pcvr diff` gate on it); host time and the per-call
time a user sees go to `extra_info`. CPU cases (`bench_cpu`): the statistics are CPU time. Which number
is which, and how each is gated: README "Reading the JSON".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

L2_FLUSH_BYTES = 128 << 20  # over twice the H200's 50 MB L2: every line is evicted


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
        machine_info["host_probe"] = host_probe()
        if _CEILINGS:
            machine_info["ceilings"] = dict(next(iter(_CEILINGS.values())))
    else:
        machine_info["gpu"] = None


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


def warm_gpu(fn: Callable[[], object], seconds: float) -> None:
    """Call `fn` (synchronising) for `seconds`: after compiles the GPU idles at a low clock (345 MHz reported on
    the H200 host), so the first timings of a sweep would rank candidates by clock ramp, not by speed."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        torch.cuda.synchronize()


def median_event_seconds(fn: Callable[[], None], reps: int, lead_sleep: bool = False) -> float:
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
    return median_event_seconds(lambda: dst.copy_(src), reps=20)


def _matmul_seconds(device, n: int) -> float:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    return median_event_seconds(lambda: torch.matmul(a, b), reps=20)


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
#
# Three numbers per GPU case, each measured so that it holds still (notes/comparison.md has the A/A data):
#   device time   GPU work per call: one CUDA graph holding many calls, replayed with the GPU already busy
#                 (a spin kernel first) so host latency stays out; pytest-benchmark's `stats` hold it, so
#                 `--benchmark-compare-fail` and `pcvr diff` gate on it. Uncapturable calls: the profiler's
#                 kernel sum over many calls.
#   host time     thread CPU time to issue one call: warmed, median over many small batches (`host_us`).
#   per-call time what a user sees: back-to-back calls from an idle GPU, host work included (`per_call_us`);
#                 it moves with the host's load, so it is compared only by interleaved A/B (`pcvr compare`).
#
# L2: the device number must not profit from data a previous call left in L2. A case either rotates its
# calls over input copies that together exceed L2 ("rotate"), has a flush captured before every call whose
# own time (a flush-only graph) is subtracted ("flush"), or says it runs warm ("warm").

L2_MODES = ("rotate", "flush", "warm")
DEFAULT_L2_BYTES = 50 << 20  # the H200's L2, used when the device does not report its own
GRAPH_SECONDS = 1e-3  # device time one replayed graph aims for
MAX_GRAPH_CALLS = 200
HOST_SAMPLES = 25  # batches of calls whose thread CPU time gives host_us (median)
PER_CALL_ROUNDS = 10
CEILING_SLACK = 1.02  # a copy-ceiling measurement is itself +-1%: beyond 2% over it a number is impossible


class CeilingExceeded(AssertionError):
    """A case reported more GB/s than the measured device copy ceiling: its timing is wrong, not fast."""


def check_ceiling(what: str, bytes_moved: float, seconds: float, ceiling_gbps: float) -> float:
    """GB/s of the case; raises CeilingExceeded when it exceeds the copy ceiling (warm L2, a wrong byte
    count, or a clock that misses work)."""
    if not seconds > 0:
        raise CeilingExceeded(f"{what}: device time {seconds!r} s is not positive: the timer missed the work")
    rate = gbps(bytes_moved, seconds)
    if ceiling_gbps and rate > ceiling_gbps * CEILING_SLACK:
        raise CeilingExceeded(
            f"{what}: {rate:,.0f} GB/s from {bytes_moved:,} bytes in {seconds * 1e6:.2f} us exceeds the measured "
            f"copy ceiling {ceiling_gbps:,.0f} GB/s: the case runs from L2 or its byte count is wrong")
    return rate


def resolve_l2_mode(l2: str | None, flush_l2_cache: bool, rotations: int) -> str:
    """The case's L2 handling: explicit `l2`, else "rotate" when several input copies are given, else
    "flush" (or "warm" when the caller turned flushing off)."""
    if l2 is None:
        l2 = "rotate" if rotations > 1 else ("flush" if flush_l2_cache else "warm")
    if l2 not in L2_MODES:
        raise ValueError(f"l2={l2!r}: expected one of {', '.join(L2_MODES)}")
    if l2 == "rotate" and rotations < 2:
        raise ValueError("l2='rotate' needs a sequence of calls over distinct input copies (got one call)")
    return l2


def rotation_copies(bytes_per_call: int, l2: int = DEFAULT_L2_BYTES) -> int:
    """Input copies a case must rotate over so that one cycle touches at least twice the L2."""
    return max(2, math.ceil(2 * l2 / max(1, bytes_per_call)))


@functools.cache
def _flush_buffer(device_index: int, size: int = L2_FLUSH_BYTES):
    import torch

    return torch.empty(size, dtype=torch.uint8, device=f"cuda:{device_index}")


def flush_l2(device=None, size: int = L2_FLUSH_BYTES) -> None:
    """Overwrite a buffer larger than L2, evicting earlier data (asynchronous)."""
    import torch

    index = torch.device(device if device is not None else "cuda").index
    _flush_buffer(torch.cuda.current_device() if index is None else index, size).zero_()


def _lead_sleep() -> None:
    """Keep the GPU busy ~0.5 ms so the host enqueues what follows before the GPU reaches it."""
    import torch

    torch.cuda._sleep(_LEAD_SLEEP_CYCLES)


class CudaEventClock:
    """A pytest-benchmark timer that advances by (CUDA-event time - `offset_s`) / `calls`.

    pytest-benchmark calls the timer once before and once after the target: the first call records a
    start event, the second an end event, waits for it and advances the clock. `offset_s` removes work
    inside the timed region that is not the case's (the captured L2 flushes).
    """

    def __init__(self, calls: int = 1, offset_s: float = 0.0):
        self.calls = calls
        self.offset_s = offset_s
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
        self.now += max(0.0, self._start.elapsed_time(end) / 1e3 - self.offset_s) / self.calls
        self._start = None
        return self.now


def kernel_seconds(events, exclude: frozenset[str] = frozenset()) -> float:
    """Sum of the device (CUDA) kernel times of profiler events, leaving out kernels named in `exclude` and
    GPU-side user annotations (e.g. "Optimizer.step#AdamW.step": a range over kernels already counted, idle
    gaps included; tools/profile_models.py's first version counted them: +0.4-6.8 ms per training step)."""
    total_us = 0.0
    for evt in events:
        if is_kernel_event(evt) and evt.name not in exclude:
            total_us += evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
    return total_us / 1e6


def is_kernel_event(evt) -> bool:
    """A profiler event that is a device kernel (not a CPU op, not a GPU-side user annotation)."""
    import torch

    return evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)


class ProfilerClock:
    """A pytest-benchmark timer for calls a CUDA graph cannot hold: advances by the profiler's kernel sum
    of the target divided by `calls` (kernels named in `exclude`, the L2 flushes, left out)."""

    def __init__(self, calls: int = 1, exclude: frozenset[str] = frozenset()):
        self.calls = calls
        self.exclude = exclude
        self.now = 0.0
        self._prof = None

    def __call__(self) -> float:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._prof is None:
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
            return self.now
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.now += kernel_seconds(self._prof.events(), self.exclude) / self.calls
        self._prof = None
        return self.now


def _cycle(fns: list[Callable[[], object]], n: int, flush: Callable[[], None] | None) -> Callable[[], None]:
    def run():
        for i in range(n):
            if flush is not None:
                flush()
            fns[i % len(fns)]()
    return run


def _capture(run: Callable[[], None]):
    """A CUDA graph of `run` (warmed on a side stream first, as capture requires)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _flush_kernel_names() -> frozenset[str]:
    """Names of the kernels `flush_l2` launches (left out of profiler kernel sums)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush_l2()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush_l2()
        torch.cuda.synchronize()
    return frozenset(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def estimate_seconds(fn: Callable[[], object], calls: int = 5) -> float:
    """Rough device seconds per call (back-to-back behind a lead sleep), to size graphs and rounds."""
    return median_event_seconds(lambda: [fn() for _ in range(calls)], reps=3, lead_sleep=True) / calls


def host_seconds(fn: Callable[[], object], calls: int, samples: int = HOST_SAMPLES,
                 clock: Callable[[], float] = time.thread_time,
                 sync: Callable[[], None] | None = None) -> float:
    """Median over `samples` batches of `calls` calls of the issuing thread's CPU time per call.

    Each batch starts behind a lead sleep (the GPU is busy, so a launch never waits on a full queue) and
    ends with a synchronize outside the timing; thread CPU time leaves out time the thread was preempted by
    other processes, which wall time on a shared host would add."""
    per_call = []
    for _ in range(samples):
        if sync is not None:
            _lead_sleep()
        t0 = clock()
        for _ in range(calls):
            fn()
        per_call.append((clock() - t0) / calls)
        if sync is not None:
            sync()
    return statistics.median(per_call)


def host_time(fn: Callable[[], object], calls: int, samples: int = HOST_SAMPLES) -> tuple[float, float]:
    """(host thread-CPU seconds per call, wall seconds per call until the GPU is done), warmed."""
    import torch

    fn()
    torch.cuda.synchronize()
    host_s = host_seconds(fn, calls, samples=samples, sync=torch.cuda.synchronize)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return host_s, (time.perf_counter() - t0) / calls


HOST_PROBE_CALL = "torch.add(a, a, out=c), 1024 float32 elements on the GPU"


def host_probe(repeats: int = 3) -> dict:
    """The host's speed, stored in every GPU run's machine_info: the thread CPU time to issue one fixed small
    torch call, measured like host_us (warmed, median over HOST_SAMPLES batches), `repeats` times (median
    kept). `pcvr diff` divides host-time ratios by the probe ratio of the two runs (compare.host_factors)."""
    import torch

    a = torch.ones(1024, device="cuda")
    c = torch.empty_like(a)

    def call():
        torch.add(a, a, out=c)

    for _ in range(200):  # warm the dispatcher and the allocator's cache
        call()
    samples = [host_time(call, 20)[0] * 1e6 for _ in range(repeats)]
    return {"us": round(statistics.median(samples), 3), "samples_us": [round(x, 3) for x in samples],
            "call": HOST_PROBE_CALL}


def per_call_seconds(fn: Callable[[], object], calls: int, rounds: int = PER_CALL_ROUNDS,
                     flush: bool = True) -> float:
    """What a user sees: median over rounds of event time / calls of back-to-back calls started on an idle
    GPU (L2 flushed first unless warm), host work included."""
    import torch

    samples = []
    for _ in range(rounds):
        if flush:
            flush_l2()
        torch.cuda.synchronize()
        clock = CudaEventClock(calls)
        t0 = clock()
        for _ in range(calls):
            fn()
        samples.append(clock() - t0)
    return statistics.median(samples)


def choose_calls(device_seconds: float, round_seconds: float = 1e-3, max_calls: int = 100) -> int:
    """Back-to-back calls per round so one round lasts about `round_seconds` of device time."""
    if not device_seconds > 0 or math.isinf(device_seconds):
        return 1
    return max(1, min(max_calls, math.ceil(round_seconds / device_seconds)))


def bench_gpu(benchmark, fn: Callable[[], object] | Sequence[Callable[[], object]], *,
              setup: Callable[[], None] | None = None, rounds: int = 30, warmup_rounds: int = 3,
              flush_l2_cache: bool = True, calls: int | None = None, graph: bool = True,
              gated: bool = True, l2: str | None = None, host_samples: int = HOST_SAMPLES) -> dict:
    """Time `fn` for pytest-benchmark on the current CUDA device; returns the timing extra_info.

    `fn` is one call, or a sequence of the same call over distinct input copies that together exceed L2
    (then `l2` defaults to "rotate"; see `rotation_copies`). `l2`: "rotate", "flush" (default: a flush
    captured before every call, its time subtracted) or "warm" (the case says it runs from L2).
    `gated=False` marks a case informational (torch.compile peers recompile and autotune per process):
    `pcvr diff` reports it and never fails on it. `setup` runs before each round, outside the timing.
    `host_samples`: batches of calls behind host_us (fewer for calls of milliseconds, e.g. a model step).

    Statistics: device seconds per call. extra_info: `device_us` (= the statistic's median),
    `device_time_method`, `host_us` (thread CPU per call), `host_wall_us`, `per_call_us`,
    `per_call_over_device`, `calls_per_graph`, `l2`, `gated`, `stat: "device"`.
    """
    import torch

    fns = list(fn) if isinstance(fn, Sequence) else [fn]
    mode = resolve_l2_mode(l2, flush_l2_cache, len(fns))
    for f in fns:  # compile / autotune / first-touch outside everything
        f()
    torch.cuda.synchronize()
    flush = flush_l2 if mode == "flush" else None
    estimate = estimate_seconds(fns[0])
    flush_s = estimate_seconds(flush_l2) if flush else 0.0
    n = calls or choose_calls(estimate + flush_s, GRAPH_SECONDS, MAX_GRAPH_CALLS)
    if mode == "rotate":
        n = max(n, len(fns))  # every copy once per graph, or the cycle would not leave L2

    method, target, offset_s, exclude = "cuda_graph", None, 0.0, frozenset()
    if graph:
        try:
            g = _capture(_cycle(fns, n, flush))
            target = g.replay
            if flush:
                flushes = _capture(lambda: [flush_l2() for _ in range(n)])
                offset_s = median_event_seconds(flushes.replay, reps=10, lead_sleep=True)
        except Exception:  # noqa: BLE001 - some calls cannot be captured; the profiler measures them
            torch.cuda.synchronize()
            target = None
    if target is None:
        method = "profiler_kernel_sum"
        target = _cycle(fns, n, flush)
        exclude = _flush_kernel_names() if flush else frozenset()
        rounds = min(rounds, 10)  # a profiler session per round costs milliseconds of host time

    def round_setup():
        if setup is not None:
            setup()
        if method == "cuda_graph":
            _lead_sleep()  # the GPU is busy while the host enqueues: host latency stays out

    if benchmark.enabled:
        benchmark._timer = (CudaEventClock(n, offset_s) if method == "cuda_graph" else ProfilerClock(n, exclude))
    benchmark.pedantic(target, setup=round_setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    info = {"stat": "device", "device_time_method": method, "calls_per_graph": n, "l2": mode,
            "rotations": len(fns), "gated": gated}
    if not (benchmark.enabled and benchmark.stats):  # --benchmark-disable: the case ran once, untimed
        benchmark.extra_info.update(info)
        return info
    device_s = benchmark.stats.stats.median

    host_s, wall_s = host_time(fns[0], max(min(n, 20), 3), host_samples)
    per_call_s = per_call_seconds(fns[0], choose_calls(estimate), flush=mode != "warm")
    info.update({
        "timer": f"{method}: {n} calls per {'graph' if method == 'cuda_graph' else 'round'}",
        "device_us": round(device_s * 1e6, 3),
        "flush_us_subtracted": round(offset_s / n * 1e6, 3) if offset_s else 0.0,
        "host_us": round(host_s * 1e6, 3),
        "host_wall_us": round(wall_s * 1e6, 3),
        "per_call_us": round(per_call_s * 1e6, 3),
        "per_call_over_device": round(per_call_s / device_s, 4) if device_s > 0 else None,
    })
    benchmark.extra_info.update(info)
    return info


# ---------------------------------------------------------------- CPU cases
#
# On a shared machine CPU time is not immune to other jobs: a busy sibling hyperthread or a shared cache
# makes the same work cost 10-20% more CPU time (notes/comparison.md). So every round is calibrated: a
# fixed probe (sorting 1M float64, 8 MB) runs just before and just after it, and the round's CPU time is
# scaled by PROBE_NOMINAL_S / (the probes' mean): what the round would cost on the machine's own footing.

PROBE_NOMINAL_S = 0.006  # the probe's CPU time the statistics are scaled to (the 2-core Xeon's, warm)


@functools.cache
def _probe_data():
    import numpy as np

    data = np.random.default_rng(0).random(1 << 20)
    return data, np.empty_like(data)


def probe_seconds(clock: Callable[[], float] = time.thread_time) -> float:
    """CPU seconds of the calibration probe: copy a fixed 1M-element float64 array into a preallocated
    buffer and sort it there (no allocation, so no page faults in the measurement)."""
    data, buf = _probe_data()
    t0 = clock()
    buf[:] = data
    buf.sort()
    return clock() - t0


# Side by side (`pcvr compare --side-by-side`): the base and the candidate run as two processes at once, and
# each timed CPU round (its probes included) runs alone: it takes a lock shared by the two and stops the
# other process (SIGSTOP) until the round is over. So the two sides' rounds interleave within seconds and
# see the same load from other jobs, while neither ever shares the cores with the other's work.
EXCLUSIVE_ENV = "PCVR_EXCLUSIVE_DIR"  # a folder holding `lock` and `pids` (the processes of the pair)


class ExclusiveRound:
    """Context manager: with `PCVR_EXCLUSIVE_DIR` set, hold its lock and keep the other processes named in
    its `pids` file stopped for the duration; without it, nothing."""

    def __init__(self, folder: str | None = None):
        self.folder = folder if folder is not None else os.environ.get(EXCLUSIVE_ENV) or None
        self._fd: int | None = None
        self._stopped: list[int] = []

    @property
    def active(self) -> bool:
        return self.folder is not None

    def peers(self) -> list[int]:
        try:
            text = open(os.path.join(self.folder, "pids")).read()
        except FileNotFoundError:  # the other side is not started yet
            return []
        return [int(p) for p in text.split() if int(p) != os.getpid()]

    def __enter__(self):
        if not self.active:
            return self
        import fcntl
        import signal

        self._fd = os.open(os.path.join(self.folder, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        for pid in self.peers():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # already finished
                continue
            self._stopped.append(pid)
            _wait_stopped(pid)
        return self

    def __exit__(self, *exc):
        if self._fd is None:
            return
        import fcntl
        import signal

        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped = []
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until /proc says `pid` is stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0005)


class CalibratedCpuClock:
    """A pytest-benchmark timer advancing by the round's CPU time x PROBE_NOMINAL_S / the mean of the probes
    run just before and just after the round (outside the timed interval). `raw` and `probes` keep what
    was measured. Under `pcvr compare --side-by-side` each round with its probes runs alone
    (`ExclusiveRound`)."""

    def __init__(self, clock: Callable[[], float] = time.process_time,
                 probe: Callable[[], float] = probe_seconds, nominal_s: float = PROBE_NOMINAL_S,
                 exclusive: ExclusiveRound | None = None):
        self.clock, self.probe, self.nominal_s = clock, probe, nominal_s
        self.exclusive = exclusive if exclusive is not None else ExclusiveRound()
        probe()  # first touch of the probe's buffers stays out of the calibration
        self.now = 0.0
        self.raw: list[float] = []
        self.probes: list[float] = []
        self._start = None
        self._before = 0.0

    def __call__(self) -> float:
        if self._start is None:
            self.exclusive.__enter__()
            self._before = self.probe()
            self._start = self.clock()
            return self.now
        spent = self.clock() - self._start
        after = self.probe()
        self.exclusive.__exit__(None, None, None)
        self._start = None
        self.raw.append(spent)
        self.probes += [self._before, after]
        self.now += spent * self.nominal_s / ((self._before + after) / 2)
        return self.now


def bench_cpu(benchmark, fn: Callable[[], object], *, setup=None, rounds: int = 5, warmup_rounds: int = 1,
              clock: Callable[[], float] = time.process_time, gated: bool = True,
              probe: Callable[[], float] = probe_seconds):
    """pytest-benchmark with calibrated CPU time as the statistic (`CalibratedCpuClock`; default clock: the
    process's CPU time, which covers reader threads; `time.thread_time` for one-thread work). Raw CPU
    seconds (`cpu_raw_min_s`), the probe's seconds and wall seconds go to extra_info. Returns fn's result."""
    walls: list[float] = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            walls.append(time.perf_counter() - t0)

    timer = CalibratedCpuClock(clock, probe)
    if benchmark.enabled:
        benchmark._timer = timer
    try:
        result = benchmark.pedantic(timed, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    finally:  # a round that raised never reached the timer's second call: release the other side
        timer.exclusive.__exit__(None, None, None)
    clock_name = {time.process_time: "process_time", time.thread_time: "thread_time"}.get(clock, repr(clock))
    benchmark.extra_info.update({
        "stat": "cpu",
        "timer": f"{clock_name} x {PROBE_NOMINAL_S} s / calibration probe",
        "gated": gated,
        "wall_s": statistics.median(walls[warmup_rounds:] or walls),
    })
    if timer.raw:
        benchmark.extra_info.update({
            "cpu_raw_min_s": min(timer.raw[warmup_rounds:] or timer.raw),
            "probe_median_s": statistics.median(timer.probes),
            # every timed round, for the interleaved comparison's statistic (warm-up rounds left out)
            "cpu_raw_rounds_s": [round(x, 7) for x in timer.raw[warmup_rounds:] or timer.raw],
            "probe_rounds_s": [round(x, 7) for x in timer.probes[2 * warmup_rounds:] or timer.probes],
            "exclusive_rounds": timer.exclusive.active,
        })
    return result
