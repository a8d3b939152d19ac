"""Skip rules shared by the GPU accuracy tests."""

import pytest
import torch

from pcvr_lib.kernels import dispatch


def require_cuda_backend(op: str, backend: str) -> None:
    """Skip the calling test unless a CUDA device is present and `backend` of `op` can run on it (the registry
    answers for the device named, present or not, so the device check comes first)."""
    if not torch.cuda.is_available():
        pytest.skip(f"{backend}: no CUDA device")
    ok, reason = dispatch.backend_status(op, backend, "cuda")
    if not ok:
        pytest.skip(reason)
