"""The torch backend: SDPA with the boolean mask equivalent to the mode (masks.py), no-key rows zeroed.

Without dropout this is `F.scaled_dot_product_attention` (PyTorch picks flash/efficient/cuDNN/math).
With dropout SDPA's own random stream cannot be given a keep mask, so the torch backend then computes
softmax(QK^T) * keep / (1-p) @ V explicitly, like SDPA's math path (matmuls in the input dtype, fp32
softmax), with the shared keep mask: all backends drop the same weights for the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .masks import allowed_mask, dropout_keep_mask


def attention(q, k, v, key_lengths, causal: bool, causal_valid: bool, scale: float, seed: int | None,
              dropout_p: float, window: int | None = None, global_queries: int = 0, role_mask=None) -> torch.Tensor:
    B, H, Sq, _ = q.shape
    Skv = k.shape[2]
    if dropout_p == 0.0 and key_lengths is None and window is None and role_mask is None:
        # no padding: a causal row always sees key 0, so no row is empty (unless Skv == 0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal or causal_valid, scale=scale)
    rm = role_mask
    allowed = allowed_mask(B, Sq, Skv, key_lengths, causal, causal_valid, q.device, window, global_queries,
                           rm.roles if rm else None, rm.visibility if rm else None, rm.key_valid if rm else None)
    has_key = allowed.any(dim=-1, keepdim=True)
    # an empty row may see every key (any finite result) and is zeroed after: no NaN in either pass
    mask = allowed | ~has_key
    if dropout_p == 0.0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        # as SDPA's math path: matmuls in the input dtype, softmax in fp32
        scores = torch.matmul(q * scale, k.transpose(-1, -2))
        probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        keep = dropout_keep_mask(seed, B, H, Sq, Skv, dropout_p, q.device)
        probs = probs * (keep / (1.0 - dropout_p)).to(q.dtype)
        out = torch.matmul(probs, v)
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
