"""The training step: backward -> clip the global grad norm (dense and sparse) -> dense step -> sparse step.

Orthogonal AdamW's gradient transform is the first stage of its own `step()`, so it runs after clipping and
before the AdamW update, as the reference orders it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pcvr_lib.kernels.embedding_bag import merge_rows

from .errors import OptimizerError

CLIP_EPS = 1e-6


@dataclass
class OptimizerSet:
    """The dense optimizer of a model and, optionally, the sparse one of its embedding tables.

    The base lr of every group is remembered (`base_lr`) so that `set_lr_multiplier` can scale them all.
    """

    dense: torch.optim.Optimizer | None
    sparse: torch.optim.Optimizer | None = None

    def __post_init__(self):
        if self.dense is None and self.sparse is None:
            raise OptimizerError("OptimizerSet needs a dense or a sparse optimizer (both are None)")
        for opt in self.optimizers:
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.dense, self.sparse) if o is not None]

    def parameters(self) -> list[torch.Tensor]:
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def set_lr_multiplier(self, multiplier: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * multiplier

    def step(self, skip: torch.Tensor | None = None, rows_merged: bool = False) -> None:
        """Every optimizer's step. `skip` (a 0-d device tensor, true/1 to skip) decides on the device whether
        the step happens, so a captured step can skip a non-finite one without a host read: fused AdamW reads
        it as its `found_inf` (torch's GradScaler hook: no update, step count unchanged), SparseAdagrad as its
        `skip`. Other optimizers have no such switch and are an error. `rows_merged`: the sparse gradients are
        already `merge_sparse_gradients_`'s slots, so SparseAdagrad does not merge them again."""
        if skip is not None:
            problem = self.device_skip_problem()
            if problem:
                raise OptimizerError(f"OptimizerSet.step(skip=...): {problem}")
        for opt in self.optimizers:
            switches = {}
            if skip is not None:
                dense = opt is self.dense
                switches["found_inf" if dense else "skip"] = skip.to(torch.float32 if dense else torch.bool)
            if rows_merged and opt is self.sparse:
                switches["rows_merged"] = True
            for attribute, value in switches.items():
                setattr(opt, attribute, value)
            try:
                opt.step()
            finally:
                for attribute in switches:
                    delattr(opt, attribute)

    @property
    def takes_merged_rows(self) -> bool:
        """Whether the sparse optimizer takes `merge_sparse_gradients_`'s slots as they are: SparseAdagrad,
        for which a zero slot changes nothing (another optimizer may count a zero-valued row as touched)."""
        from .sparse_adagrad import SparseAdagrad

        return self.sparse is None or isinstance(self.sparse, SparseAdagrad)

    def device_skip_problem(self) -> str | None:
        """Why `step(skip=...)` cannot gate these optimizers on the device (None when it can)."""
        from .sparse_adagrad import SparseAdagrad

        dense = self.dense
        if dense is not None and not (isinstance(dense, torch.optim.AdamW)
                                      and all(g.get("fused") for g in dense.param_groups)):
            return (f"the dense optimizer {type(dense).__name__} cannot skip a step on the device: use "
                    "fused_adamw (its found_inf switch)")
        if self.sparse is not None and not isinstance(self.sparse, SparseAdagrad):
            return f"the sparse optimizer {type(self.sparse).__name__} cannot skip a step on the device"
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def reset_state_(self) -> None:
        """Every optimizer's state back to that of a fresh optimizer, in place (the same memory, which a
        captured CUDA graph goes on reading: models.captured): step counts and moment buffers 0, sparse
        Adagrad's accumulator its initial value. Only for optimizers whose state has that meaning (torch's
        AdamW, SparseAdagrad); others are an error naming them."""
        from .sparse_adagrad import SparseAdagrad

        for opt in self.optimizers:
            if not isinstance(opt, (torch.optim.AdamW, SparseAdagrad)):
                raise OptimizerError(f"reset_state_: {type(opt).__name__}'s state has no known fresh value "
                                     "(AdamW and SparseAdagrad only)")
            for group in opt.param_groups:
                fresh = group.get("initial_accumulator_value", 0.0)
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    for key, value in state.items():
                        if torch.is_tensor(value):
                            value.fill_(fresh if key == "sum" else 0)
                        else:
                            state[key] = 0

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict() if self.dense is not None else None,
                "sparse": self.sparse.state_dict() if self.sparse is not None else None}

    def load_state_dict(self, state: dict) -> None:
        for name in ("dense", "sparse"):
            opt = getattr(self, name)
            if (opt is None) != (state.get(name) is None):
                raise OptimizerError(f"OptimizerSet.load_state_dict: the saved state's {name} part does not "
                                     "match this set's")
            if opt is not None:
                opt.load_state_dict(state[name])


