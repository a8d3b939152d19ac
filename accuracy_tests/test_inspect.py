"""`pcvr inspect`: its counts against independent ones, the JSON output, and --verify on a corrupt page."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from accuracy_tests.convert_reference import row_order
from pcvr_lib.cli import main
from pcvr_lib.data.convert import ORDER_CLASSES
from pcvr_lib.data.generate import generate_table
from pcvr_lib.data.inspect_file import inspect_file
from pcvr_lib.schema import load_schema

SCHEMA = "fixtures/sample_1000_raw.schema.json"


@pytest.fixture(scope="module")
def schema(repo_root):
    return load_schema(repo_root / SCHEMA)


@pytest.fixture(scope="module")
def mixed_file(schema, tmp_path_factory):
    """150 rows, half of them newest first, in 3 row groups."""
    path = tmp_path_factory.mktemp("inspect") / "mixed.parquet"
    pq.write_table(generate_table(schema, 150, seed=5, list_order="mixed"), path, row_group_size=50)
    return path


def test_counts_match_independent_ones(schema, mixed_file):
    report = inspect_file(mixed_file, schema, verify=True)
    table = pq.read_table(mixed_file)
    assert report["rows"] == 150 and report["row_groups"] == 3 and report["bytes"] == mixed_file.stat().st_size
    assert report["corrupt"] == [] and report["verified"] is True
    for domain in schema.domains:
        lists = table.column(domain.ts_feature.column).to_pylist()
        want = dict.fromkeys(ORDER_CLASSES, 0)
        for cell in lists:
            want[row_order(cell or [])] += 1
        got = report["domains"][domain.name]
        assert got["list_order_rows"] == want
        assert want["newest_first"] > 30 and want["newest_last"] > 30
        lengths = np.array([len(c or []) for c in lists])
        assert got["length"]["max"] == lengths.max()
        assert got["length"]["p50"] == np.percentile(lengths, 50)
        assert got["length"]["share_longer_than_max_len"] == pytest.approx((lengths > domain.max_len).mean())
    for feat in schema.user_int + schema.item_int + tuple(f for d in schema.domains for f in d.side_features):
        cells = table.column(feat.column).to_pylist()
        flat = [x for c in cells for x in (c if isinstance(c, list) else [c]) if x is not None]
        oob = sum(x >= feat.vocab_size for x in flat) if feat.vocab_size else 0
        assert report["out_of_vocab"].get(feat.column, 0) == oob, feat.column
        assert report["null_rows"].get(feat.column, 0) == sum(c is None for c in cells), feat.column


def test_cli_json_and_verify_of_a_corrupt_page(schema, mixed_file, tmp_path, capsys, repo_root):
    assert main(["inspect", str(mixed_file), "--schema", str(repo_root / SCHEMA), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 150 and set(report["domains"]) == {d.name for d in schema.domains}

    meta = pq.ParquetFile(mixed_file).metadata
    group = meta.row_group(1)
    name = schema.domains[0].side_features[0].column
    chunk = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema.startswith(name))
    data = bytearray(mixed_file.read_bytes())
    data[chunk.data_page_offset + 64 : chunk.data_page_offset + 320] = bytes(256)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    assert main(["inspect", str(bad), "--schema", str(repo_root / SCHEMA), "--verify", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT row group 1 column {name}" in out
    assert main(["inspect", str(bad), "--schema", str(repo_root / SCHEMA), "--no-progress"]) == 2
    assert "bad.parquet: row group 1 cannot be decoded" in capsys.readouterr().err
