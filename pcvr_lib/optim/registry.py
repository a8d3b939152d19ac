"""`build_optimizer(name, params, **options)`: one entry point for every optimizer of the suite."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .adamw import build_adamw
from .errors import OptimizerError
from .muon import Muon
from .orthogonal import OrthogonalAdamW
from .sparse_adagrad import SparseAdagrad
from .step import OptimizerSet


def _adamw(params, **options):
    if "fused" in options:
        raise OptimizerError("adamw: use the name fused_adamw instead of the option fused")
    return build_adamw(params, name="adamw", **options)


def _fused_adamw(params, **options):
    if "fused" in options or "foreach" in options:
        raise OptimizerError("fused_adamw: the options fused/foreach are fixed by the name")
    return build_adamw(params, fused=True, name="fused_adamw", **options)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "fused_adamw": _fused_adamw,
    "orthogonal_adamw": OrthogonalAdamW,
    "muon": Muon,
    "sparse_adagrad": SparseAdagrad,
}
DENSE_OPTIMIZERS = ("adamw", "fused_adamw", "orthogonal_adamw", "muon")


def build_optimizer(name: str, params, **options) -> torch.optim.Optimizer:
    """Build the optimizer `name` over `params` (tensors or param-group dicts).

    Options are the keyword arguments of the optimizer (lr, betas, eps, weight_decay; momentum, nesterov,
    ns_steps, ns_coefficients, adamw_lr, cuda_graph for muon; ...). A misspelt option is an error naming
    the accepted ones rather than being ignored.
    """
    try:
        factory = OPTIMIZERS[name]
    except KeyError:
        raise OptimizerError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}") from None
    try:
        return factory(params, **options)
    except TypeError as e:
        if "unexpected keyword argument" in str(e):
            raise OptimizerError(f"{name}: {e}") from None
        raise


def build_optimizer_set(
    dense_params,
    sparse_params=None,
    dense: str = "adamw",
    sparse: str = "sparse_adagrad",
    dense_options: dict | None = None,
    sparse_options: dict | None = None,
) -> OptimizerSet:
    """The usual pair: a dense optimizer for the model body and sparse Adagrad for its embedding tables.

    An empty parameter list gives no optimizer for that side.
    """
    if dense not in DENSE_OPTIMIZERS:
        raise OptimizerError(f"dense optimizer must be one of {', '.join(DENSE_OPTIMIZERS)}, got {dense!r}")
    dense_params = list(dense_params or [])
    sparse_params = list(sparse_params or [])
    return OptimizerSet(
        dense=build_optimizer(dense, dense_params, **(dense_options or {})) if dense_params else None,
        sparse=build_optimizer(sparse, sparse_params, **(sparse_options or {})) if sparse_params else None,
    )
