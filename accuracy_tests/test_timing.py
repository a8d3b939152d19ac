"""The benchmark timer and its helpers: pure logic on CPU, the known-duration check on the GPU."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch

from pcvr_lib import timing
from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.tolerance import assert_close, max_errors


def test_choose_calls_targets_about_a_millisecond_per_round():
    assert timing.choose_calls(1e-3) == 1
    assert timing.choose_calls(2e-3) == 1
    assert timing.choose_calls(1e-4) == 10
    assert timing.choose_calls(1e-7) == 100  # capped
    assert timing.choose_calls(0.0) == 1
    assert timing.choose_calls(float("nan")) == 1


def test_rates_and_bytes():
    t = torch.empty(1000, dtype=torch.float16)
    assert timing.nbytes(t, t) == 4000
    assert timing.gbps(2e9, 1.0) == pytest.approx(2.0)
    assert timing.tflops(3e12, 1.5) == pytest.approx(2.0)


def test_update_machine_info_lists_versions():
    info: dict = {}
    timing.update_machine_info(info)
    assert info["libraries"]["torch"] == torch.__version__
    assert "triton" in info["libraries"] and "tilelang" in info["libraries"]
    if not torch.cuda.is_available():
        assert info["gpu"] is None
    else:  # every GPU run records the host's speed (pcvr diff prints it beside the host shifts)
        probe = info["host_probe"]
        assert 0.5 < probe["us"] < 1000 and len(probe["samples_us"]) == 3 and probe["call"] == timing.HOST_PROBE_CALL


def test_exclusive_round_stops_the_other_process_for_its_duration(tmp_path, monkeypatch):
    """`pcvr compare --side-by-side`: a timed CPU round holds the pair's lock and keeps the other process
    stopped; afterwards it runs again. Without PCVR_EXCLUSIVE_DIR nothing happens."""
    import subprocess
    import sys

    def state(pid):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        (tmp_path / "pids").write_text(f"{other.pid} {os.getpid()}")
        with timing.ExclusiveRound(str(tmp_path)) as round_:
            assert round_.active and state(other.pid) == "T"
        deadline = time.time() + 5
        while state(other.pid) == "T" and time.time() < deadline:
            time.sleep(0.01)
        assert state(other.pid) not in ("T", "t")  # running again (R, S, or D while its pages come back)
        monkeypatch.delenv(timing.EXCLUSIVE_ENV, raising=False)
        assert not timing.ExclusiveRound().active
        monkeypatch.setenv(timing.EXCLUSIVE_ENV, str(tmp_path))
        assert timing.ExclusiveRound().active
    finally:
        other.kill()
        other.wait()


class _FakeEvents:
    """Stands in for torch.cuda.Event: elapsed times are scripted."""

    durations_ms = [2.0, 4.0]

    def __init__(self, enable_timing=True):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, _end):
        return _FakeEvents.durations_ms.pop(0)


def test_event_clock_divides_elapsed_time_by_calls(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvents)
    _FakeEvents.durations_ms = [2.0, 4.0, 3.0]
    clock = timing.CudaEventClock(calls=4)
    start = clock()
    end = clock()
    assert end - start == pytest.approx(0.5e-3)  # 2 ms over 4 calls
    start = clock()
    assert clock() - start == pytest.approx(1e-3)
    # the captured L2 flushes' time (offset) is removed before dividing
    clock = timing.CudaEventClock(calls=10, offset_s=1e-3)
    start = clock()
    assert clock() - start == pytest.approx(0.2e-3)


class _FakeProfilerEvent:
    def __init__(self, name, us, device_type, is_user_annotation=False):
        self.name, self.device_time, self.device_type = name, us, device_type
        self.is_user_annotation = is_user_annotation


def test_kernel_seconds_sums_device_kernels_and_leaves_out_the_flush():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [_FakeProfilerEvent("rms_fwd", 4.0, cuda), _FakeProfilerEvent("fill_kernel", 30.0, cuda),
              _FakeProfilerEvent("rms_fwd", 4.5, cuda), _FakeProfilerEvent("aten::add", 9.0, cpu)]
    assert timing.kernel_seconds(events) == pytest.approx(38.5e-6)
    assert timing.kernel_seconds(events, exclude=frozenset({"fill_kernel"})) == pytest.approx(8.5e-6)
    # a GPU-side range around kernels (the optimizer's step annotation) is not a kernel
    annotated = [*events, _FakeProfilerEvent("Optimizer.step#AdamW.step", 400.0, cuda, is_user_annotation=True)]
    assert timing.kernel_seconds(annotated) == pytest.approx(38.5e-6)


def test_host_seconds_is_the_median_per_call_of_many_batches():
    ticks = iter([0.0, 1.0, 1.0, 1.2, 2.0, 2.3, 3.0, 9.0, 10.0, 10.2])  # batches of 10 calls: 1.0 0.2 0.3 6 0.2
    calls = []
    host = timing.host_seconds(lambda: calls.append(1), calls=10, samples=5, clock=lambda: next(ticks))
    assert host == pytest.approx(0.03)  # median 0.3 s per batch / 10 calls: the 6 s outlier does not count
    assert len(calls) == 50


def test_l2_modes_and_rotation_copies():
    assert timing.resolve_l2_mode(None, True, 1) == "flush"
    assert timing.resolve_l2_mode(None, False, 1) == "warm"
    assert timing.resolve_l2_mode(None, True, 8) == "rotate"
    assert timing.resolve_l2_mode("warm", True, 1) == "warm"
    with pytest.raises(ValueError, match="needs a sequence of calls"):
        timing.resolve_l2_mode("rotate", True, 1)
    with pytest.raises(ValueError, match="l2='cold'"):
        timing.resolve_l2_mode("cold", True, 1)
    assert timing.rotation_copies(4 << 20, l2=50 << 20) == 25  # 25 x 4 MB = 100 MB = twice the L2
    assert timing.rotation_copies(1 << 30, l2=50 << 20) == 2


def test_a_rate_above_the_copy_ceiling_is_an_error():
    assert timing.check_ceiling("case", 4e9, 1e-3, 4800.0) == pytest.approx(4000.0)
    assert timing.check_ceiling("case", 4.85e9, 1e-3, 4800.0) == pytest.approx(4850.0)  # within the slack
    with pytest.raises(timing.CeilingExceeded, match="op=x.*5,760 GB/s.*exceeds the measured copy ceiling 4,800"):
        timing.check_ceiling("op=x", 5.76e9, 1e-3, 4800.0)


class _FakeBenchmark:
    """The pytest-benchmark fixture surface the timers use: pedantic reads `_timer` around the target."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.extra_info: dict = {}
        self._timer = None
        self.samples: list[float] = []

    def pedantic(self, target, setup=None, rounds=1, warmup_rounds=0, iterations=1):
        result = None
        for i in range(warmup_rounds + rounds):
            args, kwargs = (setup() or ((), {})) if setup else ((), {})
            t0 = self._timer()
            result = target(*args, **kwargs)
            elapsed = self._timer() - t0
            if i >= warmup_rounds:
                self.samples.append(elapsed)
        self.samples.sort()
        median = self.samples[len(self.samples) // 2]
        self.stats = type("S", (), {"stats": type("T", (), {"median": median})})
        return result


def test_bench_cpu_puts_cpu_time_into_the_statistics():
    cpu = iter([0.0, 0.5, 1.0, 1.2, 2.0, 2.3])  # 0.5, 0.2, 0.3 s of CPU time per round
    bench = _FakeBenchmark()
    probes = iter([0.006] + [0.006, 0.006, 0.012, 0.012, 0.003, 0.003])  # warm-up, then before/after each round
    out = timing.bench_cpu(bench, lambda: "done", rounds=3, warmup_rounds=0, clock=lambda: next(cpu),
                           probe=lambda: next(probes))
    assert out == "done"
    # each round's CPU time scaled by nominal / probe: 0.5 x 1; 0.2 x 0.5 (the probe took twice as long: a
    # busy machine); 0.3 x 2 (the probe ran twice as fast)
    assert sorted(bench.samples) == pytest.approx([0.1, 0.5, 0.6])
    assert bench.stats.stats.median == pytest.approx(0.5)
    assert bench.extra_info["stat"] == "cpu" and bench.extra_info["gated"] is True
    assert bench.extra_info["cpu_raw_min_s"] == pytest.approx(0.2) and bench.extra_info["probe_median_s"] == 0.006
    assert bench.extra_info["wall_s"] >= 0


def test_bench_cpu_passes_setup_arguments():
    bench = _FakeBenchmark()
    seen = []
    timing.bench_cpu(bench, lambda x: seen.append(x), setup=lambda: ((7,), {}), rounds=2, clock=time.thread_time)
    assert seen == [7, 7, 7]  # one warm-up round and two timed
    assert bench.extra_info["timer"].startswith("thread_time x 0.006 s / calibration probe")


def test_tolerance_nan_never_passes():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="NaN pattern"):
        assert_close(torch.tensor([1.0, float("nan"), 3.0]), ref, torch.float32)
    nan_ref = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert_close(torch.tensor([1.0, float("nan")]), nan_ref, torch.float32)  # NaN where the reference is NaN
    with pytest.raises(AssertionError, match="NaN pattern"):
        assert_close(torch.tensor([1.0, 0.0]), nan_ref, torch.float32)
    with pytest.raises(AssertionError, match="infinities"):
        assert_close(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, -float("inf")]).double(),
                     torch.float32)
    assert max_errors(torch.tensor([1.0, float("nan")]), ref[:2])[0] != max_errors(ref[:2], ref[:2])[0]


