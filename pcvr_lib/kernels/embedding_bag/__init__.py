"""embedding_bag_mean: torch, Triton, TileLang and CUDA C++ (cuembed) backends; see dispatch.py."""

from .dispatch import BACKENDS, ID_DTYPES, OP, WEIGHT_DTYPES, backend_status, check_inputs, embedding_bag_mean
from .reference import reference_forward, reference_weight_grad, sanitize_ids, torch_embedding_bag_mean

__all__ = [
    "BACKENDS",
    "ID_DTYPES",
    "WEIGHT_DTYPES",
    "check_inputs",
    "embedding_bag_mean",
    "reference_forward",
    "reference_weight_grad",
    "sanitize_ids",
    "torch_embedding_bag_mean",
    "backend_status",
    "OP",
]
