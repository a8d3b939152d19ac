"""Orthogonal AdamW: a norm-preserving Newton-Schulz transform of each matrix gradient, then AdamW.

The transform (the reference's): a gradient with ndim >= 2 is seen as (rows, prod(rest)) in fp32, on its
wide orientation (rows <= cols), divided by its Frobenius norm, given `ns_steps` (2) iterations of
X <- 1.5 X - 0.5 (X X^T) X, and multiplied by the original norm. Vectors and biases keep their gradient.
It is the first stage of `step()`, so the training order clip -> transform -> dense step holds.

AdamW itself is torch's, fused where torch has a fused kernel for CUDA (`fused=None`), else torch's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import BETAS, EPS, WEIGHT_DECAY, check_fused_supported, dense_grads
from .errors import OptimizerError, check_common
from .newton_schulz import CUBIC, newton_schulz_, safe_inverse_norm
from .stacking import Bucket, GraphRunner, make_buckets


def orthogonal_transform(g: torch.Tensor, steps: int = 2) -> torch.Tensor:
    """The norm-preserving transform of a (B, r, c) stack, computed in fp32; returns g's dtype."""
    x = g.to(torch.float32)
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    inv, norm = safe_inverse_norm(x)
    x = torch.nan_to_num_(x * inv, nan=0.0, posinf=0.0, neginf=0.0)
    x = newton_schulz_(x, steps, CUBIC) * norm  # a non-finite norm gives NaN here, on purpose
    if transpose:
        x = x.mT
    return x.to(g.dtype).contiguous()


@dataclass
class _TransformBucket:
    bucket: Bucket
    static_in: torch.Tensor | None = None
    runner: GraphRunner | None = None
    out_views: list | None = None


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
        self._cuda_graph = cuda_graph
        self._buckets: list[_TransformBucket] | None = None
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._buckets = None

    def _uses_graph(self, device: torch.device) -> bool:
        if device.type != "cuda":
            if self._cuda_graph:
                raise OptimizerError(f"orthogonal_adamw: cuda_graph=True needs CUDA parameters, got {device}")
            return False
        return True if self._cuda_graph is None else bool(self._cuda_graph)

    @torch.no_grad()
    def transform_gradients(self) -> None:
        """Replace every matrix gradient by its orthogonalised, norm-preserving version."""
        if self._buckets is None:
            mats = [p for g in self.param_groups for p in g["params"] if p.dim() >= 2]
            self._buckets = [_TransformBucket(b) for b in make_buckets(mats, "flatten")]
        for tb in self._buckets:
            bucket = tb.bucket
            params, grads = dense_grads("orthogonal_adamw", bucket.params)
            if len(params) < len(bucket.params):  # some have no gradient: transform the others eagerly
                if params:
                    sub = Bucket(bucket.key, params, bucket.m, bucket.n, [1] * len(params))
                    for p, v in zip(params, sub.views(orthogonal_transform(sub.gather(grads), self._ns_steps)),
                                    strict=True):
                        p.grad = v
                continue
            if self._uses_graph(params[0].device):
                if tb.runner is None:
                    tb.static_in = torch.empty((bucket.size, bucket.m, bucket.n), dtype=params[0].dtype,
                                               device=params[0].device)
                    tb.runner = GraphRunner(lambda tb=tb: orthogonal_transform(tb.static_in, self._ns_steps),
                                            state=[])
                bucket.gather(grads, out=tb.static_in)
                out = tb.runner()
                if tb.out_views is None:
                    tb.out_views = bucket.views(out)
                views = tb.out_views
            else:
                views = bucket.views(orthogonal_transform(bucket.gather(grads), self._ns_steps))
            # the transformed gradients are views of the stacked result: no copy back
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