def test_tolerance_table_by_dtype():
    ref = torch.linspace(-2, 2, 101, dtype=torch.float64)
    assert_close(ref.to(torch.bfloat16), ref, torch.bfloat16)  # one rounding passes
    assert_close(ref.to(torch.float16), ref, torch.float16)
    off = (ref * 1.006).float()  # 0.6% off: fine for bf16, not for fp16
    assert_close(off, ref, torch.bfloat16)
    with pytest.raises(AssertionError, match="outside"):
        assert_close(off, ref, torch.float16)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close((ref * 1.001).float(), ref, torch.float32)
    assert max_errors(ref.float() + 0.5, ref) == pytest.approx((0.5, 0.25))


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*known backends: torch, triton"):
        dispatch.validate_backend("rms_norm", "cuda")
    with pytest.raises(ValueError, match="unknown operator"):
        dispatch.backend_status("no_such_op", "torch")
    with pytest.raises(RuntimeError, match="rms_norm requires CUDA tensors"):
        dispatch.check_inputs("rms_norm", torch.ones(2), backend="tilelang")
    with pytest.raises(TypeError, match="share one dtype"):
        dispatch.check_inputs("rms_norm", torch.ones(2), torch.ones(2, dtype=torch.float16), backend="torch")
    with pytest.raises(TypeError, match="dtype float64 not supported"):
        dispatch.check_inputs("rms_norm", torch.ones(2, dtype=torch.float64), backend="torch")
    if not torch.cuda.is_available():
        assert dispatch.backend_status("rms_norm", "tilelang", "cpu") == (False, "tilelang: no CUDA device")
        assert dispatch.backend_status("rms_norm", "torch", "cpu") == (True, "ok")


