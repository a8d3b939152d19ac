"""The op table (pcvr_lib.workloads.OPS) names every kernel op's files, each of them exists, and the README's
layout section is the table as `python -m pcvr_lib.workloads` prints it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcvr_lib.kernels import dispatch
from pcvr_lib.workloads import OPS, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_has_every_registered_op():
    assert set(OPS) == set(dispatch.ops())


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_file_of_an_op_exists(op):
    entry = OPS[op]
    for what in ("package", "workload", "accuracy_test", "benchmark", "notes"):
        path = ROOT / getattr(entry, what)
        assert path.exists(), f"{op}: {what} {path.relative_to(ROOT)} does not exist"
    for part in ("__init__.py", "config.py", "reference.py", "triton_impl.py", "tilelang_impl.py"):
        assert (ROOT / entry.package / part).exists(), f"{op}: {entry.package}/{part} missing (every op has one)"


def test_the_readme_shows_the_table():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README.md's layout table is not `python -m pcvr_lib.workloads`'s output"
