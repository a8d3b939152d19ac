"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * weight over the last dimension, fp32 accumulation.

Backends: "torch" (F.rms_norm), "triton", "tilelang"; forward and backward. With grad
enabled and an input that requires grad, an autograd.Function runs the training kernels (forward saves
1/rms); otherwise the inference kernel runs alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcvr_lib import kernels
from pcvr_lib.kernels import registry
from pcvr_lib.kernels.rms_norm.common import backend_module, check_norm_inputs, rows_view
from pcvr_lib.kernels.rms_norm.workload import rms_norm_reference

OP = "rms_norm"
registry.register_op(OP, ["torch", "triton", "tilelang"])


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """torch's own F.rms_norm (one fused kernel on CUDA, fp32 accumulation): the torch baseline."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The eager formula of the reference, upcast to fp32 (several kernels and fp32 temporaries)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, impl):
        x2 = rows_view(x)
        y, rstd = impl.forward(x2, weight.contiguous(), eps, True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.impl = impl
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.impl.backward(rows_view(dy), x2, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None, None


def _gpu(backend: str):
    def run(x, weight, eps):
        check_norm_inputs(OP, backend, x, weight)
        impl = backend_module(OP, backend, x.device, __name__)
        if x.numel() == 0:
            return torch.empty_like(x)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNormFunction.apply(x, weight, eps, impl)
        y, _ = impl.forward(rows_view(x), weight if weight.is_contiguous() else weight.contiguous(), eps, False)
        return y if x.dim() == 2 else y.view(x.shape)
    return run


def _torch(x, weight, eps):
    check_norm_inputs(OP, "torch", x, weight)
    return rms_norm_torch(x, weight, eps)


_RUNNERS = {"torch": _torch, "triton": _gpu("triton"), "tilelang": _gpu("tilelang")}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape) with the chosen backend."""
    run = _RUNNERS.get(backend)
    if run is None:
        registry.validate_backend(OP, backend)  # raises ValueError naming the known backends
    return run(x, weight, eps)


__all__ = ["rms_norm", "rms_norm_formula", "rms_norm_reference", "rms_norm_torch"]


kernels.make_module_callable(__name__, rms_norm)
