"""GPU and CPU timers for pytest-benchmark, byte/FLOP counts and ceilings, machine info.

GPU cases (`bench_gpu`): pytest-benchmark's statistics are device time per call (the number that holds
still between runs, so `--benchmark-compare-fail` and `pcvr diff` gate on it); host time and the per-call
time a user sees go to `extra_info`. CPU cases (`bench_cpu`): the statistics are CPU time. Which number
is which, and how each is gated: README "Reading the JSON".

Callers use the package (`from pcvr_lib import timing`, `timing.bench_gpu(...)`); its modules:
  gpu        bench_gpu: device time from CUDA graphs (or the profiler), per-call time, call counts
  clocks     CUDA-event and profiler timers, event timing behind a lead sleep, GPU warm-up
  host       host time of a call, the host-speed probe
  work       counted work per call (Python calls, aten ops, host reads, device launches): the host gate
  l2         L2 modes (rotate, flush, warm), the L2 flush
  ceilings   bytes, FLOPs, GB/s, TFLOP/s; measured copy and matmul ceilings and the check against them
  cpu        bench_cpu: calibrated CPU time
  exclusive  a CPU round that runs alone (`pcvr compare --side-by-side`)
  machine    library versions, the accelerator and its clocks for machine_info
"""

from pcvr_lib.timing.ceilings import (
    CEILING_SLACK,
    CeilingExceeded,
    check_ceiling,
    gbps,
    measure_ceilings,
    measured_ceilings,
    nbytes,
    tflops,
)
from pcvr_lib.timing.clocks import (
    LEAD_SLEEP_CYCLES,
    CudaEventClock,
    ProfilerClock,
    estimate_seconds,
    is_kernel_event,
    kernel_seconds,
    median_event_seconds,
    start_lead_sleep,
    warm_gpu,
)
from pcvr_lib.timing.cpu import PROBE_NOMINAL_S, CalibratedCpuClock, bench_cpu, probe_seconds
from pcvr_lib.timing.exclusive import EXCLUSIVE_ENV, ExclusiveRound
from pcvr_lib.timing.gpu import (
    GRAPH_SECONDS,
    MAX_GRAPH_CALLS,
    PER_CALL_ROUNDS,
    bench_gpu,
    choose_calls,
    per_call_seconds,
)
from pcvr_lib.timing.host import HOST_PROBE_CALL, HOST_SAMPLES, host_probe, host_seconds, host_time
from pcvr_lib.timing.l2 import DEFAULT_L2_BYTES, L2_FLUSH_BYTES, L2_MODES, flush_l2, resolve_l2_mode, rotation_copies
from pcvr_lib.timing.machine import update_machine_info
from pcvr_lib.timing.work import COUNTS, PYTHON_CALLS_SCOPE, count_work, device_launches, python_calls, torch_ops

__all__ = [
    "CEILING_SLACK", "COUNTS", "DEFAULT_L2_BYTES", "EXCLUSIVE_ENV", "GRAPH_SECONDS", "HOST_PROBE_CALL",
    "HOST_SAMPLES", "L2_FLUSH_BYTES", "L2_MODES", "LEAD_SLEEP_CYCLES", "MAX_GRAPH_CALLS", "PER_CALL_ROUNDS",
    "PROBE_NOMINAL_S", "PYTHON_CALLS_SCOPE", "CalibratedCpuClock", "CeilingExceeded", "CudaEventClock",
    "ExclusiveRound", "ProfilerClock", "bench_cpu", "bench_gpu", "check_ceiling", "choose_calls", "count_work",
    "device_launches", "estimate_seconds", "flush_l2", "gbps", "host_probe", "host_seconds", "host_time",
    "is_kernel_event", "kernel_seconds", "measure_ceilings", "measured_ceilings", "median_event_seconds", "nbytes",
    "per_call_seconds", "probe_seconds", "python_calls", "resolve_l2_mode", "rotation_copies", "start_lead_sleep",
    "tflops", "torch_ops", "update_machine_info", "warm_gpu",
]
