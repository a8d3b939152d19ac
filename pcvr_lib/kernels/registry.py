"""Which backend of which operator can run here, and why not.

Backends are chosen explicitly by the caller; nothing here falls back silently. Operators declare the
backends they implement with `register_op`; tests and benchmarks ask `backend_status` and skip (or report
"unsupported") with its reason; the operators call `require_backend` / `check_inputs` before launching.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BackendInfo:
    name: str
    needs_cuda: bool
    package: str | None  # importable module that must be present
    peer: bool = False  # a third-party implementation used only as a benchmark peer


BACKENDS: dict[str, BackendInfo] = {
    "torch": BackendInfo("torch", needs_cuda=False, package=None),
    "triton": BackendInfo("triton", needs_cuda=True, package="triton"),
    "tilelang": BackendInfo("tilelang", needs_cuda=True, package="tilelang"),
    "cuembed": BackendInfo("cuembed", needs_cuda=True, package=None),
    # peers for the benchmarks
    "torch_compile": BackendInfo("torch_compile", needs_cuda=False, package=None, peer=True),
    "liger": BackendInfo("liger", needs_cuda=True, package="liger_kernel", peer=True),
}

# op -> backend -> optional extra check returning None (fine) or the reason it cannot run
_OPS: dict[str, dict[str, Callable[[torch.device], str | None] | None]] = {}


def register_op(op: str, backends: dict[str, Callable[[torch.device], str | None] | None] | list[str]) -> None:
    """Declare the backends `op` implements (optionally with an extra availability check each)."""
    if not isinstance(backends, dict):
        backends = {name: None for name in backends}
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"{op}: unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    _OPS.setdefault(op, {}).update(backends)


def known_backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


def op_backends(op: str) -> tuple[str, ...]:
    """The backends registered for `op` (importing its package registers them)."""
    _ensure_registered(op)
    return tuple(_OPS[op])


def _ensure_registered(op: str) -> None:
    if op in _OPS:
        return
    from pcvr_lib.kernels import _EXPORTS  # operator name -> its package, which registers itself on import

    if op in _EXPORTS:
        importlib.import_module(_EXPORTS[op])
    if op not in _OPS:
        raise ValueError(f"unknown operator {op!r}; registered: {', '.join(sorted(_OPS)) or 'none'}")


def validate_backend(op: str, backend: str) -> None:
    """ValueError for a backend name nobody knows or one that `op` does not implement."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    _ensure_registered(op)
    if backend not in _OPS[op]:
        raise ValueError(f"{op}: no {backend!r} backend; {op} has: {', '.join(_OPS[op])}")


@functools.cache
def package_problem(package: str) -> str | None:
    """None when `package` imports, else a one-line reason (cached: imports are slow)."""
    if importlib.util.find_spec(package) is None:
        return "package not installed"
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any import failure makes the backend unusable; say why
        return f"package fails to import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


def triton_interpret_enabled() -> bool:
    """True when TRITON_INTERPRET=1 is set (triton reads the variable itself, at every launch)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def backend_status(op: str, backend: str, device=None) -> tuple[bool, str]:
    """(ok, reason): whether `backend` of `op` can run on `device` (default: cuda if present, else cpu).

    Raises ValueError for an unknown backend or operator: that is a programming error, not a skip.
    """
    validate_backend(op, backend)
    info = BACKENDS[backend]
    dev = _resolve_device(device)
    if info.package is not None:
        problem = package_problem(info.package)
        if problem:
            return False, f"{backend}: {problem}"
    if info.needs_cuda and dev.type != "cuda":
        if backend == "triton" and triton_interpret_enabled():
            pass  # the interpreter runs the kernels on CPU tensors
        elif not torch.cuda.is_available():
            return False, f"{backend}: no CUDA device"
        else:
            return False, f"{backend}: needs a CUDA device, got {dev.type}"
    check = _OPS[op][backend]
    if check is not None:
        problem = check(dev)
        if problem:
            return False, f"{backend}: {problem}"
    return True, "ok"


def require_backend(op: str, backend: str, device=None) -> None:
    """RuntimeError with `backend_status`'s reason when the backend cannot run here."""
    ok, reason = backend_status(op, backend, device)
    if not ok:
        raise RuntimeError(f"{op}: backend {backend!r} cannot run here: {reason}")


def nvcc_problem(_device: torch.device) -> str | None:
    """Availability check for backends built at first use with the CUDA toolkit."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "no CUDA toolkit (nvcc not found)"
    return None


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(op: str, *tensors: torch.Tensor, backend: str, dtypes=FLOAT_DTYPES) -> None:
    """Validate the tensors of one call before launching anything.

    - every argument is a tensor, all on one device;
    - the floating-point ones share one dtype, which must be in `dtypes`;
    - GPU backends get CUDA tensors (CPU tensors only for triton under TRITON_INTERPRET=1).
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: argument {i} must be a torch.Tensor, got {type(t).__name__}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    floats = [t for t in tensors if t.is_floating_point()]
    float_dtypes = {t.dtype for t in floats}
    if len(float_dtypes) > 1:
        names = sorted(str(d).replace("torch.", "") for d in float_dtypes)
        raise TypeError(f"{op}: floating-point tensors must share one dtype, got {names}")
    if floats and floats[0].dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: dtype {str(floats[0].dtype).replace('torch.', '')} not supported ({allowed})")
    if BACKENDS[backend].needs_cuda and tensors and tensors[0].device.type != "cuda":
        if not (backend == "triton" and triton_interpret_enabled()):
            raise RuntimeError(f"{op} requires CUDA tensors for backend {backend!r} (got {tensors[0].device})")
