"""PCVR models: the shared building blocks (common.py, sequences.py), the operator call sites on each backend
(kernel_ops.py), one module per model, and a registry by name."""

from pcvr_lib.models import (  # noqa: F401 - registers the models
    baseline,
    dualq,
    interformer,
    onetrans,
    queryformer,
    symbiosis,
    tokenformer,
)
from pcvr_lib.models.common import ModelConfig, PCVRModel
from pcvr_lib.models.registry import MODELS, build_model, model_class, model_names

__all__ = ["MODELS", "ModelConfig", "PCVRModel", "build_model", "model_class", "model_names"]
