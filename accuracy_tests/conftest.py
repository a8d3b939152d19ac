"""Fixtures of the attention accuracy tests (test_attention.py, test_attention_gpu.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_tile_routed(monkeypatch):
    """Route the one-tile backward for every head dim it has a tile for, whatever the default
    (config.TRITON_ONE_TILE_DEFAULT_DIMS) says."""
    from pcvr_lib.kernels.attention import triton_impl

    monkeypatch.setattr(triton_impl, "TRITON_ONE_TILE_DEFAULT_DIMS", frozenset(triton_impl.TRITON_BWD_ONE_TILE_CONFIGS))


@pytest.fixture
def launched_kernels(monkeypatch):
    """The names of the Triton attention kernels launched during the test, in order ("fwd", "bwd_dq", ...)."""
    from pcvr_lib.kernels import _triton

    launched = []
    jit = _triton.Launcher.jit

    def record(self, *args, **kwargs):
        launched.append(self.name.removeprefix("flash_attention."))
        return jit(self, *args, **kwargs)

    monkeypatch.setattr(_triton.Launcher, "jit", record)
    return launched
