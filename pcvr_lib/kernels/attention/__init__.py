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

from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.attention.config import tilelang_stat_rows
from pcvr_lib.kernels.attention.masks import (
    MODES,
    NO_STRUCTURE,
    RoleMask,
    StructuredMask,
    allowed_mask,
    draw_seed,
    dropout_keep_mask,
    key_lengths_from_mask,
    mode_name,
    role_mask,
)
from pcvr_lib.kernels.attention.torch_impl import attention as _torch_attention

__all__ = [
    "flash_attention", "key_lengths_from_mask", "allowed_mask", "dropout_keep_mask", "role_mask", "RoleMask",
    "MODES", "OP", "HEAD_DIMS", "PADDED_HEAD_DIMS",
]

OP = "flash_attention"
HEAD_DIMS = (16, 32, 48, 64, 128)
PADDED_HEAD_DIMS = {48: 64}  # head dims the kernels run zero-padded (a power of two per tile row)


def _tilelang_problem(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "needs an sm_80 or newer GPU"
    return None


dispatch.register_op(OP, __name__, {"torch": None, "triton": None, "tilelang": _tilelang_problem})
_IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_lengths, mode, scale, seed, dropout_p, impl, structured):
        o, lse = impl.forward(q, k, v, key_lengths, mode, scale, seed, dropout_p, True, structured=structured)
        ctx.save_for_backward(q, k, v, o, lse, key_lengths)
        ctx.args = (mode, scale, seed, dropout_p, impl, structured)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_lengths = ctx.saved_tensors
        mode, scale, seed, dropout_p, impl, structured = ctx.args
        dq, dk, dv = impl.backward(do, q, k, v, o, lse, key_lengths, mode, scale, seed, dropout_p,
                                   structured=structured)
        return dq, dk, dv, None, None, None, None, None, None, None


_OK_DTYPES = dispatch.FLOAT_DTYPES


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
    if backend == "torch":
        if q.numel() == 0 or k.shape[2] == 0:  # nothing to attend to (or nobody asking): zeros, every backend
            return _empty_result(q, k, v)
        return _torch_attention(q, k, v, key_lengths, causal, causal_valid, scale, seed, p, window,
                                global_queries, role_mask)
    compiling = torch.compiler.is_compiling()
    if compiling:
        if p > 0.0:
            raise ValueError(f"{OP}: dropout_p={p} under torch.compile: the dropout seed is drawn on the host for "
                             "every call; compile with training=False (or dropout_p=0), or call it eagerly")
    else:
        impl = _IMPLEMENTATIONS.get((OP, backend, q.get_device())) or dispatch.implementation(OP, backend,
                                                                                             q.device)
    if q.numel() == 0 or k.shape[2] == 0:
        return _empty_result(q, k, v)
    mode = mode_name(key_lengths, causal, causal_valid, window, role_mask)
    structured = None
    if window is not None:
        structured = StructuredMask(window=window, global_queries=global_queries)
    elif role_mask is not None:
        structured = StructuredMask(codes=role_mask.codes, words=role_mask.words)
    D = q.shape[3]
    if D in PADDED_HEAD_DIMS:  # zero columns change no score; the padded output columns are dropped
        pad = PADDED_HEAD_DIMS[D] - D
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    if key_lengths is not None and key_lengths.dtype != torch.int32:
        key_lengths = key_lengths.to(torch.int32)
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    if v.stride(3) != 1:
        v = v.contiguous()
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if compiling:
        s = structured or NO_STRUCTURE
        out = torch.ops.pcvr.flash_attention(q, k, v, key_lengths, mode, scale, training, s.window, s.global_queries,
                                             s.codes, s.words, backend)[0]
    elif training:
        out = _FlashAttention.apply(q, k, v, key_lengths, mode, scale, seed, p, impl, structured)
    else:
        out = impl.forward(q, k, v, key_lengths, mode, scale, seed, p, False, structured=structured)[0]
    return out[..., :D] if D in PADDED_HEAD_DIMS else out


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (only asked when dropout is on)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _empty_result(q, k, v):
    out = q.new_zeros(q.shape)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())  # zero gradients instead of "does not require grad"
    return out


# ------------------------------------------------------------------ torch.library ops (what torch.compile traces)
# Under torch.compile flash_attention calls this op (no dropout: its seed is drawn on the host per call) instead of
# the autograd Function: the forward and the backward are one graph node each, with fake kernels for the shapes.
# The mask travels as the StructuredMask's fields (window, global queries, role codes and words).


def _structured(window: int, global_queries: int, codes, words):
    if window or global_queries or codes is not None:
        return StructuredMask(window=window, global_queries=global_queries, codes=codes, words=words)
    return None


@torch.library.custom_op("pcvr::flash_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None, mode: str,
                  scale: float, training: bool, window: int, global_queries: int, codes: torch.Tensor | None,
                  words: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, the base-2 LSE; empty unless `training`)."""
    impl = dispatch.implementation(OP, backend, q.device)
    o, lse = impl.forward(q, k, v, key_lengths, mode, scale, 0, 0.0, training,
                          structured=_structured(window, global_queries, codes, words))
    return o, lse if training else q.new_empty((0,), dtype=torch.float32)


def _lse_shape(backend: str, q: torch.Tensor) -> tuple[int, ...]:
    B, H, Sq, _ = q.shape
    return (B, H, tilelang_stat_rows(Sq)) if backend == "tilelang" else (B * H, Sq)


@_attention_op.register_fake
def _(q, k, v, key_lengths, mode, scale, training, window, global_queries, codes, words, backend):
    lse = q.new_empty(_lse_shape(backend, q) if training else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("pcvr::flash_attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           lse: torch.Tensor, key_lengths: torch.Tensor | None, mode: str, scale: float, window: int,
                           global_queries: int, codes: torch.Tensor | None, words: torch.Tensor | None,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = dispatch.implementation(OP, backend, q.device)
    return impl.backward(do, q, k, v, o, lse, key_lengths, mode, scale, 0, 0.0,
                         structured=_structured(window, global_queries, codes, words))


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, key_lengths, mode, scale, window, global_queries, codes, words, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup(ctx, inputs, output):
    q, k, v, key_lengths, mode, scale, _training, window, global_queries, codes, words, backend = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], key_lengths, codes, words)
    ctx.args = (mode, scale, window, global_queries, backend)


def _attention_backward(ctx, do, _dlse):
    q, k, v, o, lse, key_lengths, codes, words = ctx.saved_tensors
    mode, scale, window, global_queries, backend = ctx.args
    dq, dk, dv = _attention_backward_op(do.contiguous(), q, k, v, o, lse, key_lengths, mode, scale, window,
                                        global_queries, codes, words, backend)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)
