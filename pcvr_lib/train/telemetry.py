"""Wall time, CPU peak RSS, CUDA peak memory and throughput of one phase (training, evaluation,
inference), as written into the run dir's *_telemetry.json files."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from pathlib import Path
from typing import Any

import torch


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux: clear_refs 5), so that each phase
    reports its own peak; silently a no-op where unsupported."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        import resource  # Unix only: the fallback where /proc is missing

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


class Telemetry:
    """Wall time, CPU peak RSS, CUDA peak memory and throughput of one phase, measured by `with`.

    The caller counts `rows`, `batches` and `steps` inside the block; `excluded` is the seconds inside the
    phase that belong to another phase (training's holdout evaluations), left out of `elapsed` and the
    rates. `t0` is the phase's start on the perf_counter clock."""

    def __init__(self, label: str, device: torch.device):
        self.label, self.device = label, device
        self.rows = self.batches = self.steps = 0
        self.excluded = 0.0

    def __enter__(self) -> Telemetry:
        _reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = _now()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall = time.perf_counter() - self.t0
        self.elapsed = self.wall - self.excluded
        self.ended = _now()

    def to_dict(self, model=None, metadata: dict | None = None) -> dict[str, Any]:
        elapsed = max(self.elapsed, 1e-9)
        cuda = self.device.type == "cuda"
        return {
            "label": self.label,
            "started_at": self.started,
            "ended_at": self.ended,
            "elapsed_sec": self.elapsed,
            "wall_sec": self.wall,
            "cpu_peak_rss_mb": _peak_rss_mb(),
            "device": str(self.device),
            "cuda_device_name": torch.cuda.get_device_name(self.device) if cuda else None,
            "cuda_peak_allocated_mb": torch.cuda.max_memory_allocated(self.device) / 2**20 if cuda else None,
            "cuda_peak_reserved_mb": torch.cuda.max_memory_reserved(self.device) / 2**20 if cuda else None,
            "rows": self.rows,
            "batches": self.batches,
            "steps": self.steps,
            "rows_per_sec": self.rows / elapsed,
            "batches_per_sec": self.batches / elapsed,
            "steps_per_sec": self.steps / elapsed,
            "model_parameters": model.parameter_counts() if model is not None else None,
            "torch_version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "metadata": metadata or {},
        }
