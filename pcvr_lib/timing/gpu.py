"""The GPU timer for pytest-benchmark (`bench_gpu`).

Three numbers per GPU case, each measured so that it holds still (notes/comparison.md has the A/A data):
  device time   GPU work per call: one CUDA graph holding many calls, replayed with the GPU already busy
                (a spin kernel first) so host latency stays out; pytest-benchmark's `stats` hold it, so
                `--benchmark-compare-fail` and `pcvr diff` gate on it. Uncapturable calls: the profiler's
                kernel sum over many calls.
  host time     thread CPU time to issue one call: warmed, median over many small batches (`host_us`).
  per-call time what a user sees: back-to-back calls from an idle GPU, host work included (`per_call_us`);
                it moves with the host's load, so it is compared only by interleaved A/B (`pcvr compare`).
Host time and per-call time move by tens of percent between processes on a shared host; what gates a host
regression between stored runs is the case's counted work (`work`: Python calls, aten ops, host reads and
device launches per call, exact; pcvr_lib/timing/work.py), taken once after the timing.
L2 handling: pcvr_lib/timing/l2.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from pcvr_lib.timing.clocks import (
    CudaEventClock,
    ProfilerClock,
    estimate_seconds,
    median_event_seconds,
    start_lead_sleep,
)
from pcvr_lib.timing.host import HOST_SAMPLES, host_time
from pcvr_lib.timing.l2 import flush_l2, resolve_l2_mode
from pcvr_lib.timing.work import WORK_CALLS, count_work

GRAPH_SECONDS = 1e-3  # device time one replayed graph aims for
MAX_GRAPH_CALLS = 200
PER_CALL_ROUNDS = 10


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
              gated: bool = True, l2: str | None = None, host_samples: int = HOST_SAMPLES,
              work_calls: int = WORK_CALLS) -> dict:
    """Time `fn` for pytest-benchmark on the current CUDA device; returns the timing extra_info.

    `fn` is one call, or a sequence of the same call over distinct input copies that together exceed L2
    (then `l2` defaults to "rotate"; see `rotation_copies`). `l2`: "rotate", "flush" (default: a flush
    captured before every call, its time subtracted) or "warm" (the case says it runs from L2).
    `gated=False` marks a case informational (torch.compile peers recompile and autotune per process):
    `pcvr diff` reports it and never fails on it. `setup` runs before each round, outside the timing.
    `host_samples`: batches of calls behind host_us (fewer for calls of milliseconds, e.g. a model step).
    `work_calls`: calls whose work is counted one by one (timing.work; fewer for calls of milliseconds).

    Statistics: device seconds per call. extra_info: `device_us` (= the statistic's median),
    `device_time_method`, `host_us` (thread CPU per call), `host_wall_us`, `per_call_us`,
    `per_call_over_device`, `calls_per_graph`, `l2`, `gated`, `stat: "device"`, and for gated cases `work`
    (timing.work.count_work of one call, counted after the timing; {"error": ...} when counting failed).
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
            start_lead_sleep()  # the GPU is busy while the host enqueues: host latency stays out

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
    if gated:  # informational cases (torch.compile peers) are never gated, so never counted
        info["work"] = _counted_work(fns[0], work_calls)
    benchmark.extra_info.update(info)
    return info


def _counted_work(fn: Callable[[], object], calls: int) -> dict:
    """count_work of one call on the GPU; a failure to count is recorded (pcvr diff then names it and does not
    gate the case by counts), never a failed case: the case's times are measured already."""
    try:
        return count_work(fn, cuda=True, calls=calls)
    except Exception as exc:  # noqa: BLE001 - recorded in the case, shown by pcvr diff
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
