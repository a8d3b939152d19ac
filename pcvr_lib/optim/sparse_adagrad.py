"""Adagrad for embedding tables with sparse (COO) row gradients.

For a table W (V, D) and a row gradient G (its rows merged first, so each touched row appears once with the
sum of its duplicates: squaring before merging would be wrong):

    S[r] <- S[r] + G[r]^2;   W[r] <- W[r] - lr * G[r] / (sqrt(S[r]) + eps)      for touched rows r only

which equals torch's Adagrad (lr_decay 0, weight decay 0, initial accumulator 0) on the touched rows and
leaves the other rows and their state untouched. A dense gradient gets the same update on every row (a
table's gradient is dense where its pieces outnumber its rows: models.tables); its untouched rows have
G[r] = 0 and keep their weights and state.

`skip`: set by `OptimizerSet.step(skip=...)` to a 0-d device bool for one step; where true the step changes
nothing (the gradient counts as 0), decided on the device (a captured step skipping a non-finite one).
`rows_merged`: set by `OptimizerSet.step(rows_merged=True)` when the sparse gradients are merged slots already
(optim.step.merge_sparse_gradients_), which the step then takes as they are.

The merge is embedding_bag.merge_rows: fixed-size (a slot per piece of the gradient), so the step never
waits for the number of distinct rows; the slots past it add zeros, spread over distinct rows.
"""

from __future__ import annotations

import torch

from pcvr_lib.kernels.embedding_bag import merge_rows

from .errors import OptimizerError, check_common


class SparseAdagrad(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.05, eps: float = 1e-10, initial_accumulator_value: float = 0.0):
        check_common("sparse_adagrad", lr=lr, eps=eps)
        if initial_accumulator_value < 0:
            raise OptimizerError(
                f"sparse_adagrad: initial_accumulator_value must be >= 0, got {initial_accumulator_value!r}"
            )
        params = list(params)
        if not params:
            raise OptimizerError("sparse_adagrad: got an empty parameter list")
        super().__init__(params, dict(lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = getattr(self, "skip", None)
        rows_merged = getattr(self, "rows_merged", False)
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                                   memory_format=torch.preserve_format)
                state["step"] += 1
                acc = state["sum"]
                if g.is_sparse:
                    if g.sparse_dim() != 1:
                        raise OptimizerError(
                            f"sparse_adagrad: expects row-sparse gradients (sparse_dim 1), got sparse_dim "
                            f"{g.sparse_dim()} for a parameter of shape {tuple(p.shape)}"
                        )
                    if g._nnz() == 0:
                        continue
                    # duplicate rows are summed before anything is squared
                    if rows_merged or g.is_coalesced():
                        rows, values = g._indices()[0], g._values().to(p.dtype)
                    else:
                        rows, sums = merge_rows(g._indices()[0], g._values(), spread=p.shape[0])
                        values = sums.to(p.dtype)
                    if skip is not None:
                        values = torch.where(skip, 0, values)
                    acc.index_add_(0, rows, values * values)
                    # a padding slot (value 0) may land on a row whose state is 0: with eps 0 that would be 0 / 0
                    denom = acc.index_select(0, rows).sqrt_().add_(eps).clamp_min_(torch.finfo(acc.dtype).tiny)
                    p.index_add_(0, rows, values / denom, alpha=-lr)
                else:
                    if skip is not None:
                        g = torch.where(skip, 0, g)
                    acc.addcmul_(g, g)
                    # an untouched row (G 0) whose state is still 0: with eps 0 that would be 0 / 0
                    denom = acc.sqrt().add_(eps).clamp_min_(torch.finfo(acc.dtype).tiny)
                    p.addcdiv_(g, denom, value=-lr)
        return loss