@pytest.mark.gpu
@pytest.mark.exclusive
def test_gpu_timer_measures_a_known_duration():
    """torch.cuda._sleep spins a calibrated number of cycles: the timer must report that duration. (Beside
    other processes' kernels the GPU time-slices between contexts and the events see their share: `exclusive`.)"""
    if not torch.cuda.is_available():
        pytest.skip("timer check: no CUDA device")

    def event_us(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    event_us(1000)
    cycles_per_us = 2_000_000 / min(event_us(2_000_000) for _ in range(3))
    target_us = 200.0
    cycles = int(cycles_per_us * target_us)

    info = timing.bench_gpu(_FakeBenchmark(), lambda: torch.cuda._sleep(cycles), rounds=9)
    assert info["stat"] == "device" and info["device_time_method"] == "cuda_graph" and info["l2"] == "flush"
    assert info["device_us"] == pytest.approx(target_us, rel=0.05)
    assert info["per_call_us"] == pytest.approx(target_us, rel=0.10)
    assert info["per_call_over_device"] >= 0.97
    assert 0 < info["host_us"] < target_us


class _FakeGpu:
    """A CUDA stand-in for bench_gpu on CPU: launches advance a device clock, or are recorded while a
    graph is being captured and advance it again on every replay; events read the device clock."""

    def __init__(self, monkeypatch):
        self.clock = 0.0
        self.capturing = None
        self.launched = 0  # eager launches (what the profiler would list)
        gpu = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = gpu.clock

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        class Graph:
            def __init__(self):
                self.ops = []

            def replay(self):
                for seconds in self.ops:
                    gpu.clock += seconds

        @contextlib.contextmanager
        def graph(g):
            gpu.capturing = g
            yield
            gpu.capturing = None

        stream = type("Stream", (), {"wait_stream": lambda self, other: None})
        for name, value in {"Event": Event, "CUDAGraph": Graph, "graph": graph, "Stream": stream,
                            "stream": lambda s: contextlib.nullcontext(), "current_stream": lambda: stream(),
                            "synchronize": lambda: None, "_sleep": lambda cycles: self.launch(0.5e-3)}.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)
        monkeypatch.setattr(timing.gpu, "flush_l2", lambda device=None, size=0: self.launch(40e-6))
        monkeypatch.setattr(timing.work, "device_launches", self.launches_of)

    def launch(self, seconds):
        if self.capturing is not None:
            self.capturing.ops.append(seconds)
        else:
            self.clock += seconds
            self.launched += 1

    def launches_of(self, fn, calls):
        before = self.launched
        for _ in range(calls):
            fn()
        return self.launched - before


