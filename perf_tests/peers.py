"""The benchmark peers, declared once: third-party implementations a user would otherwise call.

`PEERS` names each peer, the ops it computes, the package it needs, whether it is the baseline of
`speedup_vs_torch` and whether its device time is gated (torch.compile and flex_attention recompile and
autotune in every process, so their times are informational). `status(name)` says whether a peer can run
here, and why not; the factories below build a peer's callable for one case. The library's own backends
(torch, triton, tilelang, cuembed) are pcvr_lib.kernels.dispatch's; our "torch" backend is also the
torch-eager peer of every op.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.norms import rms_norm_torch

NORMS = ("rms_norm", "layer_norm")
ATTENTION = ("flash_attention",)


@dataclass(frozen=True)
class Peer:
    name: str
    ops: tuple[str, ...]
    what: str
    package: str | None = None  # a module that must import for the peer to run
    needs_cuda: bool = True
    baseline: bool = False  # speedup_vs_torch divides by this peer's time
    gated: bool = True  # `pcvr diff` gates its device time


class PeerUnavailable(Exception):
    """A peer that does not compute this case (a mask it has no form for): the case skips with the reason."""


PEERS: dict[str, Peer] = {peer.name: peer for peer in (
    Peer("torch", (*NORMS, "embedding_bag_mean", *ATTENTION), needs_cuda=False, baseline=True,
         what="torch eager: F.rms_norm / F.layer_norm, F.embedding_bag on in-range ids, SDPA's default dispatch"),
    Peer("torch_compile", NORMS, needs_cuda=False, gated=False, what="torch.compile of the torch eager norm"),
    Peer("liger", NORMS, package="liger_kernel", what="Liger-Kernel's RMSNorm / LayerNorm Functions"),
    Peer("quack", NORMS, package="quack", what="quack-kernels' CuTe-DSL RMSNorm (quack.rmsnorm.rmsnorm) and LayerNorm "
         "(its layernorm_fwd / layernorm_bwd kernels, fp32 weight and bias)"),
    Peer("sdpa", ATTENTION, what="SDPA's default dispatch with the boolean mask built once, as a model calls it"),
    Peer("sdpa_flash", ATTENTION, what="SDPA forced to its flash kernel (no mask)"),
    Peer("sdpa_efficient", ATTENTION, what="SDPA forced to its memory-efficient kernel"),
    Peer("sdpa_cudnn", ATTENTION, what="SDPA forced to cuDNN attention"),
    Peer("flex", ATTENTION, gated=False, what="torch.compile'd flex_attention with the block mask of the case"),
    Peer("fbgemm", ("embedding_bag_mean",), package="fbgemm_gpu", needs_cuda=False,
         what="FBGEMM's table-batched embedding (fbgemm-gpu; torchrec's kernel): "
         "SplitTableBatchedEmbeddingBagsCodegen, one table, mean pooling, on the valid ids as indices + offsets "
         "(its jagged input, built once per case); "
         "its wheel must match torch (fbgemm-gpu 1.6 for torch 2.11, 1.8 for 2.13)"),
    Peer("fa4", ATTENTION, package="flash_attn.cute", what="FlashAttention 4 (flash-attn-4, CuTe-DSL): "
         "flash_attn_func, key lengths as seqused_k of flash_attn_varlen_func; no mask, key lengths, causal"),
)}
SDPA_FORCED = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")


def is_peer(name: str) -> bool:
    return name in PEERS


def gated(name: str) -> bool:
    """Whether a case of `name` (a peer or one of our backends) has its device time gated."""
    return PEERS[name].gated if name in PEERS else True


def for_op(op: str) -> tuple[str, ...]:
    """The peers of `op`, in the table's order (the baseline first)."""
    return tuple(name for name, peer in PEERS.items() if op in peer.ops)


def status(name: str, device=None) -> tuple[bool, str]:
    """(ok, reason) of a peer on `device` (default: cuda if present)."""
    peer = PEERS[name]
    if peer.package is not None:
        top = peer.package.split(".")[0]  # find_spec of a submodule raises when its parent is missing
        problem = ("package not installed" if importlib.util.find_spec(top) is None
                   else dispatch.package_problem(peer.package))
        if problem:
            return False, f"{name}: {problem}"
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if peer.needs_cuda and dev.type != "cuda":
        return False, f"{name}: no CUDA device"
    return True, "ok"


# ------------------------------------------------------------------ norms


def norm_peer(op: str, name: str, eps: float):
    """A norm peer as a callable (x, weight[, bias]) -> y."""
    if name == "torch":
        if op == "rms_norm":
            return lambda x, w: rms_norm_torch(x, w, eps)
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if name == "torch_compile":
        torch._dynamo.reset()  # a fresh compile per case: no recompile limits, no dynamic-shape reuse
        if op == "rms_norm":
            return torch.compile(lambda x, w: rms_norm_torch(x, w, eps), dynamic=False)
        return torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), dynamic=False)
    if name == "liger":
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # in_place=False: the benchmark reuses one grad tensor, which in-place would overwrite
            return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)
    if name == "quack":
        if op == "rms_norm":
            from quack.rmsnorm import rmsnorm

            return lambda x, w: rmsnorm(x, w, eps=eps)
        return lambda x, w, b: _QuackLayerNorm.apply(x, w, b, eps)
    raise ValueError(f"{op}: no peer {name!r}; peers: {', '.join(for_op(op))}")


