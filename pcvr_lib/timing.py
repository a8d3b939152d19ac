"""Timing support for the benchmarks: machine info for pytest-benchmark's JSON.

(The GPU timer, ceilings and L2 flush live here too; see the kernel suite.)
"""

from __future__ import annotations

import importlib
import os


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken optional package is reported, not fatal
        return None


def update_machine_info(machine_info: dict) -> None:
    """Add library versions and the accelerator to pytest-benchmark's machine_info."""
    import torch

    machine_info["cpu_count"] = os.cpu_count()
    machine_info["libraries"] = {
        name: _version(name) for name in ("torch", "triton", "tilelang", "pyarrow", "numpy")
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        machine_info["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    else:
        machine_info["gpu"] = None
