"""The norms' numerics references: fp64 RMSNorm and LayerNorm (what every backend is checked against)."""

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