class _QuackLayerNorm(torch.autograd.Function):
    """quack's LayerNorm kernels (its RMSNorm kernel with is_layernorm, as quack.rmsnorm.layernorm_fwd and
    layernorm_bwd call them) on the case's weight and bias dtype. quack's public layernorm_fwd asserts fp32
    parameters, which would add two cast kernels to every call that ours does not pay; the kernel itself
    takes fp16 / bf16 parameters, as its RMSNorm does. quack has no LayerNorm autograd Function."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        from quack.rmsnorm import _rmsnorm_fwd

        rows = x.shape[0]
        out = torch.empty_like(x)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        mean = torch.empty(rows, device=x.device, dtype=torch.float32)
        _rmsnorm_fwd(x, weight, out, bias, rstd, mean, None, None, eps, True)
        ctx.save_for_backward(x, weight, rstd, mean)
        return out

    @staticmethod
    def backward(ctx, dy):
        from quack.rmsnorm import _rmsnorm_bwd, get_sm_count

        x, weight, rstd, mean = ctx.saved_tensors
        width = x.shape[-1]
        sm_count = get_sm_count(width, x.device)
        dx = torch.empty_like(x)
        dw_partial = torch.empty(sm_count, width, device=x.device, dtype=torch.float32)
        db_partial = torch.empty(sm_count, width, device=x.device, dtype=torch.float32)
        _rmsnorm_bwd(x, weight, dy.contiguous(), rstd, dx, dw_partial, db_partial, None, None, sm_count,
                     mean=mean, is_layernorm=True)
        return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype), None


# ------------------------------------------------------------------ embedding


def fbgemm_embedding_peer(weight: torch.Tensor, ids: torch.Tensor):
    """FBGEMM's table-batched embedding bag (mean pooling) holding a copy of `weight` (V, D), on the bags of
    `ids` (B, L; id 0 and ids outside [0, V) are padding, as in embedding_bag_mean): a callable () -> (B, D) in
    weight's dtype. Runs on CUDA (fbgemm-gpu) or on the CPU (fbgemm-gpu-cpu), where `weight` is."""
    table, indices, offsets = _fbgemm_table(weight, ids)

    def call():
        with torch.no_grad():
            return table(indices, offsets)

    return call


def _fbgemm_table(weight: torch.Tensor, ids: torch.Tensor, **options):
    """(FBGEMM table holding a copy of `weight`, indices, offsets). FBGEMM takes jagged bags (the valid ids
    flat, with offsets), the form a recommender's input pipeline hands it; they are built here, once, outside
    any timed call. An empty bag's mean is 0 in both."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    precision = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16, torch.bfloat16: SparseType.BF16}
    if weight.dtype not in precision:
        raise PeerUnavailable(f"fbgemm: no {weight.dtype} tables (fp32, fp16, bf16)")
    rows, dim = weight.shape
    cuda = weight.device.type == "cuda"
    if not cuda and weight.dtype == torch.bfloat16:
        raise PeerUnavailable("fbgemm: its CPU kernel has no bf16 tables (fbgemm-gpu-cpu 1.8)")
    table = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST,
          ComputeDevice.CUDA if cuda else ComputeDevice.CPU)],
        pooling_mode=PoolingMode.MEAN, weights_precision=precision[weight.dtype],
        output_dtype=precision[weight.dtype], device=weight.device, **options)
    with torch.no_grad():
        table.split_embedding_weights()[0].copy_(weight)
    valid = (ids > 0) & (ids < rows)
    indices = ids[valid].to(torch.int64)
    offsets = torch.zeros(ids.shape[0] + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(valid.sum(dim=1), 0, out=offsets[1:])
    return table, indices, offsets


def fbgemm_adagrad_step(weight: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor, *, lr: float, eps: float,
                        initial_accumulator_value: float):
    """FBGEMM's sparse training path on a copy of `weight`: the bag means of `ids` (as fbgemm_embedding_peer),
    their backward with `grad_out` fused with an exact (per element) Adagrad update of the touched rows, as
    torchrec trains a table (no gradient is materialised). (call, table): call() makes one step and returns the
    bag means; table() is the updated table. Rounding to the table's dtype is to nearest (FBGEMM's stochastic
    rounding is off, so that the result is comparable)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    table, indices, offsets = _fbgemm_table(weight, ids, optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=lr,
                                            eps=eps, stochastic_rounding=False)
    with torch.no_grad():
        for state in table.split_optimizer_states()[0]:
            state.fill_(initial_accumulator_value)

    def call():
        out = table(indices, offsets)
        out.backward(grad_out)
        return out.detach()

    return call, lambda: table.split_embedding_weights()[0]


