"""The benchmark timer and its helpers: pure logic on CPU, the known-duration check on the GPU."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib import timing
from pcvr_lib.kernels import registry
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


def test_assert_comparable_refuses_different_gpus():
    h200 = {"gpu": {"name": "NVIDIA H200", "sm_clock_mhz": "1980"}}
    timing.assert_comparable(h200, {"gpu": {"name": "NVIDIA H200", "sm_clock_mhz": "1500"}})  # clocks ignored
    with pytest.raises(ValueError, match="different accelerators: 'NVIDIA H200' vs 'NVIDIA H100"):
        timing.assert_comparable(h200, {"gpu": {"name": "NVIDIA H100 80GB HBM3"}})
    with pytest.raises(ValueError, match="'no GPU'"):
        timing.assert_comparable(h200, {"gpu": None})


def test_update_machine_info_lists_versions():
    info: dict = {}
    timing.update_machine_info(info)
    assert info["libraries"]["torch"] == torch.__version__
    assert "triton" in info["libraries"] and "tilelang" in info["libraries"]
    if not torch.cuda.is_available():
        assert info["gpu"] is None


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
    clock = timing.CudaEventClock(calls=4)
    start = clock()
    end = clock()
    assert end - start == pytest.approx(0.5e-3)  # 2 ms over 4 calls
    start = clock()
    assert clock() - start == pytest.approx(1e-3)


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
        registry.validate_backend("rms_norm", "cuda")
    with pytest.raises(ValueError, match="unknown operator"):
        registry.backend_status("no_such_op", "torch")
    with pytest.raises(RuntimeError, match="rms_norm requires CUDA tensors"):
        registry.check_inputs("rms_norm", torch.ones(2), backend="tilelang")
    with pytest.raises(TypeError, match="share one dtype"):
        registry.check_inputs("rms_norm", torch.ones(2), torch.ones(2, dtype=torch.float16), backend="torch")
    with pytest.raises(TypeError, match="dtype float64 not supported"):
        registry.check_inputs("rms_norm", torch.ones(2, dtype=torch.float64), backend="torch")
    if not torch.cuda.is_available():
        assert registry.backend_status("rms_norm", "tilelang", "cpu") == (False, "tilelang: no CUDA device")
        assert registry.backend_status("rms_norm", "torch", "cpu") == (True, "ok")


@pytest.mark.gpu
def test_gpu_timer_measures_a_known_duration():
    """torch.cuda._sleep spins a calibrated number of cycles: the timer must report that duration."""
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

    class Bench:  # the pytest-benchmark fixture surface bench_gpu uses
        enabled = True
        extra_info: dict = {}

        def pedantic(self, target, setup, rounds, warmup_rounds, iterations):
            samples = []
            for _ in range(rounds):
                setup()
                t0 = self._timer()
                target()
                samples.append(self._timer() - t0)
            samples.sort()
            self.stats = type("S", (), {"stats": type("T", (), {"median": samples[len(samples) // 2]})})

    info = timing.bench_gpu(Bench(), lambda: torch.cuda._sleep(cycles), rounds=9)
    assert info["device_us"] == pytest.approx(target_us, rel=0.05)
    assert info["per_call_us"] == pytest.approx(target_us, rel=0.10)
    assert info["per_call_over_device"] >= 0.97