@torch.no_grad()
def merge_sparse_gradients_(params: Iterable[torch.Tensor], fixed_size: bool = True) -> None:
    """Each sparse gradient replaced by its duplicate rows summed in fp32 and rounded once to its dtype, so that
    the grad-norm clip and the sparse optimizer take it as it is (`rows_merged=True`) instead of each merging
    the pieces again. fixed_size (or off the CPU): embedding_bag.merge_rows's slots, one per piece (every
    touched row once, the other slots zeros spread over the rows; no device-to-host sync). Otherwise a CPU
    gradient keeps only its distinct rows (coalesced: the step then touches each row once instead of once per
    piece; the count is read, which on the CPU waits for nothing). A coalesced gradient is left as it is."""
    for p in params:
        g = p.grad
        if g is None or not g.is_sparse or g.is_coalesced() or g.sparse_dim() != 1:
            continue
        indices, values = g._indices(), g._values()
        if not fixed_size and g.device.type == "cpu":
            summed = torch.sparse_coo_tensor(indices, values.float(), g.shape, check_invariants=False).coalesce()
            p.grad = torch.sparse_coo_tensor(summed._indices(), summed._values().to(g.dtype), g.shape,
                                             is_coalesced=True, check_invariants=False)
            continue
        rows, sums = merge_rows(indices[0], values, spread=p.shape[0])
        p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), sums.to(g.dtype), g.shape, check_invariants=False)


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], rows_merged: bool = False) -> torch.Tensor:
    """The L2 norm over all gradients, dense and sparse, as a 0-d fp32 tensor (no host sync).

    Duplicate rows of a sparse gradient are summed before squaring (embedding_bag.merge_rows: fixed-size, no
    sync), exactly as the optimizer sees them; the gradient itself is left as it is. `rows_merged`: the sparse
    gradients are `merge_sparse_gradients_`'s slots already (their zero slots add nothing to the norm).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    parts: list[torch.Tensor] = []
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        device = device or g.device
        if g.is_sparse:
            merged = rows_merged or g.is_coalesced()
            values = g._values() if merged else merge_rows(g._indices()[0], g._values())[1]
            parts.append(torch.linalg.vector_norm(values, dtype=torch.float32).reshape(1))
        else:
            by_dtype.setdefault(g.dtype, []).append(g)
    if device is None:
        raise OptimizerError("global_grad_norm: no parameter has a gradient (was backward called?)")
    for grads in by_dtype.values():
        parts.append(torch.stack(torch._foreach_norm(grads)).to(torch.float32))
    flat = torch.cat([t.to(device) for t in parts])
    return torch.linalg.vector_norm(flat)


@torch.no_grad()
def clip_global_grad_norm(params: Iterable[torch.Tensor], max_norm: float, rows_merged: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale all gradients (dense and sparse) so that their global norm is at most max_norm.

    Returns (norm before clipping, the factor applied), both 0-d device tensors; no host sync. A
    non-finite norm makes the factor NaN, so a step that is not skipped shows it instead of hiding it.
    `rows_merged` as in `global_grad_norm`.
    """
    if not max_norm > 0:
        raise OptimizerError(f"max_grad_norm must be > 0 (or None for no clipping), got {max_norm!r}")
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, rows_merged)
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    dense = [p.grad for p in params if not p.grad.is_sparse]
    if dense:
        torch._foreach_mul_(dense, coef.to(dense[0].device))
    for p in params:
        if p.grad.is_sparse:
            p.grad._values().mul_(coef.to(p.grad.device))  # a view of the values, coalesced or not
    return norm, coef


def train_step(
    loss: torch.Tensor,
    optimizers: OptimizerSet,
    max_grad_norm: float | None = 1.0,
    lr_multiplier: float | None = None,
    skip_nonfinite: bool = True,
    after_backward=None,
    read: bool = True,
) -> dict:
    """One optimisation step from a scalar loss; gradients are set to None afterwards.

    Order: loss.backward() -> `after_backward()` when given (a compiled model's captured table gradients
    become the tables' gradients there: models.compiled) -> each sparse gradient's duplicate rows merged once
    (`merge_sparse_gradients_`, for the clip and the sparse step alike, where the sparse optimizer takes merged
    slots: `OptimizerSet.takes_merged_rows`) -> clip the global grad norm over dense and sparse
    gradients (skipped when max_grad_norm is None) -> dense step (orthogonal_adamw transforms its gradients
    first) -> sparse step. With skip_nonfinite, a non-finite loss or grad norm skips both steps. Returns loss,
    grad_norm (before clipping), clip_coef, lr_multiplier and skipped, as floats (skip_nonfinite then costs one
    host sync before the optimizers); with read=False loss, grad_norm, clip_coef and skipped stay 0-d device
    tensors and the skip is decided on the device (`OptimizerSet.step(skip=...)`: fused AdamW and sparse
    Adagrad), so the step never waits for the device and can be captured in a CUDA graph.
    """
    if loss.dim() != 0 and loss.numel() != 1:
        raise OptimizerError(f"train_step needs a scalar loss, got shape {tuple(loss.shape)}")
    if skip_nonfinite and not read:
        problem = optimizers.device_skip_problem()
        if problem:
            raise OptimizerError(f"train_step: skip_nonfinite without a host read (read=False): {problem}; or "
                                 "pass skip_nonfinite=False")
    loss.backward()
    if after_backward is not None:
        after_backward()
    params = optimizers.parameters()
    merged = optimizers.takes_merged_rows
    if merged:  # with read=False nothing waits for the device, so the merged gradient keeps its fixed size
        merge_sparse_gradients_(params, fixed_size=not read)
    if max_grad_norm is None:
        norm = global_grad_norm(params, rows_merged=merged)
        coef = torch.ones_like(norm)
    else:
        norm, coef = clip_global_grad_norm(params, max_grad_norm, rows_merged=merged)
    if lr_multiplier is not None:
        optimizers.set_lr_multiplier(lr_multiplier)
    skipped = False
    values = [loss.detach().float().reshape(()), norm, coef]
    if skip_nonfinite and read:
        values = torch.stack(values).tolist()
        skipped = not all(map(_finite, values[:2]))
        if not skipped:
            optimizers.step(rows_merged=merged)
    elif skip_nonfinite:
        skipped = ~(torch.isfinite(values[0]) & torch.isfinite(norm))
        optimizers.step(skip=skipped, rows_merged=merged)
    else:
        optimizers.step(rows_merged=merged)
        if read:
            values = torch.stack(values).tolist()
    optimizers.zero_grad(set_to_none=True)
    return {"loss": values[0], "grad_norm": values[1], "clip_coef": values[2],
            "lr_multiplier": 1.0 if lr_multiplier is None else lr_multiplier, "skipped": skipped}


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
