"""Mask modes, the dropout hash and the key-padding helper shared by every attention backend.

Which key j a query i may attend to, with L the sequence's key length (Skv when there are no lengths):

- none:          every j < Skv
- key_lengths:   j < L
- causal:        j <= i (top-left aligned, like SDPA's `is_causal` when Sq != Skv), and j < L
- causal_valid:  (j <= i and i < L) or j == i: valid queries see the valid past, a padded query
                 (i >= L) sees only itself, so no row of a self-attention block is empty

A row that can see no key (L == 0, or a padded query beyond Skv) returns zeros, with zero gradients.

Dropout keeps the attention weight P[b, h, i, j] when `hash(seed, b*H + h, i*Skv + j) >> 8 >= threshold`,
threshold = round(p * 2**24), and scales kept weights by 1/(1-p). The hash is a 32-bit integer mix, so
every backend (and the test reference, through `dropout_keep_mask`) draws the very same keep mask.
"""

from __future__ import annotations

import torch

MODES = ("none", "key_lengths", "causal", "causal_valid")
# the kernels' compile-time mask code (key lengths are a separate flag, so "none" and "key_lengths" share 1)
MODE_CODE = {"none": 1, "key_lengths": 1, "causal": 2, "causal_valid": 3}


def length_bucket(s: int) -> int:
    """Sequence-length bucket of the tile configs (Sq <= 128, <= 512, longer): lengths inside one bucket
    share a compiled kernel, so they never recompile."""
    return 0 if s <= 128 else (1 if s <= 512 else 2)

# constants of the 32-bit mixer (all below 2**31 so that Triton keeps the arithmetic in uint32)
_STREAM = 0x61C88647
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_MASK32 = 0xFFFFFFFF


def mode_name(key_lengths, causal: bool, causal_valid: bool) -> str:
    if causal_valid:
        return "causal_valid" if key_lengths is not None else "causal"
    if causal:
        return "causal"
    return "key_lengths" if key_lengths is not None else "none"


def allowed_mask(batch: int, sq: int, skv: int, key_lengths: torch.Tensor | None, causal: bool,
                 causal_valid: bool, device) -> torch.Tensor:
    """Boolean (B, 1, Sq, Skv): True where query i may attend to key j (the definitions above)."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    if key_lengths is None:
        lengths = torch.full((batch, 1, 1, 1), skv, device=device, dtype=torch.long)
    else:
        lengths = key_lengths.to(device=device, dtype=torch.long).clamp(min=0).view(batch, 1, 1, 1)
    if causal_valid and key_lengths is not None:
        return ((j <= i) & (i < lengths)) | (j == i)
    allowed = j < lengths
    if causal or causal_valid:
        allowed = allowed & (j <= i)
    return allowed.expand(batch, 1, sq, skv)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit mixer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def dropout_threshold(p: float) -> int:
    return int(round(p * (1 << 24)))


def dropout_keep_mask(seed: int, batch: int, heads: int, sq: int, skv: int, p: float, device="cpu") -> torch.Tensor:
    """Boolean (B, H, Sq, Skv): which attention weights the kernels keep for this seed and rate."""
    bh = torch.arange(batch * heads, device=device, dtype=torch.long).view(batch, heads, 1, 1)
    stream = _mix32(((seed & _MASK32) + bh * _STREAM) & _MASK32)
    i = torch.arange(sq, device=device, dtype=torch.long).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device, dtype=torch.long).view(1, 1, 1, skv)
    counter = (i * skv + j) & _MASK32
    return (_mix32(counter ^ stream) >> 8) >= dropout_threshold(p)


def draw_seed(generator: torch.Generator | None) -> int:
    """A 31-bit seed from `generator` (torch's default CPU generator when None).

    A CUDA generator works too but costs a device sync; a CPU generator is the cheap choice.
    """
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device).item())


def key_lengths_from_mask(mask: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Key lengths (int32, shape (B,)) from a boolean key-padding mask (B, S), True = valid key.

    The mask must be prefix-valid (each row: True...True False...False); with `check` (the default) a
    ValueError names the first row that is not. The check costs one device sync; pass check=False on a
    hot path once the data is known to be left-aligned.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_lengths_from_mask: mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"key_lengths_from_mask: mask must have shape (B, S), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_lengths_from_mask: mask must be boolean (True = valid key), got {mask.dtype}")
    lengths = mask.sum(dim=1, dtype=torch.int32)
    if check:
        prefix = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
        bad_rows = (prefix != mask).any(dim=1)
        if bool(bad_rows.any()):
            row = int(bad_rows.nonzero()[0, 0])
            raise ValueError(
                f"key_lengths_from_mask: row {row} of the key-padding mask is not prefix-valid (valid keys "
                f"must come first, padding after): {mask[row].int().tolist()[:32]}"
            )
    return lengths