# ------------------------------------------------------------------ attention


class sdpa_only:  # noqa: N801 - used like a function: `with sdpa_only("sdpa_flash"):`
    """Enable exactly one SDPA implementation through torch's global switches (restored on exit)."""

    SWITCHES = {"sdpa_flash": "flash", "sdpa_efficient": "mem_efficient", "sdpa_cudnn": "cudnn"}

    def __init__(self, name: str):
        if name not in self.SWITCHES:
            raise ValueError(f"unknown SDPA backend {name!r}; known: {', '.join(self.SWITCHES)}")
        self.want = self.SWITCHES[name]

    def __enter__(self):
        cuda = torch.backends.cuda
        self.saved = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                      cuda.cudnn_sdp_enabled())
        cuda.enable_flash_sdp(self.want == "flash")
        cuda.enable_mem_efficient_sdp(self.want == "mem_efficient")
        cuda.enable_math_sdp(False)
        cuda.enable_cudnn_sdp(self.want == "cudnn")
        return self

    def __exit__(self, *exc):
        cuda = torch.backends.cuda
        cuda.enable_flash_sdp(self.saved[0])
        cuda.enable_mem_efficient_sdp(self.saved[1])
        cuda.enable_math_sdp(self.saved[2])
        cuda.enable_cudnn_sdp(self.saved[3])


def flex_peer(kw: dict, B: int, H: int, S: int, device, compile: bool = True):
    """torch's flex_attention (compiled, one compile per case) with the block mask of flash_attention's mask
    keyword arguments `kw` (key lengths, window + global queries, or a role mask; self-attention of length S):
    a callable (q, k, v) -> out. The block mask is built here, outside any timed call. compile=False: eager
    flex_attention (the CPU test of the mask functions)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rm = kw.get("role_mask")
    if rm is not None:
        roles, vis = rm.roles.to(device=device, dtype=torch.long), rm.visibility.to(device)
        valid = rm.key_valid.to(device) if rm.key_valid is not None else torch.ones_like(roles, dtype=torch.bool)

        def mask_mod(b, h, i, j):
            return (vis[roles[b, i], roles[b, j]] & valid[b, j]) | (i == j)
    else:
        kl = kw.get("key_lengths")
        lengths = (kl.to(device=device, dtype=torch.long).clamp(min=0) if kl is not None
                   else torch.full((B,), S, device=device, dtype=torch.long))
        window, n_global = kw.get("window"), kw.get("global_queries", 0)
        if window is None and not kw.get("causal") and not kw.get("causal_valid"):
            def mask_mod(b, h, i, j):
                return j < lengths[b]
        elif window is not None:
            def mask_mod(b, h, i, j):
                valid_row = i < lengths[b]
                in_window = (j <= i) & (i - j < window) & valid_row
                is_global = valid_row & (i >= lengths[b] - n_global) & (j < lengths[b])
                return in_window | is_global | (i == j)
        else:
            raise ValueError(f"flex_peer: no block mask for {sorted(kw)} (key lengths, window, role_mask only)")
    block_mask = create_block_mask(mask_mod, B, None, S, S, device=device)
    attend = flex_attention
    if compile:
        torch._dynamo.reset()  # a fresh compile per case
        attend = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: attend(q, k, v, block_mask=block_mask)


def fa4_peer(kw: dict, grad: bool = False):
    """FlashAttention 4 with flash_attention's mask keyword arguments `kw`: a callable (q, k, v) -> out on our
    (B, H, S, D) layout. FA4 takes (B, S, H, D): q, k, v and out pass as transposed views (no copy; their last
    dimension stays contiguous). Key lengths are FA4's seqused_k, forward only (`grad`: the call is
    differentiated): on the H200, flash-attn-4 4.0.0b40's backward with seqused_k left dk and dv past the key
    length unwritten (NaN through our poisoned outputs) and gave dq errors of 2.5 at head dim 16, so it does
    not compute our gradient. Windows, role masks and causal_valid have no form here (FA4's mask_mod would
    compile one kernel per mask function). What it cannot compute raises PeerUnavailable."""
    other = sorted(k for k, v in kw.items() if k not in ("key_lengths", "causal") and v not in (None, False, 0))
    if other:
        raise PeerUnavailable(f"fa4: no mask of {', '.join(other)} in this peer (no mask, key lengths, causal only)")
    if grad and kw.get("key_lengths") is not None:
        raise PeerUnavailable("fa4: its backward with key lengths (seqused_k) does not compute our gradient "
                              "(dk, dv past the length unwritten; dq wrong at head dim 16), forward only")
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    lengths, causal = kw.get("key_lengths"), bool(kw.get("causal"))
    if lengths is not None:
        lengths = lengths.to(torch.int32)

    def attend(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if lengths is None:
            out = flash_attn_func(qt, kt, vt, causal=causal)
        else:
            out = flash_attn_varlen_func(qt, kt, vt, seqused_k=lengths, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return attend
