"""Optimizers of the suite: AdamW (torch, fused), orthogonal AdamW, Muon and sparse Adagrad.

Typical use in a trainer::

    opts = build_optimizer_set(model_dense_params, model_embedding_tables,
                               dense="adamw", dense_options=dict(lr=1e-4, betas=(0.9, 0.98)),
                               sparse_options=dict(lr=0.05))
    for step, batch in enumerate(loader):
        loss = model.loss(batch)
        info = train_step(loss, opts, max_grad_norm=1.0,
                          lr_multiplier=lr_multiplier(step, warmup_steps=100, total_steps=n, decay="cosine"))
"""

from .adamw import check_fused_supported, foreach_adamw_
from .errors import OptimizerError, UnsupportedOptimizer
from .muon import Muon
from .newton_schulz import CUBIC, QUINTIC, orthogonality_error, orthogonalize
from .orthogonal import OrthogonalAdamW, orthogonal_transform
from .registry import DENSE_OPTIMIZERS, OPTIMIZERS, build_optimizer, build_optimizer_set
from .schedule import lr_multiplier
from .sparse_adagrad import SparseAdagrad
from .step import OptimizerSet, clip_global_grad_norm, global_grad_norm, merge_sparse_gradients_, train_step

__all__ = [
    "CUBIC", "DENSE_OPTIMIZERS", "OPTIMIZERS", "QUINTIC", "Muon", "OptimizerError", "OptimizerSet",
    "OrthogonalAdamW", "SparseAdagrad", "UnsupportedOptimizer", "build_optimizer", "build_optimizer_set",
    "check_fused_supported", "clip_global_grad_norm", "foreach_adamw_", "global_grad_norm", "lr_multiplier",
    "merge_sparse_gradients_", "orthogonal_transform", "orthogonality_error", "orthogonalize", "train_step",
]
