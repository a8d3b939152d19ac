"""Host time of a GPU case (the issuing thread's CPU time per call) and the host-speed probe every GPU
run stores in its machine_info."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pcvr_lib.timing.clocks import start_lead_sleep

HOST_SAMPLES = 25  # batches of calls whose thread CPU time gives host_us (median)


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
            start_lead_sleep()
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
    kept). `pcvr diff` prints it beside each group's host-time shift (pcvr_lib.compare.diff.shift_rows): one
    probe did not follow the host times of a whole run (20% faster while every group was 31-94% slower), so
    nothing is divided by it."""
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
