"""`embedding_bag_mean`: the one entry point (explicit backend, no silent fallback) and its autograd Function.

Backends: "torch" (F.embedding_bag on sanitized ids, reference.py), "triton", "tilelang" (forward and
backward) and "cuembed" (CUDA C++, forward only).

Training path of the GPU backends: forward kernel + sparse (COO) or dense weight gradient.

Sparse gradient: a coalesced COO tensor (V, D) (`is_coalesced()`): one entry per distinct touched row, rows
sorted, each the fp32 sum of its bags' grad_out[b] / count[b] (each term in fp32), rounded once to the weight
dtype. (Terms rounded to a 16-bit weight dtype before the sum cost up to one term's ulp per duplicate: a row
whose terms cancel came out 0.0020 for 0.0037 in bf16 on the H200.) The kernel writes B*L fixed-size fp32
pieces (entry b*L + l: (id, grad_out[b] / count[b]) for a valid id, else (anchor[b], zeros), anchor[b] a valid
id of the same bag; row 0 only for a bag with no valid id, so row 0 appears, with zeros, only then);
`torch.unique` + `index_add_` merge the duplicates. That costs one device-to-host sync per call (the number of
distinct rows), which a sparse optimizer pays anyway in its coalesce: torch's coalesce of the raw pieces took
~41.5 ms per training step on the H200 against 0.8-6.6 ms for torch's own sparse embedding gradient
(notes/models.md; the pieces repeat row 0 and the anchors once per padding slot, the likely cause).

Dense gradient: fp32 (V, D) buffer, fp32 atomics, cast to the weight dtype (one extra pass when the
weight is not fp32).
"""

from __future__ import annotations

import importlib

import torch

from .. import registry
from .reference import reference_forward, reference_weight_grad, sanitize_ids, torch_embedding_bag_mean

__all__ = ["BACKENDS", "ID_DTYPES", "OP", "WEIGHT_DTYPES", "backend_status", "check_inputs", "embedding_bag_mean",
           "reference_forward", "reference_weight_grad", "sanitize_ids", "torch_embedding_bag_mean"]

OP = "embedding_bag_mean"
BACKENDS = ("torch", "triton", "tilelang", "cuembed")
WEIGHT_DTYPES = registry.FLOAT_DTYPES  # float16, bfloat16, float32
ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = frozenset(WEIGHT_DTYPES)
_ID_DTYPES = frozenset(ID_DTYPES)
_MODULES = {"triton": "triton_impl", "tilelang": "tilelang_impl", "cuembed": "cuembed"}
_IMPL: dict[str, object] = {}


def _cuembed_problem(device: torch.device) -> str | None:
    problem = registry.nvcc_problem(device)
    if problem is None and torch.version.cuda is None:
        problem = "this torch build has no CUDA support"
    return problem


registry.register_op(OP, {"torch": None, "triton": None, "tilelang": None, "cuembed": _cuembed_problem})


def backend_status(backend: str, device=None) -> tuple[bool, str]:
    """(ok, reason) from the shared registry."""
    return registry.backend_status(OP, backend, device)


def _impl(backend: str, device: torch.device):
    impl = _IMPL.get(backend)
    if impl is None:
        registry.require_backend(OP, backend, device)
        impl = importlib.import_module(f".{_MODULES[backend]}", __package__)
        _IMPL[backend] = impl
    return impl


def check_inputs(weight: torch.Tensor, ids: torch.Tensor, backend: str = "torch") -> None:
    """Every input error with a message naming it (also used when the fast checks below fail)."""
    registry.validate_backend(OP, backend)
    registry.check_inputs(OP, weight, ids, backend=backend)
    if weight.dim() != 2:
        raise ValueError(f"{OP}: weight must be 2-D (V, D), got shape {tuple(weight.shape)}")
    if ids.dim() != 2:
        raise ValueError(f"{OP}: ids must be 2-D (B, L), got shape {tuple(ids.shape)}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{OP}: ids must be int32 or int64, got {ids.dtype}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{OP}: weight must be float16, bfloat16 or float32, got {weight.dtype}")
    if backend != "torch" and not weight.is_contiguous():
        raise ValueError(f"{OP}: weight must be contiguous (copying an embedding table on every call would "
                         "cost more than the lookup); call .contiguous() once")


