"""AdamW: torch's optimizer (for-each and fused), and a small for-each AdamW used inside Muon.

Defaults are the reference's: betas (0.9, 0.98), eps 1e-8, weight decay 0.01.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import OptimizerError, UnsupportedOptimizer, check_common

BETAS = (0.9, 0.98)
EPS = 1e-8
WEIGHT_DECAY = 0.01


def fused_supported_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: the fused kernels existed for CUDA only
        return ["cuda"]


def check_fused_supported(params: Sequence[torch.Tensor], name: str = "fused_adamw") -> None:
    """Raise UnsupportedOptimizer (with the reason) when torch has no fused AdamW for these parameters."""
    devices = fused_supported_devices()
    for i, p in enumerate(params):
        if p.device.type not in devices:
            raise UnsupportedOptimizer(
                f"{name}: torch has no fused AdamW kernel for device {p.device.type!r} "
                f"(parameter {i}, shape {tuple(p.shape)}); fused kernels exist for: {', '.join(devices)}"
            )
        if not torch.is_floating_point(p):
            raise UnsupportedOptimizer(f"{name}: parameter {i} has dtype {p.dtype}; fused AdamW needs floats")


def build_adamw(
    params,
    lr: float = 1e-3,
    betas: tuple[float, float] = BETAS,
    eps: float = EPS,
    weight_decay: float = WEIGHT_DECAY,
    fused: bool | None = None,
    foreach: bool | None = None,
    name: str = "adamw",
    capturable: bool = False,
) -> torch.optim.AdamW:
    """torch's AdamW with the reference's defaults; capturable=True keeps its step counts on the device so
    that a CUDA graph can capture its step (models.captured)."""
    check_common(name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    params = list(params)
    if fused:
        flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
        check_fused_supported(flat, name)
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused, foreach=foreach,
        capturable=capturable,
    )


def foreach_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over lists, in torch's order of operations (step is the 1-based count after it)."""
    if not params:
        return
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def dense_grads(name: str, params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(params with a gradient, their gradients); a sparse gradient is an error naming the parameter."""
    with_grad, grads = [], []
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            raise OptimizerError(
                f"{name}: parameter {i} (shape {tuple(p.shape)}) has a sparse gradient; dense optimizers "
                "take dense gradients only: give embedding tables to sparse_adagrad"
            )
        with_grad.append(p)
        grads.append(g)
    return with_grad, grads
