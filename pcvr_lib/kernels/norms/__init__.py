"""RMSNorm and LayerNorm over the last dimension, fp32 accumulation: one family, one tiling.

    rms_norm(x, weight, eps=1e-6, backend="torch")          y = x * rsqrt(mean(x^2) + eps) * weight
    layer_norm(x, weight, bias, eps=1e-5, backend="torch")  y = (x - mean) / sqrt(var + eps) * weight + bias

Backends: "torch" (F.rms_norm / F.layer_norm), "triton", "tilelang"; forward and backward. With grad enabled
and an input that requires grad, an autograd.Function runs the training kernels (the forward saves 1/rms, or
mean and 1/std); otherwise the inference kernel runs alone. A new row count never recompiles.

The per-call Python path is kept short: one combined fast input check, one dict lookup for the backend's
module, no synchronisation, no allocation besides the outputs; the fully worded checks run only when the
fast one fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.norms.reference import layer_norm_reference, rms_norm_formula, rms_norm_reference

OPS = ("rms_norm", "layer_norm")
for _op in OPS:
    dispatch.register_op(_op, __name__, ["torch", "triton", "tilelang"])

_OK_DTYPES = frozenset(dispatch.FLOAT_DTYPES)
_IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS


def check_norm_inputs(op: str, backend: str, x: torch.Tensor, *params: torch.Tensor) -> None:
    """Raise a clear error unless x (..., C) and each 1-D parameter (C,) fit together."""
    fast = (
        isinstance(x, torch.Tensor)
        and x.dtype in _OK_DTYPES
        and (x.is_cuda or backend == "torch")
        and x.dim() >= 1
        and all(isinstance(p, torch.Tensor) and p.dtype == x.dtype and p.device == x.device
                and p.dim() == 1 and p.shape[0] == x.shape[-1] for p in params)
    )
    if fast:
        return
    dispatch.check_inputs(op, x, *params, backend=backend)
    if x.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension (the normalised one)")
    for p in params:
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise ValueError(f"{op}: parameter of shape {tuple(p.shape)} does not match the last dimension "
                             f"of the input {tuple(x.shape)}; expected ({x.shape[-1]},)")


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """(M, C) contiguous view (a copy only when x is not contiguous)."""
    if x.dim() == 2 and x.is_contiguous():
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


# ------------------------------------------------------------------ RMSNorm

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """torch's own F.rms_norm (one fused kernel on CUDA, fp32 accumulation): the torch backend."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, impl):
        x2 = rows_view(x)
        y, rstd = impl.rms_forward(x2, weight.contiguous(), eps, True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.impl = impl
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.impl.rms_backward(rows_view(dy), x2, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape) with the chosen backend."""
    if backend == "torch":
        check_norm_inputs("rms_norm", backend, x, weight)
        return rms_norm_torch(x, weight, eps)
    if backend not in ("triton", "tilelang"):
        dispatch.validate_backend("rms_norm", backend)  # raises ValueError naming the known backends
    check_norm_inputs("rms_norm", backend, x, weight)
    if torch.compiler.is_compiling():
        if x.numel() == 0:
            return torch.empty_like(x)
        training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        return torch.ops.pcvr.rms_norm(rows_view(x), weight, eps, training, backend)[0].view(x.shape)
    impl = _IMPLEMENTATIONS.get(("rms_norm", backend, x.get_device())) or dispatch.implementation(
        "rms_norm", backend, x.device)
    if x.numel() == 0:
        return torch.empty_like(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps, impl)
    y, _ = impl.rms_forward(rows_view(x), weight if weight.is_contiguous() else weight.contiguous(), eps, False)
    return y if x.dim() == 2 else y.view(x.shape)


# ------------------------------------------------------------------ LayerNorm

def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """torch's F.layer_norm. On CPU in fp32 for 16-bit inputs: torch's CPU kernel accumulates the fp16/bf16
    weight gradient in low precision (8% off at 5x385 bf16), CUDA's in fp32."""
    if x.device.type == "cpu" and x.dtype != torch.float32:
        y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
        return y.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, impl):
        x2 = rows_view(x)
        y, stats = impl.ln_forward(x2, weight.contiguous(), bias.contiguous(), eps, True)
        ctx.save_for_backward(x2, weight, stats[0], stats[1])
        ctx.impl = impl
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ctx.impl.ln_backward(rows_view(dy), x2, weight.contiguous(), mean, rstd)
        return dx.view(dy.shape), dw, db, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, *,
               backend: str = "torch") -> torch.Tensor:
    """LayerNorm over the last dimension of x (any leading shape) with the chosen backend."""
    if backend == "torch":
        check_norm_inputs("layer_norm", backend, x, weight, bias)
        return layer_norm_torch(x, weight, bias, eps)
    if backend not in ("triton", "tilelang"):
        dispatch.validate_backend("layer_norm", backend)
    check_norm_inputs("layer_norm", backend, x, weight, bias)
    if torch.compiler.is_compiling():
        if x.numel() == 0:
            return torch.empty_like(x)
        training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)
        return torch.ops.pcvr.layer_norm(rows_view(x), weight, bias, eps, training, backend)[0].view(x.shape)
    impl = _IMPLEMENTATIONS.get(("layer_norm", backend, x.get_device())) or dispatch.implementation(
        "layer_norm", backend, x.device)
    if x.numel() == 0:
        return torch.empty_like(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _LayerNormFunction.apply(x, weight, bias, eps, impl)
    if not (weight.is_contiguous() and bias.is_contiguous()):
        weight, bias = weight.contiguous(), bias.contiguous()
    y, _ = impl.ln_forward(rows_view(x), weight, bias, eps, False)
    return y if x.dim() == 2 else y.view(x.shape)


# ------------------------------------------------------------------ torch.library ops (what torch.compile traces)
# Under torch.compile the entry points call these instead of the autograd Functions: one custom op per norm, with a
# fake kernel (shapes only) and its backward op, so a compiled graph holds the kernel launch as one node. Eager
# calls keep the direct path above (a custom op's dispatch costs microseconds of host time per call).


@torch.library.custom_op("pcvr::rms_norm", mutates_args=())
def _rms_norm_op(x2: torch.Tensor, weight: torch.Tensor, eps: float, training: bool,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, 1/rms) of (M, N) rows; the inference kernel, and an empty 1/rms, unless `training`."""
    impl = dispatch.implementation("rms_norm", backend, x2.device)
    y, rstd = impl.rms_forward(x2, weight.contiguous(), eps, training)
    return y, rstd if training else x2.new_empty((0,), dtype=torch.float32)


@_rms_norm_op.register_fake
def _(x2, weight, eps, training, backend):
    return torch.empty_like(x2), x2.new_empty((x2.shape[0] if training else 0,), dtype=torch.float32)


@torch.library.custom_op("pcvr::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    impl = dispatch.implementation("rms_norm", backend, x2.device)
    return impl.rms_backward(dy.contiguous(), x2, weight.contiguous(), rstd)


@_rms_norm_backward_op.register_fake
def _(dy, x2, weight, rstd, backend):
    return torch.empty_like(x2), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x2, weight, _eps, _training, backend = inputs
    ctx.save_for_backward(x2, weight, output[1])
    ctx.backend = backend


def _rms_norm_backward(ctx, dy, _drstd):
    x2, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x2, weight, rstd, ctx.backend)
    return dx, dw, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@torch.library.custom_op("pcvr::layer_norm", mutates_args=())
def _layer_norm_op(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, training: bool,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats) of (M, N) rows, stats (2, M): the mean and 1/std (empty, and the inference kernel, unless
    `training`)."""
    impl = dispatch.implementation("layer_norm", backend, x2.device)
    y, stats = impl.ln_forward(x2, weight.contiguous(), bias.contiguous(), eps, training)
    return y, stats if training else x2.new_empty((2, 0), dtype=torch.float32)


@_layer_norm_op.register_fake
def _(x2, weight, bias, eps, training, backend):
    return torch.empty_like(x2), x2.new_empty((2, x2.shape[0] if training else 0), dtype=torch.float32)


@torch.library.custom_op("pcvr::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor,
                            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = dispatch.implementation("layer_norm", backend, x2.device)
    dx, dw, db = impl.ln_backward(dy.contiguous(), x2, weight.contiguous(), stats[0], stats[1])
    return dx, dw, db.clone()  # dw and db are rows of one buffer: a custom op's outputs may not alias


@_layer_norm_backward_op.register_fake
def _(dy, x2, weight, stats, backend):
    return torch.empty_like(x2), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_setup(ctx, inputs, output):
    x2, weight, _bias, _eps, _training, backend = inputs
    ctx.save_for_backward(x2, weight, output[1])
    ctx.backend = backend


def _layer_norm_backward(ctx, dy, _dstats):
    x2, weight, stats = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward_op(dy, x2, weight, stats, ctx.backend)
    return dx, dw, db, None, None, None


_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


__all__ = ["OPS", "check_norm_inputs", "layer_norm", "layer_norm_reference", "layer_norm_torch", "rms_norm",
           "rms_norm_formula", "rms_norm_reference", "rms_norm_torch", "rows_view"]
