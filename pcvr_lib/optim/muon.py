"""Muon: momentum, then Newton-Schulz orthogonalisation of each weight matrix's update.

Per matrix parameter W (ndim >= 2; a 3-D parameter is a stack of matrices over its leading dims):

    M <- momentum * M + (1 - momentum) * G          (M.lerp_(G, 1 - momentum))
    U <- G + momentum * (M - G) if nesterov else M   (G.lerp(M, momentum))
    O <- NewtonSchulz(U / ||U||_F), ns_steps iterations (zero if ||U|| is tiny or not finite)
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

Same-shape matrices are stacked and iterated with bmm (in bf16 on CUDA). Vectors, biases and parameters
of a group marked `use_muon=False` take a for-each AdamW step (betas (0.9, 0.98), eps 1e-8) instead.
On CUDA the stacked math of each bucket runs as one captured CUDA graph (`cuda_graph=True`, the
default there); its result equals the eager path's (accuracy_tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import BETAS, EPS, WEIGHT_DECAY, dense_grads, foreach_adamw_
from .errors import OptimizerError, check_common
from .newton_schulz import muon_scale, orthogonalize, resolve_coefficients
from .stacking import Bucket, GraphRunner, make_buckets


@dataclass
class _BucketState:
    bucket: Bucket
    momentum: torch.Tensor  # (B, m, n), the per-parameter momentum buffers are views of it
    scale: float
    static_in: torch.Tensor  # (B, m, n) view of the group's flat gradient buffer


@dataclass
class _GroupPlan:
    """The stacked layout of one Muon group: all its gradients are copied into one flat buffer with a
    single for-each copy, each bucket reads its (B, m, n) slice of it."""

    buckets: list[_BucketState]
    params: list[torch.Tensor]
    in_views: list[torch.Tensor]  # per parameter, views of the flat buffer shaped like the parameter
    runner: GraphRunner | None = None
    out_views: list[torch.Tensor] | None = None


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str = "cubic",
        weight_decay: float = WEIGHT_DECAY,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = BETAS,
        adamw_eps: float = EPS,
        adamw_weight_decay: float | None = None,
        ns_dtype: torch.dtype | None = None,
        cuda_graph: bool | None = None,
    ):
        adamw_lr = lr if adamw_lr is None else adamw_lr
        adamw_weight_decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        check_common("muon", lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay)
        check_common("muon (adamw part)", lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                     weight_decay=adamw_weight_decay)
        coefficients = resolve_coefficients(ns_coefficients)
        self._ns_dtype = ns_dtype
        self._cuda_graph = cuda_graph
        self._buckets: dict[int, _GroupPlan] = {}
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=coefficients,
            weight_decay=weight_decay, adamw_lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay, use_muon=None,
        )
        super().__init__(self._split_groups(params), defaults)

    @staticmethod
    def _split_groups(params) -> list[dict]:
        """Each user group becomes a Muon group (its matrices) and an AdamW group (the rest)."""
        params = list(params)
        if not params:
            raise OptimizerError("muon: got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        out = []
        for g in groups:
            ps = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
            marked = g.get("use_muon", None)
            rest = {k: v for k, v in g.items() if k not in ("params", "use_muon")}
            if marked is None:
                mats = [p for p in ps if p.dim() >= 2]
                vecs = [p for p in ps if p.dim() < 2]
            elif marked:
                bad = [tuple(p.shape) for p in ps if p.dim() < 2]
                if bad:
                    raise OptimizerError(f"muon: a group marked use_muon=True holds non-matrix shapes {bad}")
                mats, vecs = ps, []
            else:
                mats, vecs = [], ps
            if mats:
                out.append({**rest, "params": mats, "use_muon": True})
            if vecs:
                out.append({**rest, "params": vecs, "use_muon": False})
        return out

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if param_group["use_muon"] is False:
            # the AdamW part runs with its own lr and weight decay (group keys adamw_lr, adamw_weight_decay)
            param_group["lr"] = param_group["adamw_lr"]
            param_group["weight_decay"] = param_group["adamw_weight_decay"]
        self._buckets = {}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._buckets = {}  # re-stacks the loaded momentum buffers on the next step

    # -- the matrix part ---------------------------------------------------------------------------

    def _uses_graph(self, device: torch.device) -> bool:
        if device.type != "cuda":
            if self._cuda_graph:
                raise OptimizerError(f"muon: cuda_graph=True needs CUDA parameters, got device {device}")
            return False
        return True if self._cuda_graph is None else bool(self._cuda_graph)

    def _compute_dtype(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        if self._ns_dtype is not None:
            return self._ns_dtype
        return torch.bfloat16 if device.type == "cuda" else dtype

    def _plan(self, index: int, group: dict) -> _GroupPlan:
        plan = self._buckets.get(index)
        if plan is not None:
            return plan
        buckets = make_buckets(group["params"], "stack")
        p0 = group["params"][0]
        total = sum(b.size * b.m * b.n for b in buckets)
        flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
        states, params, in_views, offset = [], [], [], 0
        for bucket in buckets:
            bufs = [self.state[p].get("momentum_buffer") for p in bucket.params]
            bufs = [torch.zeros_like(p) if b is None else b for p, b in zip(bucket.params, bufs, strict=True)]
            momentum = bucket.gather(bufs)
            for p, view in zip(bucket.params, bucket.views(momentum), strict=True):
                self.state[p]["momentum_buffer"] = view
            size = bucket.size * bucket.m * bucket.n
            static_in = flat[offset : offset + size].view(bucket.size, bucket.m, bucket.n)
            offset += size
            states.append(_BucketState(bucket, momentum, muon_scale(bucket.m, bucket.n), static_in))
            params.extend(bucket.params)
            in_views.extend(bucket.views(static_in))
        plan = _GroupPlan(states, params, in_views)
        self._buckets[index] = plan
        return plan

    def _math(self, g: torch.Tensor, momentum_buf: torch.Tensor, group: dict, scale: float) -> torch.Tensor:
        mu = group["momentum"]
        momentum_buf.lerp_(g, 1 - mu)
        u = g.lerp(momentum_buf, mu) if group["nesterov"] else momentum_buf
        o = orthogonalize(u, group["ns_steps"], group["ns_coefficients"], self._compute_dtype(g.device, g.dtype))
        return o.to(g.dtype).mul_(scale)

    def _muon_group(self, index: int, group: dict) -> None:
        plan = self._plan(index, group)
        grads = [p.grad for p in plan.params]
        if any(g is None or g.is_sparse for g in grads) or len({g.dtype for g in grads}) != 1:
            params, updates = [], []
            for bs in plan.buckets:
                self._partial_bucket(bs, group, params, updates)
        else:
            torch._foreach_copy_(plan.in_views, grads)
            params = plan.params
            if self._uses_graph(params[0].device):
                if plan.runner is None:
                    plan.runner = GraphRunner(lambda: self._math_all(plan, group),
                                              state=[bs.momentum for bs in plan.buckets])
                outs = plan.runner()
                if plan.out_views is None:
                    plan.out_views = [v for bs, o in zip(plan.buckets, outs, strict=True)
                                      for v in bs.bucket.views(o)]
                updates = plan.out_views
            else:
                outs = self._math_all(plan, group)
                updates = [v for bs, o in zip(plan.buckets, outs, strict=True) for v in bs.bucket.views(o)]
        if not params:
            return
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_add_(params, updates, alpha=-lr)

    def _math_all(self, plan: _GroupPlan, group: dict) -> list[torch.Tensor]:
        return [self._math(bs.static_in, bs.momentum, group, bs.scale) for bs in plan.buckets]

    def _partial_bucket(self, bs: _BucketState, group: dict, params: list, updates: list) -> None:
        """Some parameters of the bucket have no gradient this step: update only the others, eagerly."""
        bucket = bs.bucket
        dense_grads("muon", bucket.params)  # raises on a sparse gradient
        chosen = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not chosen:
            return
        if len(chosen) == len(bucket.params):
            out = self._math(bucket.gather([p.grad.to(p.dtype) for p in bucket.params]), bs.momentum, group,
                             bs.scale)
            params.extend(bucket.params)
            updates.extend(bucket.views(out))
            return
        rows = torch.cat([
            torch.arange(bucket.starts[i], bucket.starts[i] + bucket.counts[i]) for i in chosen
        ]).to(bs.momentum.device)
        sub = Bucket(bucket.key, [bucket.params[i] for i in chosen], bucket.m, bucket.n,
                     [bucket.counts[i] for i in chosen])
        momentum = bs.momentum.index_select(0, rows)
        out = self._math(sub.gather([p.grad.to(p.dtype) for p in sub.params]), momentum, group, bs.scale)
        bs.momentum.index_copy_(0, rows, momentum)
        params.extend(sub.params)
        updates.extend(sub.views(out))

    # -- the AdamW part --------------------------------------------------------------------------------

    def _adamw_group(self, group: dict) -> None:
        params, grads = dense_grads("muon", group["params"])
        by_step: dict[int, tuple[list, ...]] = {}
        for p, g in zip(params, grads, strict=True):
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            lists = by_step.setdefault(st["step"], ([], [], [], []))
            for lst, t in zip(lists, (p, g, st["exp_avg"], st["exp_avg_sq"]), strict=True):
                lst.append(t)
        for step, (ps, gs, m1, m2) in by_step.items():
            foreach_adamw_(ps, gs, m1, m2, step, group["lr"], group["betas"], group["eps"],
                           group["weight_decay"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group(index, group)
            else:
                self._adamw_group(group)
        return loss
