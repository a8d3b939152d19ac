"""The float64 reference of `embedding_bag_mean`, and the semantics every backend implements:

  out[b] = mean of weight[ids[b, l]] over the positions l with 0 < ids[b, l] < V.
  Id 0 is padding; ids >= V and negative ids are ignored the same way (never an error, never a clamp);
  a bag with no valid id gives a row of zeros. The weight gradient reaches only the valid ids:
  d weight[i] = sum over valid (b, l) with ids[b, l] == i of grad_out[b] / count[b].
"""

from __future__ import annotations

import torch


def reference_forward(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 reference of the forward, written without F.embedding_bag (gather, mask, divide)."""
    num_rows = weight.shape[0]
    ids = ids.to(torch.int64)
    valid = (ids > 0) & (ids < num_rows)
    # gather first, then widen: a large table is never copied to float64 as a whole
    rows = weight.detach()[torch.where(valid, ids, 0)].to(torch.float64)  # (B, L, D)
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # not a product: NaN in an ignored row stays out
    count = valid.sum(dim=1, keepdim=True).to(torch.float64)
    return rows.sum(dim=1) / count.clamp_min(1.0)


def reference_weight_grad(num_rows: int, ids: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """float64 dense weight gradient of sum(out * grad_out)."""
    g = grad_out.detach().to(torch.float64)
    ids = ids.to(torch.int64)
    valid = (ids > 0) & (ids < num_rows)
    count = valid.sum(dim=1, keepdim=True).to(torch.float64).clamp_min(1.0)
    per_bag = g / count  # (B, D)
    contrib = torch.where(valid.unsqueeze(-1), per_bag.unsqueeze(1).expand(-1, ids.shape[1], -1), 0.0)
    grad = torch.zeros(num_rows, g.shape[1], dtype=torch.float64, device=g.device)
    grad.index_add_(0, torch.where(valid, ids, 0).reshape(-1), contrib.reshape(-1, g.shape[1]))
    return grad
