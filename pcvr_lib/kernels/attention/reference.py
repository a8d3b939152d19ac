"""fp64 attention with the masks of masks.py: what every backend is checked against."""

from __future__ import annotations

import math

import torch

from pcvr_lib.kernels.attention.masks import allowed_mask


def reference_mask(B: int, Sq: int, Skv: int, kw: dict) -> torch.Tensor:
    """The boolean (B, 1, Sq, Skv) mask equivalent to flash_attention's mask keyword arguments `kw`."""
    rm = kw.get("role_mask")
    return allowed_mask(B, Sq, Skv, kw.get("key_lengths"), kw.get("causal", False), kw.get("causal_valid", False),
                        "cpu" if rm is None else rm.codes.device, kw.get("window"), kw.get("global_queries", 0),
                        rm.roles if rm else None, rm.visibility if rm else None, rm.key_valid if rm else None)


def reference(q, k, v, key_lengths, causal, causal_valid, keep=None, p=0.0, mask=None) -> torch.Tensor:
    """fp64 attention with the mask of masks.py, where the inputs live, one batch row at a time (the score
    matrix of one row only); rows without a key are zeros. `keep`: dropout's keep mask with rate p.
    `mask`: a boolean (B, 1, Sq, Skv) mask (reference_mask) instead of key_lengths/causal/causal_valid."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    outs = []
    for b in range(B):
        if mask is not None:
            allowed = mask[b:b + 1].to(q.device)
        else:
            kl = key_lengths[b:b + 1] if key_lengths is not None else None
            allowed = allowed_mask(1, Sq, Skv, kl, causal, causal_valid, q.device)
        scores = torch.matmul(q[b:b + 1].double(), k[b:b + 1].double().transpose(-1, -2)) / math.sqrt(D)
        has_key = allowed.any(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0), dim=-1)
        probs = probs * has_key
        if keep is not None:
            probs = probs * keep[b:b + 1] / (1.0 - p)
        outs.append(torch.matmul(probs, v[b:b + 1].double()))
    return torch.cat(outs)
