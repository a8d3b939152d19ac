"""tools/loader_ceiling.py on a small generated file: its independent decode processes read the rows the loader
yields (every row group once per pass), and their rows/s sum over the processes."""

from __future__ import annotations

import pathlib

from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.schema import load_schema
from smoke_tests.tool_loader import load_tool

SCHEMA = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "sample_1000_raw.schema.json"


def test_ceiling_reads_what_the_loader_yields(tmp_path):
    tool = load_tool("loader_ceiling")
    schema = load_schema(SCHEMA)
    path = generate_dataset(schema, rows=300, row_group_size=100, cache_dir=tmp_path, progress=False)
    expected = 300 * tool.PASSES
    assert tool.loader_rows(path, schema, 0) == expected
    assert tool.decode_rows(path, schema.converter_columns) == expected
    rate = tool.independent("decode", path, SCHEMA, 2)
    assert 0 < rate < float("inf")
