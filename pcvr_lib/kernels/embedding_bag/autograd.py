"""Training path of the GPU backends: forward kernel + sparse (COO) or dense weight gradient.

Sparse gradient: a COO tensor (V, D) holding one entry per valid id occurrence (0 < id < V), in bag
order and position order inside a bag; duplicates are NOT merged (like torch's sparse embedding_bag),
so a row used k times appears k times and `grad.coalesce()` sums them. Padding and ignored ids never
appear. Its length (nnz) must be known on the host: the forward saves the per-bag counts, launches
their cumulative sum and copies the total to pinned host memory asynchronously with an event; the
backward waits on that event only (normally long complete), not on the whole stream.

Dense gradient: fp32 (V, D) buffer, fp32 atomics, cast to the weight dtype (one extra pass when the
weight is not fp32).
"""

from __future__ import annotations

import torch


class EmbeddingBagMeanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, impl, sparse_grad):
        out, counts = impl.forward(weight, ids, True)
        ctx.impl = impl
        ctx.sparse_grad = sparse_grad
        ctx.num_rows = weight.shape[0]
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ids) if ids.requires_grad else None
        if sparse_grad:
            ends = torch.cumsum(counts, 0)
            if ends.is_cuda:
                total = torch.empty((1,), dtype=torch.int64, pin_memory=True)
                total.copy_(ends[-1:], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:  # Triton's interpreter on CPU tensors (tests)
                total, event = ends[-1:], None
            ctx.total = total
            ctx.event = event
            ctx.save_for_backward(ids, counts, ends)
        else:
            ctx.save_for_backward(ids, counts)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        impl = ctx.impl
        num_rows = ctx.num_rows
        if ctx.sparse_grad:
            ids, counts, ends = ctx.saved_tensors
            if ctx.event is not None:
                ctx.event.synchronize()
            nnz = int(ctx.total.item())
            indices, values = impl.backward_sparse(ids, counts, ends, grad_out, nnz, num_rows, ctx.weight_dtype)
            grad = torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, grad_out.shape[1]),
                                           check_invariants=False)
        else:
            ids, counts = ctx.saved_tensors
            grad = impl.backward_dense(ids, counts, grad_out, num_rows, ctx.weight_dtype)
        return grad, None, None, None