def embedding_bag_mean(weight: torch.Tensor, ids: torch.Tensor, *, backend: str = "torch",
                       sparse_grad: bool = False) -> torch.Tensor:
    """Mean of weight rows over each bag of ids, ignoring every id outside (0, V).

    weight (V, D) float16/bfloat16/float32; ids (B, L) int32/int64 -> (B, D) in weight's dtype, fp32
    accumulation. Id 0 is padding; ids >= V and negative ids are ignored the same way; an empty bag gives
    zeros. With grad enabled and weight.requires_grad, the weight gradient is dense (V, D), or a COO
    tensor of the touched rows when sparse_grad=True (coalesced: duplicates summed; module docstring).
    Backends: "torch" (F.embedding_bag), "triton", "tilelang" (forward + backward) and "cuembed"
    (CUDA C++, forward only: it raises when a gradient is required).
    """
    if backend == "torch":
        check_inputs(weight, ids, backend)
        return torch_embedding_bag_mean(weight, ids, sparse_grad)
    # Fast path: a handful of attribute reads; any failure re-runs the full checks for the message.
    if not (weight.is_cuda and ids.is_cuda and weight.dim() == 2 and ids.dim() == 2
            and weight.get_device() == ids.get_device() and weight.dtype in _WEIGHT_DTYPES
            and ids.dtype in _ID_DTYPES and weight.is_contiguous()):
        check_inputs(weight, ids, backend)
    impl = _IMPL.get(backend) or _impl(backend, weight.device)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    if not (ids.numel() and weight.shape[0]):
        # degenerate shapes (no bag, no position or no row): every bag is empty; torch's op covers them
        return torch_embedding_bag_mean(weight, ids, sparse_grad)
    if weight.requires_grad and torch.is_grad_enabled():
        if backend == "cuembed":
            raise RuntimeError(f"{OP}: backend 'cuembed' is forward-only; use 'triton' or 'tilelang' when the "
                               "weight requires a gradient (or call it under torch.no_grad())")
        return EmbeddingBagMeanFunction.apply(weight, ids, impl, bool(sparse_grad))
    if backend == "cuembed":
        return impl.forward(weight, ids)
    return impl.forward(weight, ids, False)[0]


def coalesced_rows(indices: torch.Tensor, values: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """COO (num_rows, D) from fp32 row pieces (indices (N,), values (N, D)): duplicate rows summed in fp32 and
    rounded once to `dtype`, rows sorted, flagged coalesced. (Autograd's accumulation into .grad drops the flag in
    torch 2.13; the rows stay distinct, so an optimizer's coalesce() then only sorts them.)"""
    rows, slot = torch.unique(indices, sorted=True, return_inverse=True)  # syncs: the row count
    sums = torch.zeros((rows.numel(), values.shape[1]), dtype=torch.float32, device=values.device)
    sums.index_add_(0, slot, values)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), sums.to(dtype), (num_rows, values.shape[1]),
                                   is_coalesced=True, check_invariants=False)


class EmbeddingBagMeanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, impl, sparse_grad):
        out, counts = impl.forward(weight, ids, True)
        ctx.impl = impl
        ctx.sparse_grad = sparse_grad
        ctx.num_rows = weight.shape[0]
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(ids, counts)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        impl = ctx.impl
        num_rows = ctx.num_rows
        ids, counts = ctx.saved_tensors
        if ctx.sparse_grad:
            indices, values = impl.backward_sparse(ids, counts, grad_out, num_rows, ctx.weight_dtype)
            grad = coalesced_rows(indices, values, num_rows, ctx.weight_dtype)
        else:
            grad = impl.backward_dense(ids, counts, grad_out, num_rows, ctx.weight_dtype)
        return grad, None, None, None
