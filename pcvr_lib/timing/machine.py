"""What a run records about its machine: library versions, the accelerator and its clocks, the host-speed
probe and (when measured) the ceilings."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess

from pcvr_lib.timing.ceilings import measured_ceilings
from pcvr_lib.timing.host import host_probe


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - a broken optional package is reported, not fatal
        return None


def _distribution_version(name: str) -> str | None:
    """An installed distribution's version without importing it (the CuTe-DSL peers take seconds to import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# the frontier peers of the kernel suite (perf_tests/peers.py), by distribution name
PEER_DISTRIBUTIONS = ("quack-kernels", "flash-attn-4", "nvidia-cutlass-dsl", "fbgemm-gpu", "fbgemm-gpu-cpu")


def _nvidia_smi(fields: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [part.strip() for part in out.strip().splitlines()[0].split(",")] if out.strip() else None


def update_machine_info(machine_info: dict) -> None:
    """Add library versions, the accelerator, its clocks and (when measured) the ceilings."""
    import torch

    machine_info["cpu_count"] = os.cpu_count()
    machine_info["libraries"] = {
        name: _version(name)
        for name in ("torch", "triton", "tilelang", "liger_kernel", "pyarrow", "numpy")
    }
    machine_info["libraries"].update({name: _distribution_version(name) for name in PEER_DISTRIBUTIONS})
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
        smi = _nvidia_smi("driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit")
        if smi:
            keys = ("driver", "sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz",
                    "power_limit_w")
            gpu.update(dict(zip(keys, smi, strict=False)))
        machine_info["gpu"] = gpu
        machine_info["host_probe"] = host_probe()
        ceilings = measured_ceilings()
        if ceilings:
            machine_info["ceilings"] = ceilings
    else:
        machine_info["gpu"] = None
