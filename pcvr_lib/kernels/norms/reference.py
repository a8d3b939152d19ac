"""The norms' numerics references: fp64 RMSNorm and LayerNorm (what every backend is checked against), and
the original tooling's eager RMSNorm formula (the models' numerics reference, several kernels in fp32)."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp64 RMSNorm (on whatever device and with whatever autograd the inputs carry)."""
    xd, wd = x.double(), weight.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wd


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5):
    """fp64 LayerNorm (biased variance, as F.layer_norm)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = (xd - mean).pow(2).mean(-1, keepdim=True)
    return (xd - mean) * torch.rsqrt(var + eps) * weight.double() + bias.double()


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The eager formula of the original tooling, upcast to fp32 (several kernels and fp32 temporaries)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)
