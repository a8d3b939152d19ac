"""Fixtures of the attention accuracy tests (test_attention.py, test_attention_gpu.py) and of the converter's
(test_convert*.py: both backends, the demo schema and batches of generated demo data)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from accuracy_tests.convert_cases import DEMO_SCHEMA
from pcvr_lib.data.convert import NativeUnavailable, native_library
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.schema import load_schema


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


@pytest.fixture(scope="module", params=["numpy", "native"])
def backend(request):
    """Both converter backends; native is skipped (with the reason) where it cannot be built."""
    if request.param == "native":
        try:
            native_library()
        except NativeUnavailable as exc:
            pytest.skip(f"native converter kernels unavailable: {exc}")
    return request.param


@pytest.fixture(scope="module")
def demo_schema(repo_root):
    return load_schema(repo_root / DEMO_SCHEMA)


@pytest.fixture(scope="module")
def demo_batches(demo_schema, data_cache_dir):
    path = generate_dataset(demo_schema, rows=200, seed=3, row_group_size=100, cache_dir=data_cache_dir, progress=False)
    return list(pq.ParquetFile(path).iter_batches(batch_size=72))
