"""Training path of the GPU backends: forward kernel + sparse (COO) or dense weight gradient.

Sparse gradient: an uncoalesced COO tensor (V, D) with exactly B*L entries, entry b*L + l for bag b,
position l: (id, grad_out[b] / count[b]) when the id is valid (0 < id < V), else (anchor[b], zeros),
where anchor[b] is a valid id of the same bag (the padding row 0 only for a bag with no valid id).
So the rows that appear are the touched rows (plus row 0 with zero values when a bag is all padding),
duplicates are NOT merged (`grad.coalesce()` sums them; the zero entries change no sum), and the
length is known without looking at the data: no device-to-host synchronisation (torch's sparse
embedding_bag backward synchronises to drop padding; on the H200 host that wait alone cost hundreds
of microseconds per step).

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
            grad = torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, grad_out.shape[1]),
                                           check_invariants=False)
        else:
            grad = impl.backward_dense(ids, counts, grad_out, num_rows, ctx.weight_dtype)
        return grad, None, None, None
