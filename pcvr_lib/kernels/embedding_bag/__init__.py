"""`embedding_bag_mean`: the one entry point (explicit backend, no silent fallback) and its autograd Function.

Backends: "torch" (F.embedding_bag on sanitized ids), "triton", "tilelang" (forward and
backward) and "cuembed" (CUDA C++, forward only).

Training path of the GPU backends: forward kernel + sparse (COO) or dense weight gradient.

Sparse gradient, with no device-to-host sync: a COO tensor (V, D) of B*L slots in which every touched row
appears once, ascending, with the fp32 sum of its bags' grad_out[b] / count[b] rounded once to the weight
dtype (terms rounded to a 16-bit dtype before the sum would cost up to one ulp per duplicate, which matters
where terms cancel); the remaining slots are row 0 with zeros. It is not flagged coalesced (row 0 may
repeat); `coalesce()` gives the exact merged form. Entry b*L + l of the gradient is (id, grad_out[b] /
count[b]) for a valid id, else (anchor[b], zeros), anchor[b] a valid id of the same bag; row 0 only for a bag
with no valid id. Triton merges the entries itself (`backward_merged`: the rows sorted, then one pass that
gathers and sums each row's entries in sorted order). TileLang's kernel writes the B*L fixed-size fp32 entries
and `merge_rows` sums them (a sort, a cumulative sum and an `index_add_`). Both are of fixed size: the number
of distinct rows never reaches the host. The sparse optimizer (optim.sparse_adagrad) and the global grad-norm
clip merge such gradients the same way, so a training step has no sync on its embedding path.

Dense gradient: fp32 (V, D) buffer, fp32 atomics, cast to the weight dtype (one extra pass when the
weight is not fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.embedding_bag.reference import reference_forward, reference_weight_grad

__all__ = ["ID_DTYPES", "OP", "backend_status", "check_inputs", "embedding_bag_mean", "reference_forward",
           "reference_weight_grad", "sanitize_ids", "torch_embedding_bag_mean"]

OP = "embedding_bag_mean"
ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = frozenset(dispatch.FLOAT_DTYPES)
_ID_DTYPES = frozenset(ID_DTYPES)
_IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS


def _cuembed_problem(device: torch.device) -> str | None:
    problem = dispatch.nvcc_problem(device)
    if problem is None and torch.version.cuda is None:
        problem = "this torch build has no CUDA support"
    return problem


dispatch.register_op(OP, __name__, {"torch": None, "triton": None, "tilelang": None, "cuembed": _cuembed_problem})


def backend_status(backend: str, device=None) -> tuple[bool, str]:
    """(ok, reason) from the dispatcher."""
    return dispatch.backend_status(OP, backend, device)


def sanitize_ids(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """ids with every id outside (0, num_rows) replaced by the padding id 0 (a new tensor)."""
    return ids.masked_fill((ids < 0) | (ids >= num_rows), 0)


def torch_embedding_bag_mean(weight: torch.Tensor, ids: torch.Tensor, sparse_grad: bool = False) -> torch.Tensor:
    """The torch backend: F.embedding_bag(mean, padding_idx=0) on sanitized ids (autograd through torch).

    F.embedding_bag already excludes padding from the count and returns zeros for empty bags; it raises (CPU)
    or asserts (CUDA) on ids outside [0, V), so every id outside (0, V) is first mapped to 0: one extra
    elementwise pass over the ids, part of the torch backend's cost."""
    clean = sanitize_ids(ids, weight.shape[0])
    return F.embedding_bag(clean, weight, mode="mean", padding_idx=0, sparse=sparse_grad)


def check_inputs(weight: torch.Tensor, ids: torch.Tensor, backend: str = "torch") -> None:
    """Every input error with a message naming it (also used when the fast checks below fail)."""
    dispatch.validate_backend(OP, backend)
    dispatch.check_inputs(OP, weight, ids, backend=backend)
    if weight.dim() != 2:
        raise ValueError(f"{OP}: weight must be 2-D (V, D), got shape {tuple(weight.shape)}")
    if ids.dim() != 2:
        raise ValueError(f"{OP}: ids must be 2-D (B, L), got shape {tuple(ids.shape)}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{OP}: ids must be int32 or int64, got {ids.dtype}")
    if weight.dtype not in _WEIGHT_DTYPES:
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
    tensor of the touched rows when sparse_grad=True (duplicates summed, no sync; module docstring).
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
    if not ids.is_contiguous():
        ids = ids.contiguous()
    if not (ids.numel() and weight.shape[0]):
        # degenerate shapes (no bag, no position or no row): every bag is empty; torch's op covers them
        return torch_embedding_bag_mean(weight, ids, sparse_grad)
    if torch.compiler.is_compiling() and backend != "cuembed":
        training = weight.requires_grad and torch.is_grad_enabled()
        return torch.ops.pcvr.embedding_bag_mean(weight, ids, training, bool(sparse_grad), backend)[0]
    impl = _IMPLEMENTATIONS.get((OP, backend, weight.get_device())) or dispatch.implementation(OP, backend,
                                                                                                 weight.device)
    if weight.requires_grad and torch.is_grad_enabled():
        if backend == "cuembed":
            raise RuntimeError(f"{OP}: backend 'cuembed' is forward-only; use 'triton' or 'tilelang' when the "
                               "weight requires a gradient (or call it under torch.no_grad())")
        return EmbeddingBagMeanFunction.apply(weight, ids, impl, bool(sparse_grad))
    if backend == "cuembed":
        return impl.forward(weight, ids)
    return impl.forward(weight, ids, False)[0]


