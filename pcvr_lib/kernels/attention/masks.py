"""Mask modes, the dropout hash and the key-padding helper shared by every attention backend.

Which key j a query i may attend to, with L the sequence's key length (Skv when there are no lengths):

- none:          every j < Skv
- key_lengths:   j < L
- causal:        j <= i (top-left aligned, like SDPA's `is_causal` when Sq != Skv), and j < L
- causal_valid:  (j <= i and i < L) or j == i: valid queries see the valid past, a padded query
                 (i >= L) sees only itself, so no row of a self-attention block is empty
- window:        causal_valid restricted to the last W keys, plus G global queries (tokenformer):
                 (i < L and j <= i and i - j < W) or (L - G <= i < L and j < L) or j == i. The last G valid
                 queries (the target token, G = 1) see every valid key; with G = 1 that is the causal past
                 without the window.
- roles:         a per-token role id r[b, t] in [0, R) and a role-visibility matrix V (R x R, bool), with
                 key validity k[b, t] (symbiosis; self-attention, Sq == Skv):
                 (V[r[b, i], r[b, j]] and k[b, j]) or j == i. The diagonal keeps every row non-empty (it
                 replaces symbiosis' "safe mask", which unmasks key 0 of a row with no valid key).

A row that can see no key (L == 0, or a padded query beyond Skv) returns zeros, with zero gradients.

Dropout keeps the attention weight P[b, h, i, j] when `hash(seed, b*H + h, i*Skv + j) >> 8 >= threshold`,
threshold = round(p * 2**24), and scales kept weights by 1/(1-p). The hash is a 32-bit integer mix, so
every backend (and the test reference, through `dropout_keep_mask`) draws the very same keep mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("none", "key_lengths", "causal", "causal_valid", "window", "roles")
# the kernels' compile-time mask code (key lengths are a separate flag, so "none" and "key_lengths" share 1)
MODE_CODE = {"none": 1, "key_lengths": 1, "causal": 2, "causal_valid": 3, "window": 4, "roles": 5}
MAX_ROLES = 16  # roles are bits of one int32 visibility word per query role in the kernels
INVALID_KEY = 32  # role code bit of a padded key (role_codes): no visibility bit reaches it


def length_bucket(s: int) -> int:
    """Sequence-length bucket of the tile configs (Sq <= 128, <= 512, longer): lengths inside one bucket
    share a compiled kernel, so they never recompile."""
    return 0 if s <= 128 else (1 if s <= 512 else 2)

# constants of the 32-bit mixer (all below 2**31 so that Triton keeps the arithmetic in uint32)
_STREAM = 0x61C88647
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_MASK32 = 0xFFFFFFFF


def mode_name(key_lengths, causal: bool, causal_valid: bool, window=None, roles=None) -> str:
    if roles is not None:
        return "roles"
    if window is not None:
        return "window"
    if causal_valid:
        return "causal_valid" if key_lengths is not None else "causal"
    if causal:
        return "causal"
    return "key_lengths" if key_lengths is not None else "none"


def allowed_mask(batch: int, sq: int, skv: int, key_lengths: torch.Tensor | None, causal: bool,
                 causal_valid: bool, device, window: int | None = None, n_global: int = 0,
                 roles: torch.Tensor | None = None, role_visibility: torch.Tensor | None = None,
                 key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (B, 1, Sq, Skv): True where query i may attend to key j (the definitions above). This is
    the (B, S, S) tensor the kernels never build: the torch backend and the tests use it."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    if roles is not None:
        r = roles.to(device=device, dtype=torch.long)
        vis = role_visibility.to(device=device, dtype=torch.bool)
        allowed = vis[r[:, :, None], r[:, None, :]][:, None]  # (B, 1, S, S)
        if key_valid is not None:
            allowed = allowed & key_valid.to(device=device, dtype=torch.bool)[:, None, None, :]
        return allowed | (j == i)
    if key_lengths is None:
        lengths = torch.full((batch, 1, 1, 1), skv, device=device, dtype=torch.long)
    else:
        lengths = key_lengths.to(device=device, dtype=torch.long).clamp(min=0).view(batch, 1, 1, 1)
    if window is not None:
        valid_row = i < lengths
        in_window = (j <= i) & (i - j < window) & valid_row
        is_global = valid_row & (i >= lengths - n_global) & (j < lengths)
        return in_window | is_global | (j == i)
    if causal_valid and key_lengths is not None:
        return ((j <= i) & (i < lengths)) | (j == i)
    allowed = j < lengths
    if causal or causal_valid:
        allowed = allowed & (j <= i)
    return allowed.expand(batch, 1, sq, skv)


@dataclass(frozen=True)
class StructuredMask:
    """The arguments of a mask that key lengths cannot describe, as the kernels take them: tokenformer's window
    (`window` keys, `global_queries` global last queries) or symbiosis' roles (`codes` (B, S) int32 and the
    visibility `words` (32,) int32 of a RoleMask). Fields a mask does not use stay 0 / None."""

    window: int = 0
    global_queries: int = 0
    codes: torch.Tensor | None = None
    words: torch.Tensor | None = None


NO_STRUCTURE = StructuredMask()


@dataclass(frozen=True)
class RoleMask:
    """The roles mask of one batch, built once by `role_mask` (checked there) and passed to every layer.

    codes: int32 (B, S), the role id plus INVALID_KEY where the key is padding (what the kernels read);
    words: int32 (32,), bit s of word r set when role r sees role s (zero words past R);
    roles, visibility, key_valid: the inputs, for the torch backend's boolean mask.
    """

    codes: torch.Tensor
    words: torch.Tensor
    roles: torch.Tensor
    visibility: torch.Tensor
    key_valid: torch.Tensor | None


def role_mask(roles: torch.Tensor, role_visibility: torch.Tensor, key_valid: torch.Tensor | None = None) -> RoleMask:
    """Check and pack a roles mask: roles (B, S) integer ids in [0, R), role_visibility (R, R) bool
    (row: the query's role, column: the key's), key_valid (B, S) bool (True: a real token) or None.
    The value check costs one device sync: build the mask once per batch, not per layer (under torch.compile it
    is left out)."""
    where = "role_mask"
    if not isinstance(roles, torch.Tensor) or roles.dim() != 2 or roles.dtype.is_floating_point or \
            roles.dtype == torch.bool:
        got = f"{roles.dtype} {tuple(roles.shape)}" if isinstance(roles, torch.Tensor) else type(roles).__name__
        raise ValueError(f"{where}: roles must be an integer tensor of shape (B, S), got {got}")
    if not isinstance(role_visibility, torch.Tensor) or role_visibility.dtype != torch.bool or \
            role_visibility.dim() != 2 or role_visibility.shape[0] != role_visibility.shape[1]:
        got = (f"{role_visibility.dtype} {tuple(role_visibility.shape)}" if isinstance(role_visibility, torch.Tensor)
               else type(role_visibility).__name__)
        raise ValueError(f"{where}: role_visibility must be a square bool tensor (R, R), got {got}")
    R = role_visibility.shape[0]
    if not 1 <= R <= MAX_ROLES:
        raise ValueError(f"{where}: at most {MAX_ROLES} roles are supported, role_visibility is {R} x {R}")
    if key_valid is not None and (not isinstance(key_valid, torch.Tensor) or key_valid.dtype != torch.bool
                                  or key_valid.shape != roles.shape):
        got = f"{key_valid.dtype} {tuple(key_valid.shape)}" if isinstance(key_valid, torch.Tensor) else "?"
        raise ValueError(f"{where}: key_valid must be a bool tensor shaped like roles {tuple(roles.shape)}, got {got}")
    for name, t in (("role_visibility", role_visibility), ("key_valid", key_valid)):
        if t is not None and t.device != roles.device:
            raise RuntimeError(f"{where}: {name} on {t.device}, roles on {roles.device}")
    if roles.numel() and not torch.compiler.is_compiling():  # (compiled: no host read; the shapes are checked)
        lo, hi = int(roles.min()), int(roles.max())
        if lo < 0 or hi >= R:
            raise ValueError(f"{where}: role ids must be in [0, {R}) (role_visibility is {R} x {R}), got {lo}..{hi}")
    codes = roles.to(torch.int32)
    if key_valid is not None:
        codes = codes | (~key_valid).to(torch.int32) * INVALID_KEY
    weights = torch.tensor([1 << s for s in range(R)], dtype=torch.int64, device=roles.device)
    words = torch.zeros(32, dtype=torch.int32, device=roles.device)
    words[:R] = (role_visibility.to(torch.int64) * weights).sum(1).to(torch.int32)
    return RoleMask(codes.contiguous(), words, roles, role_visibility, key_valid)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit mixer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def dropout_threshold(p: float) -> int:
    """The kernels' integer keep threshold: keep when hash >> 8 >= round(p * 2^24)."""
    return int(round(p * (1 << 24)))


LOG2E = 1.4426950408889634  # every backend keeps scores in base 2: qk_scale = scale * log2(e)


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
