"""Muon: momentum, then Newton-Schulz orthogonalisation of each weight matrix's update.

Per matrix parameter W (ndim >= 2; a 3-D parameter is a stack of matrices over its leading dims):

    M <- momentum * M + (1 - momentum) * G          (M.lerp_(G, 1 - momentum))
    U <- G + momentum * (M - G) if nesterov else M   (G.lerp(M, momentum))
    O <- NewtonSchulz(U / ||U||_F), ns_steps iterations (zero if ||U|| is tiny or not finite)
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

Vectors, biases and parameters of a group marked `use_muon=False` take a multi-tensor AdamW step (betas
(0.9, 0.98), eps 1e-8, lr `adamw_lr`, default lr) instead: torch's fused multi-tensor kernel on CUDA (one
launch instead of eight for-each ops), the for-each formulation elsewhere (`adamw_fused` chooses).

Layout, all launch-count driven (small models make optimizer steps launch-bound):
- all gradients of a group are copied with one for-each copy into one flat buffer; momentum is one flat
  buffer too, so the momentum and Nesterov updates are one kernel each for the whole group;
- same-shape matrices form (B, m, n) stacks, iterated with bmm (in bf16 on CUDA);
- stacks of different shapes are merged into one zero-padded stack when the padding costs at most
  `merge_flops` extra Gram FLOPs (exact: zero padding commutes with the odd matrix polynomials; default
  3e8 on CUDA, 0 = one stack per shape on CPU);
- on CUDA that whole chain runs as one captured CUDA graph per group (`cuda_graph`, default on there);
  lr and weight decay stay outside it (two for-each ops), so lr schedules need no re-capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import BETAS, EPS, WEIGHT_DECAY, dense_grads, foreach_adamw_
from .errors import OptimizerError, check_common
from .newton_schulz import muon_scale, orthogonalize, resolve_coefficients
from .stacking import Bucket, GraphRunner, StackPlan, uses_cuda_graph


@dataclass
class _GroupPlan:
    layout: StackPlan
    grads: torch.Tensor  # flat, static input of the graph
    momentum: torch.Tensor  # flat; the per-parameter momentum buffers are views of it
    in_views: list[torch.Tensor]  # views of `grads` shaped like the parameters
    scales: list[float]  # per segment
    class_in: list[torch.Tensor]  # zero-padded class stacks
    runner: GraphRunner | None = None
    out_views: list[torch.Tensor] | None = None


# Merge stacks when padding costs at most this many extra Gram-matrix FLOPs (about 1 us of H200 bf16 time
# per Gram product; a merge saves ~20 launches). CPU FLOPs are dear: no merging there by default.
MERGE_FLOPS_CUDA = 3e8


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
        merge_flops: float | None = None,
        adamw_fused: bool | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ):
        # `betas` / `eps` are accepted as the AdamW part's, so one dense_options dict fits every optimizer
        adamw_betas = adamw_betas if betas is None else betas
        adamw_eps = adamw_eps if eps is None else eps
        adamw_lr = lr if adamw_lr is None else adamw_lr
        adamw_weight_decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        check_common("muon", lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay)
        check_common("muon (adamw part)", lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                     weight_decay=adamw_weight_decay)
        coefficients = resolve_coefficients(ns_coefficients)
        self._ns_dtype = ns_dtype
        self._cuda_graph = cuda_graph
        if merge_flops is not None and merge_flops < 0:
            raise OptimizerError(f"muon: merge_flops must be >= 0, got {merge_flops!r}")
        self._merge_flops = merge_flops
        self._adamw_fused = adamw_fused
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

    def _compute_dtype(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        if self._ns_dtype is not None:
            return self._ns_dtype
        return torch.bfloat16 if device.type == "cuda" else dtype

    def _plan(self, index: int, group: dict) -> _GroupPlan:
        plan = self._buckets.get(index)
        if plan is not None:
            return plan
        p0 = group["params"][0]
        merge = self._merge_flops
        if merge is None:
            merge = MERGE_FLOPS_CUDA if p0.device.type == "cuda" else 0.0
        layout = StackPlan(group["params"], "stack", merge)
        grads = torch.empty(layout.numel, dtype=p0.dtype, device=p0.device)
        momentum = torch.zeros_like(grads)
        for p, view in zip(layout.params, layout.param_views(momentum), strict=True):
            old = self.state[p].get("momentum_buffer")
            if old is not None:  # loaded from a state dict
                view.copy_(old)
            self.state[p]["momentum_buffer"] = view
        plan = _GroupPlan(
            layout, grads, momentum, layout.param_views(grads),
            [muon_scale(seg.bucket.m, seg.bucket.n) for seg in layout.segments],
            layout.class_buffers(p0.dtype, p0.device),
        )
        self._buckets[index] = plan
        return plan

    def _math(self, g: torch.Tensor, momentum_buf: torch.Tensor, group: dict, scale: float) -> torch.Tensor:
        """One same-shape (B, m, n) stack, eagerly (used when some parameters have no gradient)."""
        mu = group["momentum"]
        momentum_buf.lerp_(g, 1 - mu)
        u = g.lerp(momentum_buf, mu) if group["nesterov"] else momentum_buf
        o = orthogonalize(u, group["ns_steps"], group["ns_coefficients"], self._compute_dtype(g.device, g.dtype))
        return o.to(g.dtype, memory_format=torch.contiguous_format).mul_(scale)

    def _math_all(self, plan: _GroupPlan, group: dict) -> torch.Tensor:
        """The whole group from its flat gradient buffer to a flat buffer of scaled updates."""
        mu = group["momentum"]
        plan.momentum.lerp_(plan.grads, 1 - mu)
        u = plan.grads.lerp(plan.momentum, mu) if group["nesterov"] else plan.momentum
        plan.layout.scatter_to_classes(u, plan.class_in)
        dtype = self._compute_dtype(u.device, u.dtype)
        outs = [orthogonalize(x, group["ns_steps"], group["ns_coefficients"], dtype) for x in plan.class_in]
        out = torch.empty_like(plan.grads)
        plan.layout.gather_from_classes(outs, out, plan.scales)
        return out

    def _muon_group(self, index: int, group: dict) -> None:
        plan = self._plan(index, group)
        params = plan.layout.params
        grads = [p.grad for p in params]
        if any(g is None or g.is_sparse or g.dtype != plan.grads.dtype for g in grads):
            params, updates = self._partial_group(plan, group)
        else:
            torch._foreach_copy_(plan.in_views, grads)
            if uses_cuda_graph("muon", self._cuda_graph, params[0].device):
                if plan.runner is None:
                    plan.runner = GraphRunner(lambda: self._math_all(plan, group), state=[plan.momentum])
                out = plan.runner()
                if plan.out_views is None:
                    plan.out_views = plan.layout.param_views(out)
                updates = plan.out_views
            else:
                updates = plan.layout.param_views(self._math_all(plan, group))
        if not params:
            return
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_add_(params, updates, alpha=-lr)

    def _partial_group(self, plan: _GroupPlan, group: dict) -> tuple[list, list]:
        """Some parameters have no gradient this step: update only the others, eagerly, shape by shape."""
        dense_grads("muon", plan.layout.params)  # raises on a sparse gradient
        params, updates = [], []
        for seg, scale in zip(plan.layout.segments, plan.scales, strict=True):
            bucket = seg.bucket
            momentum_all = plan.layout.stack(plan.momentum, seg)
            chosen = [i for i, p in enumerate(bucket.params) if p.grad is not None]
            if not chosen:
                continue
            rows = torch.cat([
                torch.arange(bucket.starts[i], bucket.starts[i] + bucket.counts[i]) for i in chosen
            ]).to(plan.momentum.device)
            sub = Bucket(bucket.key, [bucket.params[i] for i in chosen], bucket.m, bucket.n,
                         [bucket.counts[i] for i in chosen])
            momentum = momentum_all.index_select(0, rows)
            out = self._math(sub.gather([p.grad.to(p.dtype) for p in sub.params]), momentum, group, scale)
            momentum_all.index_copy_(0, rows, momentum)
            params.extend(sub.params)
            updates.extend(sub.views(out))
        return params, updates

    # -- the AdamW part --------------------------------------------------------------------------------

    def _adamw_group(self, group: dict) -> None:
        params, grads = dense_grads("muon", group["params"])
        if not params:
            return
        fused = self._adamw_fused
        if fused is None:
            fused = params[0].device.type == "cuda"
        if fused:
            self._adamw_fused_step(group, params, grads)
            return
        by_step: dict[int, tuple[list, ...]] = {}
        for p, g in zip(params, grads, strict=True):
            st = self._adamw_state(p, tensor_step=False)
            st["step"] += 1
            lists = by_step.setdefault(st["step"], ([], [], [], []))
            for lst, t in zip(lists, (p, g, st["exp_avg"], st["exp_avg_sq"]), strict=True):
                lst.append(t)
        for step, (ps, gs, m1, m2) in by_step.items():
            foreach_adamw_(ps, gs, m1, m2, step, group["lr"], group["betas"], group["eps"],
                           group["weight_decay"])

    def _adamw_state(self, p: torch.Tensor, tensor_step: bool) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if tensor_step else 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif isinstance(st["step"], torch.Tensor) != tensor_step:
            raise OptimizerError("muon: the AdamW state was saved with the other adamw_fused setting")
        return st

    def _adamw_fused_step(self, group: dict, params: list, grads: list) -> None:
        """The same AdamW update through torch's fused multi-tensor kernel (one launch on CUDA)."""
        states = [self._adamw_state(p, tensor_step=True) for p in params]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [], steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
            amsgrad=False, maximize=False,
        )

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
