"""Bytes, FLOPs and rates of a case, and the device's measured ceilings (copy GB/s, bf16 matmul TFLOP/s)
that no case may exceed."""

from __future__ import annotations

from pcvr_lib.timing.clocks import median_event_seconds, warm_gpu

CEILING_SLACK = 1.02  # a copy-ceiling measurement is itself +-1%: beyond 2% over it a number is impossible


def nbytes(*tensors) -> int:
    """Bytes of the given tensors (each counted once, as one read or one write)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


_CEILINGS: dict[str, dict] = {}


# A ceiling is the best the device reaches: the fastest of CEILING_BATCHES batches of CEILING_CALLS back-to-back
# calls behind a GPU spin (as the cases run), after 0.3 s of warm-up. The median of isolated calls moved by 4-7%
# between processes on one H200 (its clocks between idle calls), so cases at 95% of the copy rate exceeded it.
CEILING_CALLS = 5
CEILING_BATCHES = 8


def _best_seconds(fn) -> float:
    warm_gpu(fn, 0.3)  # out of the idle clock first
    return min(median_event_seconds(lambda: [fn() for _ in range(CEILING_CALLS)], reps=1, lead_sleep=True)
               for _ in range(CEILING_BATCHES)) / CEILING_CALLS


def _copy_seconds(device) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src))


def _matmul_seconds(device, n: int) -> float:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    return _best_seconds(lambda: torch.matmul(a, b))


def measure_ceilings(device=None) -> dict:
    """Device-to-device copy GB/s (bytes read + written) and bf16 8192^3 matmul TFLOP/s, once per session: the
    best of a few back-to-back batches (`_best_seconds`)."""
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


def measured_ceilings() -> dict | None:
    """The ceilings this process measured (of the first device measured), or None before any."""
    return dict(next(iter(_CEILINGS.values()))) if _CEILINGS else None


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

