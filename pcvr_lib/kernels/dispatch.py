"""The one dispatcher of every kernel op: which backends an op has, whether a backend can run here (and
why not), and the module that implements it.

Backends are chosen explicitly by the caller; nothing here falls back silently. Each op package calls
`register_op` once at import with the backends it implements (optionally an extra availability check
each); backend B of an op lives in the module `<op package>.<B>_impl`. Tests and benchmarks ask
`backend_status` and skip with its reason; an op's entry point asks `implementation` for the module to
launch, which checks availability once per (op, backend, CUDA device) and then serves the hot path from
`IMPLEMENTATIONS` (one dict lookup per call). `implementation` is the seam where an op x backend meets
torch: every launch of a GPU backend goes through the module it returns.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Backend:
    name: str
    needs_cuda: bool
    package: str | None  # importable module that must be present


BACKENDS: dict[str, Backend] = {
    "torch": Backend("torch", needs_cuda=False, package=None),
    "triton": Backend("triton", needs_cuda=True, package="triton"),
    "tilelang": Backend("tilelang", needs_cuda=True, package="tilelang"),
    "cuembed": Backend("cuembed", needs_cuda=True, package=None),  # CUDA C++ built at first use
}

Check = Callable[[torch.device], "str | None"]


@dataclass(frozen=True)
class Op:
    name: str
    package: str  # e.g. "pcvr_lib.kernels.norms"; backend B's code is module f"{package}.{B}_impl"
    checks: dict[str, Check | None] = field(default_factory=dict)  # backend -> extra availability check

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.checks)


_OPS: dict[str, Op] = {}
# (op, backend, CUDA device index) -> the backend's module, once its availability there was checked
IMPLEMENTATIONS: dict[tuple[str, str, int], ModuleType] = {}


def register_op(name: str, package: str, backends: dict[str, Check | None] | Sequence[str]) -> Op:
    """Declare op `name`, implemented in `package`, with `backends` (names, or name -> extra check)."""
    checks = dict(backends) if isinstance(backends, dict) else {b: None for b in backends}
    unknown = sorted(set(checks) - set(BACKENDS))
    if unknown:
        raise ValueError(f"{name}: unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    op = Op(name, package, checks)
    _OPS[name] = op
    return op


def ops() -> tuple[str, ...]:
    """Every registered op (importing pcvr_lib.kernels registers all of them)."""
    return tuple(_OPS)


def get_op(name: str) -> Op:
    op = _OPS.get(name)
    if op is None:
        raise ValueError(f"unknown operator {name!r}; registered: {', '.join(sorted(_OPS)) or 'none'}")
    return op


def op_backends(op: str) -> tuple[str, ...]:
    return get_op(op).backends


def validate_backend(op: str, backend: str) -> None:
    """ValueError for a backend name nobody knows or one that `op` does not implement."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    backends = get_op(op).backends
    if backend not in backends:
        raise ValueError(f"{op}: no {backend!r} backend; {op} has: {', '.join(backends)}")


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
    check = get_op(op).checks[backend]
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


def implementation(op: str, backend: str, device: torch.device) -> ModuleType:
    """The module of `backend` for `op` on `device`, after checking that it can run there.

    On CUDA the check runs once per (op, backend, device index) and the module is kept in IMPLEMENTATIONS,
    which the entry points read first; CPU tensors are checked at every call (only triton under
    TRITON_INTERPRET=1 runs them, and that depends on the environment).
    """
    entry = get_op(op)
    validate_backend(op, backend)
    if BACKENDS[backend].needs_cuda and device.type != "cuda" and not (
            backend == "triton" and triton_interpret_enabled()):
        raise RuntimeError(f"{op} requires CUDA tensors for backend {backend!r} (got {device})")
    require_backend(op, backend, device)
    module = importlib.import_module(f"{entry.package}.{backend}_impl")
    if device.type == "cuda" and device.index is not None:
        IMPLEMENTATIONS[(op, backend, device.index)] = module
    return module


def forget_implementations() -> None:
    """Drop the record of checked backends: the next call of every op checks availability again."""
    IMPLEMENTATIONS.clear()


def nvcc_problem(_device: torch.device) -> str | None:
    """Availability check for backends built at first use with the CUDA toolkit."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "no CUDA toolkit (nvcc not found)"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
        raise TypeError(f"{op}: floating-point tensors must share one dtype, got "
                        f"{sorted(dtype_name(d) for d in float_dtypes)}")
    if floats and floats[0].dtype not in dtypes:
        allowed = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{op}: dtype {dtype_name(floats[0].dtype)} not supported ({allowed})")
    if BACKENDS[backend].needs_cuda and tensors and tensors[0].device.type != "cuda":
        if not (backend == "triton" and triton_interpret_enabled()):
            raise RuntimeError(f"{op} requires CUDA tensors for backend {backend!r} (got {tensors[0].device})")
