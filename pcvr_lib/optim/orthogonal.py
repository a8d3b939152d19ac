"""Orthogonal AdamW: a norm-preserving Newton-Schulz transform of each matrix gradient, then AdamW.

The transform (the reference's): a gradient with ndim >= 2 is seen as (rows, prod(rest)) in fp32, on its
wide orientation (rows <= cols), divided by its Frobenius norm, given `ns_steps` (2) iterations of
X <- 1.5 X - 0.5 (X X^T) X, and rescaled to the original Frobenius norm. Vectors and biases keep their gradient.
It is the first stage of `step()`, so the training order clip -> transform -> dense step holds.

AdamW itself is torch's, fused where torch has a fused kernel for CUDA (`fused=None`), else torch's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import BETAS, EPS, WEIGHT_DECAY, check_fused_supported, dense_grads
from .errors import OptimizerError, check_common
from .muon import MERGE_FLOPS_CUDA
from .newton_schulz import CUBIC, newton_schulz_, safe_inverse_norm
from .stacking import Bucket, GraphRunner, StackPlan, uses_cuda_graph


def orthogonal_transform(g: torch.Tensor, steps: int = 2, compute_dtype: torch.dtype | None = None
                         ) -> torch.Tensor:
    """The norm-preserving transform of a (B, r, c) stack; returns g's dtype.

    Norms and the rescale are fp32; the iteration's matmuls run in `compute_dtype` (default fp32, the
    reference's; bf16 is the opt-in fast path on CUDA)."""
    x = g.to(torch.float32)
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    inv, norm = safe_inverse_norm(x)
    x = torch.nan_to_num_(x * inv, nan=0.0, posinf=0.0, neginf=0.0)
    if compute_dtype is not None and compute_dtype != torch.float32:
        x = newton_schulz_(x.to(compute_dtype), steps, CUBIC).to(torch.float32)
    else:
        x = newton_schulz_(x, steps, CUBIC)
    # back to the gradient's norm: the iteration changed ||x||_F (a non-finite norm gives NaN, on purpose)
    inv_x, _ = safe_inverse_norm(x)
    x = x * (inv_x * norm)
    if transpose:
        x = x.mT
    return x.to(g.dtype).contiguous()


@dataclass
class _Plan:
    """All matrix gradients copied into one flat buffer (one for-each copy), scattered into zero-padded
    class stacks (see stacking.StackPlan), transformed, and gathered into one flat output buffer whose
    views become the new gradients."""

    layout: StackPlan
    grads: torch.Tensor
    in_views: list[torch.Tensor]
    class_in: list[torch.Tensor]
    runner: GraphRunner | None = None
    out_views: list[torch.Tensor] | None = None


class OrthogonalAdamW(torch.optim.AdamW):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = BETAS,
        eps: float = EPS,
        weight_decay: float = WEIGHT_DECAY,
        ns_steps: int = 2,
        fused: bool | None = None,
        cuda_graph: bool | None = None,
        merge_flops: float | None = None,
        ns_dtype: torch.dtype | None = None,
    ):
        check_common("orthogonal_adamw", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     ns_steps=ns_steps)
        params = list(params)
        flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
        if not flat:
            raise OptimizerError("orthogonal_adamw: got an empty parameter list")
        if fused is None:
            fused = all(p.device.type == "cuda" for p in flat)
        if fused:
            check_fused_supported(flat, "orthogonal_adamw")
        self._ns_steps = ns_steps
        self._ns_dtype = ns_dtype
        self._cuda_graph = cuda_graph
        if merge_flops is not None and merge_flops < 0:
            raise OptimizerError(f"orthogonal_adamw: merge_flops must be >= 0, got {merge_flops!r}")
        self._merge_flops = merge_flops
        self._plan: _Plan | None = None
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plan = None

    def _transform_all(self, plan: _Plan) -> torch.Tensor:
        plan.layout.scatter_to_classes(plan.grads, plan.class_in)
        outs = [orthogonal_transform(x, self._ns_steps, self._ns_dtype) for x in plan.class_in]
        out = torch.empty_like(plan.grads)
        plan.layout.gather_from_classes(outs, out)
        return out

    def _make_plan(self) -> _Plan | None:
        mats = [p for g in self.param_groups for p in g["params"] if p.dim() >= 2]
        if not mats:
            return None
        p0 = mats[0]
        merge = self._merge_flops
        if merge is None:
            merge = MERGE_FLOPS_CUDA if p0.device.type == "cuda" else 0.0
        layout = StackPlan(mats, "flatten", merge)
        grads = torch.empty(layout.numel, dtype=p0.dtype, device=p0.device)
        # the transform runs in fp32: class stacks are fp32 whatever the parameter dtype
        return _Plan(layout, grads, layout.param_views(grads), layout.class_buffers(torch.float32, p0.device))

    @torch.no_grad()
    def transform_gradients(self) -> None:
        """Replace every matrix gradient by its orthogonalised, norm-preserving version."""
        if self._plan is None:
            self._plan = self._make_plan()
            if self._plan is None:
                return
        plan = self._plan
        params, grads = dense_grads("orthogonal_adamw", plan.layout.params)
        if len(params) < len(plan.layout.params) or any(g.dtype != plan.grads.dtype for g in grads):
            # some have no gradient (or an unusual dtype): transform the others eagerly, shape by shape
            for seg in plan.layout.segments:
                b = seg.bucket
                ps = [p for p in b.params if p.grad is not None]
                if ps:
                    sub = Bucket(b.key, ps, b.m, b.n, [1] * len(ps))
                    out = orthogonal_transform(sub.gather([p.grad for p in ps]), self._ns_steps, self._ns_dtype)
                    for p, v in zip(ps, sub.views(out), strict=True):
                        p.grad = v
            return
        torch._foreach_copy_(plan.in_views, grads)
        if uses_cuda_graph("orthogonal_adamw", self._cuda_graph, params[0].device):
            if plan.runner is None:
                plan.runner = GraphRunner(lambda: self._transform_all(plan), state=[])
            out = plan.runner()
            if plan.out_views is None:
                plan.out_views = plan.layout.param_views(out)
            views = plan.out_views
        else:
            views = plan.layout.param_views(self._transform_all(plan))
        # the transformed gradients are views of the flat result: no copy back
        for p, v in zip(params, views, strict=True):
            p.grad = v

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.transform_gradients()
        super().step()
        return loss
