"""flash_attention: scaled dot-product attention with PCVR masks; torch (SDPA), triton and tilelang backends.

    out = flash_attention(q, k, v, key_lengths=lengths, causal=False, causal_valid=False,
                          window=None, global_queries=0, role_mask=None,
                          dropout_p=0.0, training=False, scale=None, generator=None, backend="triton")

q (B, H, Sq, D), k and v (B, H, Skv, D), D in {16, 32, 48, 64, 128} (48 runs padded to 64 in the kernels);
Sq may differ from Skv. `window=W` (with `global_queries=G` and optional key lengths) is tokenformer's causal
sliding window with global last queries; `role_mask=role_mask(roles, visibility, key_valid)` is symbiosis'
role rule (self-attention; no key lengths with it). Neither builds a (B, S, S) mask in the kernels. Mask
modes and the
dropout keep rule are defined in masks.py (key lengths are per batch row, int32 preferred; longer than Skv
means all keys). fp16 and bf16 run natively; fp32 inputs are computed in bf16 and the output returned as
fp32 (documented precision: bf16). Rows with no visible key return zeros. Dropout applies only with
training=True; its seed is drawn from `generator` (torch's default CPU generator when None), so a seeded
generator reproduces the call exactly on every backend. Under CUDA graph capture dropout is refused with a
ValueError (the host-drawn seed would be baked into the graph: every replay the same mask); without dropout the
whole forward + backward of the triton and tilelang backends captures and replays (no host sync, no CPU
tensor, no per-call host state; accuracy_tests/test_attention_graph.py).

Host path: one dict lookup per backend, shape/dtype checks, one kernel launch forward (no device sync);
backward is two launches, one for Triton where Sq, Skv <= 128 (its one-tile backward, routed per head dim by
config.TRITON_ONE_TILE_DEFAULT_DIMS: 16, 32, 64 and 128). Triton with
Sq > 512 (masks none / key lengths / causal / causal-valid) runs triton_long's kernels, whose backward sums
dQ with fp32 atomics: not bitwise deterministic there.
Compiled kernels are cached by (dtype, head dim, mask mode, dropout, bucket of the
sequence length), so a new length inside a bucket does not recompile.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import registry
from .masks import (
    MODES,
    RoleMask,
    allowed_mask,
    draw_seed,
    dropout_keep_mask,
    key_lengths_from_mask,
    mode_name,
    role_mask,
)

__all__ = [
    "flash_attention", "key_lengths_from_mask", "allowed_mask", "dropout_keep_mask", "role_mask", "RoleMask",
    "MODES", "OP", "BACKENDS",
]

OP = "flash_attention"
BACKENDS = ("torch", "triton", "tilelang")
HEAD_DIMS = (16, 32, 48, 64, 128)
_PADDED = {48: 64}  # head dims the kernels run zero-padded (a power of two per tile row)
_HALF = (torch.float16, torch.bfloat16)


def _tilelang_problem(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "needs an sm_80 or newer GPU"
    return None


registry.register_op(OP, {"torch": None, "triton": None, "tilelang": _tilelang_problem})

_CUDA_IMPLS: dict = {}  # backend -> implementation, once its availability on CUDA was checked
_TORCH = "torch"


def _impl(backend: str, device: torch.device):
    """The backend's implementation (module with forward/backward, or _TORCH) after checking it can run.

    On CUDA the check runs once per backend (later calls hit _CUDA_IMPLS); CPU tensors are re-checked at
    every call (only the torch backend, and triton under TRITON_INTERPRET=1 for tests, run on them).
    """
    registry.validate_backend(OP, backend)
    if device.type != "cuda" and backend != "torch":
        if not (backend == "triton" and registry.triton_interpret_enabled()):
            raise RuntimeError(f"{OP} requires CUDA tensors for backend {backend!r} (got {device})")
    registry.require_backend(OP, backend, device)
    if backend == "triton":
        from . import triton_impl as impl
    elif backend == "tilelang":
        from . import tilelang_impl as impl
    else:
        impl = _TORCH
    if device.type == "cuda":
        _CUDA_IMPLS[backend] = impl
    return impl


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_lengths, mode, scale, seed, dropout_p, impl, extra):
        o, lse = impl.forward(q, k, v, key_lengths, mode, scale, seed, dropout_p, True, extra=extra)
        ctx.save_for_backward(q, k, v, o, lse, key_lengths)
        ctx.args = (mode, scale, seed, dropout_p, impl, extra)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_lengths = ctx.saved_tensors
        mode, scale, seed, dropout_p, impl, extra = ctx.args
        dq, dk, dv = impl.backward(do, q, k, v, o, lse, key_lengths, mode, scale, seed, dropout_p, extra=extra)
        return dq, dk, dv, None, None, None, None, None, None, None


_OK_DTYPES = registry.FLOAT_DTYPES  # float16, bfloat16, float32


def _check(q, k, v, key_lengths) -> None:
    """Validate one call; the common valid case costs a few attribute reads (hot path)."""
    try:
        B, H, _, D = q.shape
        Bk, Hk, _, Dk = k.shape
        dev = q.get_device()
        ok = (v.shape == k.shape and Bk == B and Hk == H and Dk == D and D in HEAD_DIMS
              and q.dtype == k.dtype == v.dtype and q.dtype in _OK_DTYPES
              and k.get_device() == dev and v.get_device() == dev)
        if ok and key_lengths is not None:
            ok = (key_lengths.dtype == torch.int32 and key_lengths.shape == (B,)
                  and key_lengths.get_device() == dev)
    except (AttributeError, ValueError, TypeError):
        ok = False
    if not ok:
        _explain(q, k, v, key_lengths)


def _explain(q, k, v, key_lengths) -> None:
    """The slow path of _check: raise the precise error (or return for valid non-int32 key lengths)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{OP}: {name} must have shape (B, H, S, D), got {tuple(t.shape)}")
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(f"{OP}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(k and v must be (B, H, Skv, D) with q's B, H and D)")
    if D not in HEAD_DIMS:
        raise ValueError(f"{OP}: head dim {D} not supported (supported: {HEAD_DIMS})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{OP}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _OK_DTYPES:
        raise TypeError(f"{OP}: dtype {q.dtype} not supported (float16, bfloat16, float32)")
    if not (q.device == k.device == v.device):
        raise RuntimeError(f"{OP}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor) or key_lengths.shape != (B,):
            got = tuple(key_lengths.shape) if isinstance(key_lengths, torch.Tensor) else type(key_lengths).__name__
            raise ValueError(f"{OP}: key_lengths must be a tensor of shape ({B},), got {got}")
        if key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool:
            raise TypeError(f"{OP}: key_lengths must be integer, got {key_lengths.dtype} "
                            "(use key_lengths_from_mask for a boolean padding mask)")
        if key_lengths.device != q.device:
            raise RuntimeError(f"{OP}: key_lengths on {key_lengths.device}, q on {q.device}")


def _check_masks(q, k, key_lengths, window, global_queries, rmask) -> None:
    """The window and roles arguments (only read when one is given)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{OP}: window must be an int >= 1 (keys (i - window, i] are visible), got {window!r}")
        if rmask is not None:
            raise ValueError(f"{OP}: window and role_mask cannot be combined")
    if isinstance(global_queries, bool) or not isinstance(global_queries, int) or global_queries < 0:
        raise ValueError(f"{OP}: global_queries must be an int >= 0, got {global_queries!r}")
    if global_queries and window is None:
        raise ValueError(f"{OP}: global_queries={global_queries} needs a window (without one every valid "
                         "query already sees its whole causal past)")
    if rmask is not None:
        if not isinstance(rmask, RoleMask):
            raise TypeError(f"{OP}: role_mask must come from role_mask(roles, visibility, key_valid), "
                            f"got {type(rmask).__name__}")
        if key_lengths is not None:
            raise ValueError(f"{OP}: role_mask carries its own key validity; do not pass key_lengths with it")
        B, _, Sq, _ = q.shape
        if Sq != k.shape[2] or rmask.codes.shape != (B, Sq):
            raise ValueError(f"{OP}: role_mask is for self-attention: roles {tuple(rmask.codes.shape)} must be "
                             f"(B, S) = ({B}, {Sq}) with Sq == Skv (got Sq {Sq}, Skv {k.shape[2]})")
        if rmask.codes.device != q.device:
            raise RuntimeError(f"{OP}: role_mask on {rmask.codes.device}, q on {q.device}")


def flash_attention(q, k, v, *, key_lengths=None, causal=False, causal_valid=False, window=None,
                    global_queries=0, role_mask=None, dropout_p=0.0, training=False, scale=None, generator=None,
                    backend="torch"):
    """softmax(q k^T * scale + mask) [dropout] @ v; see the module docstring for the contract."""
    _check(q, k, v, key_lengths)
    if window is not None or role_mask is not None or global_queries:
        _check_masks(q, k, key_lengths, window, global_queries, role_mask)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{OP}: dropout_p must be in [0, 1), got {dropout_p}")
    if q.dtype == torch.float32:  # documented: computed in bf16, returned as fp32
        out = flash_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
                              key_lengths=key_lengths, causal=causal, causal_valid=causal_valid, window=window,
                              global_queries=global_queries, role_mask=role_mask,
                              dropout_p=dropout_p, training=training, scale=scale, generator=generator,
                              backend=backend)
        return out.float()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    p = float(dropout_p) if training else 0.0
    if p > 0.0 and _capturing():
        raise ValueError(
            f"{OP}: dropout_p={p} inside a CUDA graph capture: the dropout seed is drawn on the host when the "
            "call is captured, so every replay would drop the very same weights. Capture with training=False "
            "(or dropout_p=0), or call flash_attention with dropout outside the graph")
    seed = draw_seed(generator) if p > 0.0 else 0
    impl = _CUDA_IMPLS.get(backend) if q.is_cuda else None
    if impl is None:
        impl = _impl(backend, q.device)
    if q.numel() == 0 or k.shape[2] == 0:  # nothing to attend to (or nobody asking): zeros, every backend
        return _empty_result(q, k, v)
    if impl is _TORCH:
        return _torch_attention(q, k, v, key_lengths, causal, causal_valid, scale, seed, p, window,
                                global_queries, role_mask)
    mode = mode_name(key_lengths, causal, causal_valid, window, role_mask)
    extra = None
    if window is not None:
        extra = (window, global_queries, None, None)
    elif role_mask is not None:
        extra = (0, 0, role_mask.codes, role_mask.words)
    D = q.shape[3]
    if D in _PADDED:  # zero columns change no score; the padded output columns are dropped
        pad = _PADDED[D] - D
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    if key_lengths is not None and key_lengths.dtype != torch.int32:
        key_lengths = key_lengths.to(torch.int32)
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _FlashAttention.apply(q, k, v, key_lengths, mode, scale, seed, p, impl, extra)
    else:
        out = impl.forward(q, k, v, key_lengths, mode, scale, seed, p, False, extra=extra)[0]
    return out[..., :D] if D in _PADDED else out


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (only asked when dropout is on)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _empty_result(q, k, v):
    out = q.new_zeros(q.shape)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())  # zero gradients instead of "does not require grad"
    return out


def _torch_attention(q, k, v, key_lengths, causal, causal_valid, scale, seed, p, window, global_queries, rmask):
    from .torch_impl import attention

    return attention(q, k, v, key_lengths, causal, causal_valid, scale, seed, p, window, global_queries, rmask)
