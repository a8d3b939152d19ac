"""The CPU timer for pytest-benchmark (`bench_cpu`): calibrated CPU time.

On a shared machine CPU time is not immune to other jobs: a busy sibling hyperthread or a shared cache
makes the same work cost 10-20% more CPU time (notes/comparison.md). So every round is calibrated: a
fixed probe (sorting 1M float64, 8 MB) runs just before and just after it, and the round's CPU time is
scaled by PROBE_NOMINAL_S / (the probes' mean): what the round would cost on the machine's own footing.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

from pcvr_lib.timing.exclusive import ExclusiveRound

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
