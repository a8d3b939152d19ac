"""The benchmarks' shared pytest hooks: readable parametrize ids, the planted slowdowns of the validation runs,
`round_line` (the line a long case prints per round) and the plugin that keeps a cut run's results
(perf_tests/bench_plugin.py).

The peers are declared in perf_tests/peers.py; the case runner is perf_tests/kernel_bench.py.
"""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels.norms import config as norms_config
from pcvr_lib.kernels.tolerance import DTYPE_NAMES
from perf_tests.planted import plant_host_delay, planted_host_us, planted_norm_tile


def pytest_configure(config):
    """A run stopped by SIGINT, SIGTERM or a timeout still writes the JSON of its finished cases, marked cut."""
    if not config.pluginmanager.has_plugin("perf_tests.bench_plugin"):
        config.pluginmanager.import_plugin("perf_tests.bench_plugin")


def pytest_make_parametrize_id(config, val, argname):
    """`argname=value` for dtypes and shapes that a test did not name itself (dtype=bf16, shape=8192x128)."""
    if isinstance(val, torch.dtype):
        return f"{argname}={DTYPE_NAMES.get(val, str(val).replace('torch.', ''))}"
    if isinstance(val, tuple) and val and all(isinstance(v, int) for v in val):
        return f"{argname}={'x'.join(map(str, val))}"
    return None


@pytest.fixture(autouse=True)
def _planted_norm_tile(monkeypatch):
    """With PCVR_PLANTED_NORM_TILE set (only for validating the comparison: perf_tests/planted.py), the norm
    kernels run a deliberately worse tile (e.g. 256 elements per program against 2048): a known device-time
    regression that `pcvr diff` must flag."""
    tile = planted_norm_tile()
    if tile is not None:
        monkeypatch.setattr(norms_config, "TILE_ELEMENTS", tile)
    yield


@pytest.fixture(autouse=True)
def _planted_host_delay(monkeypatch):
    """With PCVR_PLANTED_HOST_US set (only for validating the comparison: perf_tests/planted.py), the Triton
    RMSNorm forward wrapper spins that long in Python before its launch: a host-only regression (the
    device work is unchanged) that `pcvr diff` must flag by counted work, in those cases only."""
    us = planted_host_us()
    if us is not None:
        plant_host_delay(monkeypatch, us)
    yield


@pytest.fixture
def round_line(request):
    """`round_line(text)` prints `<test id>: <text>` on the terminal at once, past pytest's capture and
    whatever the verbosity: the data cases' rounds take seconds each, and `make bench` (-q) would otherwise
    show one dot per case after all of its rounds."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(text: str) -> None:
        if reporter is None or capture is None:  # e.g. a pytest-xdist worker: no terminal of its own
            return
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()  # after a -v test name
            if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
                reporter.write("\n")  # after -q's dots
            reporter.write_line(f"{request.node.nodeid}: {text}", flush=True)

    return write
