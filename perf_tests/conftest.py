"""perf_tests fixtures: the planted slowdowns used only to validate the comparison (perf_tests/planted.py)."""

import pytest

from perf_tests.planted import planted_norm_tile


@pytest.fixture(autouse=True)
def _planted_norm_tile(monkeypatch):
    """With PCVR_PLANTED_NORM_TILE set, the norm kernels run a deliberately worse tile (e.g. 256 elements per
    program against 2048): a known device-time regression that `pcvr diff` must flag."""
    tile = planted_norm_tile()
    if tile is not None:
        from pcvr_lib.kernels.rms_norm import config

        monkeypatch.setattr(config, "TILE_ELEMENTS", tile)
    yield
