"""Glue shared by the norm operators: input checks on the hot path and backend module loading.

The per-call Python path is kept short on purpose (the reference's wrappers cost 50-300 us per call):
one combined fast check, a dict lookup for the backend module, no synchronisation, no allocation
besides the outputs. The slow, fully worded checks run only when the fast one fails.
"""

from __future__ import annotations

import importlib

import torch

from pcvr_lib.kernels import registry

OK_DTYPES = frozenset(registry.FLOAT_DTYPES)
_GPU_BACKENDS = ("triton", "tilelang")
_LOADED: dict[tuple[str, str, str], object] = {}


def check_norm_inputs(op: str, backend: str, x: torch.Tensor, *params: torch.Tensor) -> None:
    """Raise a clear error unless x (..., C) and each 1-D parameter (C,) fit together."""
    fast = (
        isinstance(x, torch.Tensor)
        and x.dtype in OK_DTYPES
        and (x.is_cuda or backend == "torch")
        and x.dim() >= 1
        and all(isinstance(p, torch.Tensor) and p.dtype == x.dtype and p.device == x.device
                and p.dim() == 1 and p.shape[0] == x.shape[-1] for p in params)
    )
    if fast:
        return
    registry.check_inputs(op, x, *params, backend=backend)
    if x.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension (the normalised one)")
    for p in params:
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise ValueError(f"{op}: parameter of shape {tuple(p.shape)} does not match the last dimension "
                             f"of the input {tuple(x.shape)}; expected ({x.shape[-1]},)")


def backend_module(op: str, backend: str, device: torch.device, package: str):
    """The kernels module of a GPU backend, after checking once per device that it can run here."""
    key = (package, backend, str(device))
    mod = _LOADED.get(key)
    if mod is None:
        registry.require_backend(op, backend, device)
        mod = importlib.import_module(f"{package}.{backend}_impl")
        if device.type == "cuda":  # CPU (interpreter) availability depends on the environment: recheck
            _LOADED[key] = mod
    return mod


def forget_backends() -> None:
    """Drop the per-device record of checked backend modules: the next call checks availability again."""
    _LOADED.clear()


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """(M, C) contiguous view (a copy only when x is not contiguous)."""
    if x.dim() == 2 and x.is_contiguous():
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def norm_kernels(op: str, build_forward, build_backward):
    """The TileLang kernels of one norm: inference forward, training forward (saves statistics), backward."""
    from pcvr_lib.kernels._tilelang import Kernels

    return Kernels({f"{op}.fwd_infer": lambda n, dtype: build_forward(n, dtype, False),
                    f"{op}.fwd_train": lambda n, dtype: build_forward(n, dtype, True),
                    f"{op}.bwd": build_backward})