def merge_rows(indices: torch.Tensor, values: torch.Tensor, spread: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a row-sparse gradient given as N pieces (indices (N,), values (N, D)) summed in fp32, without
    a device-to-host sync: (rows (N,) int64, sums (N, D) fp32). The first `count` slots hold the distinct rows,
    ascending, each with the sum of its pieces; `count` stays on the device, and the other slots hold zeros,
    at row 0, or spread over rows `slot % spread` (so that adding every slot into a table does not pile atomic
    adds of zero onto one row). Adding all N slots (or their squares) into a table is therefore exact."""
    n = indices.numel()
    order = torch.argsort(indices)
    sorted_rows = indices[order]
    starts = torch.ones(n, dtype=torch.bool, device=indices.device)
    starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
    segment = torch.cumsum(starts, 0) - 1
    slot = torch.empty_like(segment).scatter_(0, order, segment)  # the slot of each piece, in piece order
    sums = torch.zeros((n, values.shape[1]), dtype=torch.float32, device=values.device)
    sums.index_add_(0, slot, values.float())
    if spread is None:
        rows = torch.zeros(n, dtype=torch.int64, device=indices.device)
    else:
        rows = torch.arange(n, device=indices.device) % spread
    rows.scatter_(0, segment, sorted_rows.to(torch.int64))
    return rows, sums


def sparse_slots(impl, ids: torch.Tensor, counts: torch.Tensor, grad_out: torch.Tensor, num_rows: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse weight gradient's B*L slots: (rows int64 (B*L,), values (B*L, D) in `dtype`): every touched
    row once, ascending, summed in fp32 and rounded once; the other slots row 0 with zeros (module docstring)."""
    merged = getattr(impl, "backward_merged", None)
    if merged is not None:
        return merged(ids, counts, grad_out, num_rows, dtype)
    rows, sums = merge_rows(*impl.backward_sparse(ids, counts, grad_out, num_rows, dtype))
    return rows, sums.to(dtype)


def slots_gradient(rows: torch.Tensor, values: torch.Tensor, num_rows: int) -> torch.Tensor:
    """COO (num_rows, D) of the slots. Not flagged coalesced (row 0 may repeat); `coalesce()` gives the exact
    merged form, at the price of a sync."""
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (num_rows, values.shape[1]), check_invariants=False)


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
            grad = slots_gradient(*sparse_slots(impl, ids, counts, grad_out, num_rows, ctx.weight_dtype), num_rows)
        else:
            grad = impl.backward_dense(ids, counts, grad_out, num_rows, ctx.weight_dtype)
        return grad, None, None, None


# ------------------------------------------------------------------ torch.library ops (what torch.compile traces)
# Under torch.compile embedding_bag_mean calls this op (not for cuembed, which is forward-only) instead of the
# autograd Function. Its backward returns the weight gradient as the Function does: dense, or the merged sparse
# gradient of B*L slots (sparse_slots), built inside the backward op.


@torch.library.custom_op("pcvr::embedding_bag_mean", mutates_args=())
def _embedding_bag_op(weight: torch.Tensor, ids: torch.Tensor, training: bool, sparse_grad: bool,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, each bag's count of valid ids; empty unless `training`)."""
    impl = dispatch.implementation(OP, backend, weight.device)
    out, counts = impl.forward(weight, ids, training)
    return out, counts if training else ids.new_empty((0,), dtype=torch.int32)


@_embedding_bag_op.register_fake
def _(weight, ids, training, sparse_grad, backend):
    counts = ids.new_empty((ids.shape[0] if training else 0,), dtype=torch.int32)
    return weight.new_empty((ids.shape[0], weight.shape[1])), counts


@torch.library.custom_op("pcvr::embedding_bag_mean_sparse_grad", mutates_args=())
def _sparse_grad_op(ids: torch.Tensor, counts: torch.Tensor, grad_out: torch.Tensor, num_rows: int,
                    dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse weight gradient's B*L (row, value) slots (sparse_slots)."""
    return sparse_slots(dispatch.implementation(OP, backend, ids.device), ids, counts, grad_out, num_rows, dtype)


@_sparse_grad_op.register_fake
def _(ids, counts, grad_out, num_rows, dtype, backend):
    n = ids.numel()
    return ids.new_empty((n,), dtype=torch.int64), grad_out.new_empty((n, grad_out.shape[1]), dtype=dtype)


@torch.library.custom_op("pcvr::embedding_bag_mean_dense_grad", mutates_args=())
def _dense_grad_op(ids: torch.Tensor, counts: torch.Tensor, grad_out: torch.Tensor, num_rows: int,
                   dtype: torch.dtype, backend: str) -> torch.Tensor:
    impl = dispatch.implementation(OP, backend, ids.device)
    return impl.backward_dense(ids, counts, grad_out, num_rows, dtype)


@_dense_grad_op.register_fake
def _(ids, counts, grad_out, num_rows, dtype, backend):
    return grad_out.new_empty((num_rows, grad_out.shape[1]), dtype=dtype)


def _embedding_bag_setup(ctx, inputs, output):
    weight, ids, _training, sparse_grad, backend = inputs
    ctx.save_for_backward(ids, output[1])
    ctx.args = (weight.shape[0], weight.dtype, sparse_grad, backend)


def _embedding_bag_backward(ctx, grad_out, _dcounts):
    ids, counts = ctx.saved_tensors
    num_rows, dtype, sparse_grad, backend = ctx.args
    grad_out = grad_out.contiguous()
    if sparse_grad:
        grad = slots_gradient(*_sparse_grad_op(ids, counts, grad_out, num_rows, dtype, backend), num_rows)
    else:
        grad = _dense_grad_op(ids, counts, grad_out, num_rows, dtype, backend)
    return grad, None, None, None, None


_embedding_bag_op.register_autograd(_embedding_bag_backward, setup_context=_embedding_bag_setup)
