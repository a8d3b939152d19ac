"""CUDA clocks: event timing behind a lead sleep, pytest-benchmark timers driven by CUDA events or by the
profiler's kernel sum, and the warm-up that brings the GPU to its clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

LEAD_SLEEP_CYCLES = 1_000_000  # 0.5 ms at 2 GHz: longer than any host enqueue that follows


def start_lead_sleep() -> None:
    """Keep the GPU busy ~0.5 ms so the host enqueues what follows before the GPU reaches it."""
    import torch

    torch.cuda._sleep(LEAD_SLEEP_CYCLES)


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
            start_lead_sleep()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def estimate_seconds(fn: Callable[[], object], calls: int = 5) -> float:
    """Rough device seconds per call (back-to-back behind a lead sleep), to size graphs and rounds."""
    return median_event_seconds(lambda: [fn() for _ in range(calls)], reps=3, lead_sleep=True) / calls


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
    gaps included: counting them adds milliseconds to a training step)."""
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
