"""Where the models call the kernels: RMSNorm, LayerNorm, attention and the embedding-bag mean, each on the
backend its model config names. "torch" runs locally (the models' reference numerics); "triton" and
"tilelang" go to `pcvr_lib.kernels`. Every backend switch of the models is here.

The kernels are looked up on the `pcvr_lib.kernels` package at each call rather than bound at import, so
that `kernel_variants.Recorder`, which replaces them on the package, sees every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib import kernels
from pcvr_lib.kernels.attention import RoleMask
from pcvr_lib.kernels.attention.masks import INVALID_KEY
from pcvr_lib.models.sequences import masked_mean
from pcvr_lib.models.tables import bag_mean_of_table, field_means_of_table


# ------------------------------------------------------------------------------------------------ norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dim. The torch backend is torch's fused F.rms_norm (the weight in x's dtype, so
    that bf16 activations under autocast keep the fused kernel), the fastest torch has, rather than the
    original tooling's eager fp32 formula (several kernels; kept as `kernels.norms.rms_norm_formula`)."""
    if backend == "torch":
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    return kernels.rms_norm(x, weight.to(x.dtype), eps, backend=backend)  # the kernels take one dtype


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale, on `backend` (`rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose forward runs `pcvr_lib.kernels.layer_norm` with the model's norm backend (same
    parameters and state-dict keys, so checkpoints do not depend on the backend). The kernels take one
    dtype: under bf16 autocast a bf16 input meets the parameters cast to bf16 and gives a bf16 output (the
    kernels accumulate in fp32), where torch's layer_norm would compute and return fp32."""

    backend: str = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return super().forward(x)
        return kernels.layer_norm(x, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps, backend=self.backend)


def route_layer_norms(model: nn.Module, backend: str) -> None:
    """Make every affine nn.LayerNorm over one dimension in `model` a `LayerNorm` on `backend`, in place
    (the models build plain nn.LayerNorm; `build_model` calls this). Parameters and hooks are unchanged."""
    for parent in model.modules():
        for child in parent.children():
            if type(child) is nn.LayerNorm and child.elementwise_affine and child.bias is not None \
                    and len(child.normalized_shape) == 1:
                child.__class__ = LayerNorm  # same attributes and parameters; only forward differs
            if isinstance(child, LayerNorm):
                child.backend = backend


# -------------------------------------------------------------------------------------------- attention
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_lengths: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    global_last: bool = False,
    mask: torch.Tensor | None = None,
    role_mask=None,
    backend: str = "torch",
) -> torch.Tensor:
    """Multi-head attention on (B, H, S, D) tensors.

    key_lengths [B]: keys at positions >= length are padding (prefix-valid; a length of 0 counts as 1).
    causal: query i sees keys <= i. Outputs at padded query positions (>= length) are unspecified and
    never read by the models; the explicit mask lets a padded query see itself so that no row is empty.
    window: sliding window, query i sees keys in (i - window, i]. global_last: the last valid query of
    each row (the target token) sees every valid key regardless of causal/window.
    mask: a precomputed `attention_mask(...)` (or its additive form) of exactly these arguments, or a role
    rule's mask (`role_attention_masks`); a model with several layers builds it once per forward; torch
    backend only. role_mask: `kernels.attention.role_mask(roles, visibility, key_valid)`, the same role rule
    for the kernels (self-attention, no key lengths); other backends only.
    """
    if backend != "torch":
        if mask is not None:
            raise ValueError(f"attention backend {backend!r}: a precomputed mask tensor is for the torch backend; "
                             "pass role_mask= (or the key lengths / window arguments) instead")
        if not q.dtype == k.dtype == v.dtype:  # the kernels take one dtype (under autocast a projection may be
            # bf16 beside an fp32 tensor); the widest, as torch's type promotion would give
            dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if role_mask is not None:
            return kernels.flash_attention(q, k, v, role_mask=role_mask, backend=backend)
        if key_lengths is not None:  # the kernels' length 0 gives zeros; here it counts as 1 (as on torch)
            key_lengths = key_lengths.clamp(min=1)
        if window is not None:
            if not causal or key_lengths is None:
                raise ValueError("attention: a sliding window needs causal=True and key_lengths")
            # the kernels' window mode: causal window over valid queries, the last G = 1 valid query global
            return kernels.flash_attention(q, k, v, key_lengths=key_lengths, window=window,
                                           global_queries=1 if global_last else 0, backend=backend)
        # without a window the last valid query already sees every valid key under causal_valid
        return kernels.flash_attention(
            q, k, v, key_lengths=key_lengths, causal=causal, causal_valid=causal and key_lengths is not None,
            backend=backend,
        )
    if role_mask is not None:
        raise ValueError("attention backend 'torch': pass the role mask as mask= (a boolean or additive tensor)")
    if mask is None and causal and window is None and q.shape[2] == k.shape[2]:
        # prefix-valid keys under a causal mask: a valid query i < length only sees keys <= i, all valid,
        # so the key-length mask changes nothing it computes (and the target token, the last valid one,
        # already sees every valid key). Padded queries' outputs are never read. SDPA's causal path needs
        # no mask tensor and is the fastest on CPU.
        return _sdpa(q, k, v, None, causal=True)
    if mask is None:
        target = None
        if global_last and key_lengths is not None:
            target = key_lengths.to(device=q.device, dtype=torch.long).clamp(min=1) - 1
        mask = attention_mask(q.shape[0], q.shape[2], k.shape[2], q.device, key_lengths, causal, window, target)
    return _sdpa(q, k, v, mask)


def _sdpa(q, k, v, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """SDPA with an additive mask cast to the dtype it computes in. On a CPU, half-precision inputs compute in
    fp32 and come back in their own dtype, and under autocast no input is lowered to bf16: there SDPA's bf16
    backward is about 2.7x slower than its fp32 one (notes/models.md), and attention is a small part of a
    step's FLOPs."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    outside_autocast = q.device.type == "cpu" and (half or torch.is_autocast_enabled("cpu"))
    compute = torch.float32 if outside_autocast and half else q.dtype  # elsewhere a mask follows q's dtype
    if mask is not None and mask.dtype != torch.bool and mask.dtype != compute:
        mask = mask.to(compute)
    if not outside_autocast:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.to(compute), k.to(compute), v.to(compute), attn_mask=mask,
                                             is_causal=causal)
    return out.to(q.dtype)


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A boolean attention mask as 0 / -inf (SDPA on CPU runs about 25% faster with it, built once)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_mask(
    batch: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    key_lengths: torch.Tensor | None,
    causal: bool,
    window: int | None,
    global_query: torch.Tensor | None,
) -> torch.Tensor | None:
    """Boolean mask [B or 1, 1, Sq, Sk], True = attend; None when nothing is masked."""
    if key_lengths is None and not causal and window is None:
        return None
    if not causal and window is None and global_query is None:
        # key padding only: one [B, 1, 1, Sk] row broadcast over the queries
        ki = torch.arange(k_len, device=device)
        return (ki[None] < key_lengths.to(device=device, dtype=torch.long).clamp(min=1)[:, None])[:, None, None]
    qi = torch.arange(q_len, device=device)[:, None]
    ki = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(1, q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask = mask & (ki <= qi)
    if window is not None:
        mask = mask & (ki > qi - window)
    if key_lengths is not None:
        lengths = key_lengths.to(device=device, dtype=torch.long).clamp(min=1)
        valid = ki[None] < lengths[:, None, None]  # [B, 1, Sk]
        mask = mask & valid
        if global_query is not None:
            is_global = qi[None] == global_query.to(device=device, dtype=torch.long)[:, None, None]
            mask = mask | (is_global & valid)
        if q_len == k_len:  # padded queries attend to themselves so that no row is empty
            mask = mask | ((qi == ki)[None] & ~(qi[None] < lengths[:, None, None]))
    elif global_query is not None:
        mask = mask | (qi[None] == global_query.to(device=device, dtype=torch.long)[:, None, None])
    return mask[:, None]


def role_attention_masks(roles: torch.Tensor, visibility: torch.Tensor, pairs: torch.Tensor, key_valid: torch.Tensor,
                         backend: str, dtype: torch.dtype, words: torch.Tensor) -> dict[str, Any]:
    """The `attention()` mask arguments of a role rule, built once per forward for every layer: query role r
    sees key role s where visibility[r, s], and only valid keys; every token sees itself.

    roles [T] (role id per token), visibility [R, R] bool, pairs [T, T] = visibility[roles][:, roles] and
    words = `static_role_words(roles, visibility)` (the model keeps both), key_valid [B, T]. torch: {"mask":
    additive [B, 1, T, T]} (faster SDPA on CPU); kernels: {"role_mask": RoleMask}: role codes + visibility
    words + key validity, no (B, T, T) tensor. The layout was checked and packed once by `static_role_words`,
    so per batch only the key validity is added: no host read and no host-to-device copy (a step that can be
    captured in a CUDA graph).
    """
    if backend == "torch":
        eye = torch.eye(pairs.shape[0], dtype=torch.bool, device=key_valid.device)
        allowed = ((pairs[None] & key_valid[:, None, :]) | eye[None])[:, None]
        return {"mask": additive_mask(allowed, dtype)}
    batch_roles = roles.expand(key_valid.shape[0], -1)
    codes = roles.to(torch.int32) | (~key_valid).to(torch.int32) * INVALID_KEY  # RoleMask.codes' packing
    return {"role_mask": RoleMask(codes.contiguous(), words, batch_roles, visibility, key_valid)}


def static_role_words(roles: torch.Tensor, visibility: torch.Tensor) -> torch.Tensor:
    """The kernels' visibility words of a model's fixed role layout (roles [T], visibility [R, R] bool),
    checked and packed by `kernels.attention.role_mask`; built once, with the model."""
    return kernels.attention.role_mask(roles[None], visibility).words


# -------------------------------------------------------------------------------------- embedding bags
def bag_mean(table: nn.Embedding, rows: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """[..., L] table rows (0 = padding / no id) -> [..., E]: the mean embedding of each bag's non-zero
    rows, 0 for an empty bag."""
    if backend == "torch":
        return masked_mean(table(rows), rows > 0, dim=-2)
    mean = bag_mean_of_table(table, rows.reshape(-1, rows.shape[-1]), backend)
    return mean.view(*rows.shape[:-1], table.embedding_dim)


def field_means(table: nn.Embedding, rows: torch.Tensor, slot_feature: torch.Tensor, n_features: int,
                bags: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Per feature the mean embedding of its non-zero slots: rows [..., D] (the table rows of D id slots,
    0 = no id) -> [..., n_features, E], 0 for a feature without ids.

    slot_feature [D]: the feature of each slot; bags [n_features, width]: each feature's slots padded with
    slot D (a zero column). torch: one lookup, then index_add sums and counts; other backends: one bag per
    (row, feature) (`tables.field_means_of_table`).
    """
    if backend != "torch":
        return field_means_of_table(table, rows, slot_feature, n_features, bags, backend)
    emb = table(rows)  # [..., D, E]
    axis = rows.dim() - 1
    summed = emb.new_zeros(*rows.shape[:-1], n_features, emb.shape[-1]).index_add(axis, slot_feature, emb)
    present = (rows > 0).to(emb.dtype)
    counts = present.new_zeros(*rows.shape[:-1], n_features).index_add(axis, slot_feature, present)
    return summed / counts.clamp(min=1)[..., None]