def test_bench_gpu_device_time_from_a_graph_of_many_calls_with_the_flushes_subtracted(monkeypatch):
    gpu = _FakeGpu(monkeypatch)
    bench = _FakeBenchmark()
    info = timing.bench_gpu(bench, lambda: gpu.launch(4e-6), rounds=5, warmup_rounds=1)
    assert info["device_time_method"] == "cuda_graph" and info["l2"] == "flush" and info["stat"] == "device"
    assert info["calls_per_graph"] == 23  # ceil(1 ms / (4 + 40) us)
    assert info["device_us"] == pytest.approx(4.0)  # the 40 us flush before every call is subtracted
    assert info["flush_us_subtracted"] == pytest.approx(40.0)
    assert bench.stats.stats.median == pytest.approx(4e-6)  # pytest-benchmark's statistic is device time
    assert info["per_call_us"] == pytest.approx(4.0) and info["per_call_over_device"] == pytest.approx(1.0)
    assert info["host_us"] >= 0 and info["gated"] is True and bench.extra_info["device_us"] == info["device_us"]


def test_bench_gpu_rotates_over_input_copies_and_marks_informational_cases(monkeypatch):
    gpu = _FakeGpu(monkeypatch)
    calls = []

    def make(i):
        return lambda: (calls.append(i), gpu.launch(10e-6))

    info = timing.bench_gpu(_FakeBenchmark(), [make(i) for i in range(4)], rounds=3, gated=False)
    assert info["l2"] == "rotate" and info["rotations"] == 4 and info["gated"] is False
    assert info["calls_per_graph"] == 100 and info["flush_us_subtracted"] == 0.0
    assert info["device_us"] == pytest.approx(10.0)
    assert set(calls) == {0, 1, 2, 3}


def test_bench_gpu_disabled_runs_once_untimed(monkeypatch):
    gpu = _FakeGpu(monkeypatch)
    bench = _FakeBenchmark(enabled=False)
    bench.pedantic = lambda target, **kw: target()
    info = timing.bench_gpu(bench, lambda: gpu.launch(4e-6), l2="warm")
    assert info["l2"] == "warm" and "device_us" not in info


def test_bench_gpu_records_the_counted_work_of_gated_cases(monkeypatch):
    """A gated case stores its counted work (timing.work), launches included; one more Python call on the host
    is exactly one more python_calls and nothing else; informational cases (torch.compile peers) are not
    counted; --benchmark-disable counts nothing."""
    gpu = _FakeGpu(monkeypatch)

    def call():
        gpu.launch(4e-6)

    def slower_call():
        abs(1)
        gpu.launch(4e-6)

    work = timing.bench_gpu(_FakeBenchmark(), call, rounds=3, warmup_rounds=1)["work"]
    assert work["launches"] == 1 and work["torch_ops"] == 0 and work["host_reads"] == 0 and "unstable" not in work
    assert work["python_calls"] == 1  # call() makes one call: gpu.launch
    slower = timing.bench_gpu(_FakeBenchmark(), slower_call, rounds=3, warmup_rounds=1)["work"]
    assert slower == {**work, "python_calls": work["python_calls"] + 1}
    assert "work" not in timing.bench_gpu(_FakeBenchmark(), call, rounds=3, gated=False)
    disabled = _FakeBenchmark(enabled=False)
    disabled.pedantic = lambda target, **kw: target()
    assert "work" not in timing.bench_gpu(disabled, call, l2="warm")
