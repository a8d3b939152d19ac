"""What the data layer counts, checks and refuses before a command's work: lossy values (null labels, NaN /
infinite dense values, negative request timestamps) against independent counts, also after random bytes in a
dense column's pages; a file's own schema (footer, or schema.json beside it) against the run's; the memory a
generated table needs; a PCVR_CACHE_DIR that is a file; the converter's fallback said once."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accuracy_tests.convert_cases import SMALL, make_batch, small_schema
from pcvr_lib.data import convert, convert_native, generate
from pcvr_lib.data.inspect_file import inspect_file
from pcvr_lib.data.parquet import DataError, check_data_schema, data_schema, scan_values
from pcvr_lib.errors import CommandError
from pcvr_lib.schema import load_schema

TIMESTAMPS = st.one_of(st.sampled_from([-(2**63), -1, 0, 1, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))
LABELS = st.sampled_from([None, 0, 1, 2, -1, 2**31 - 1])
DENSE = st.sampled_from([0.5, -2.0, float("nan"), float("inf"), float("-inf")])


def _write(path, schema, rows: list[dict], **kw) -> None:
    pq.write_table(pa.Table.from_batches([make_batch(schema, rows)]), path, **kw)


def _independent(path, schema):
    """The counts ValueCounts should give, read back with pyarrow and counted with numpy."""
    table = pq.read_table(path)
    ts = table.column("timestamp").to_numpy()
    dense = {}
    for feat in schema.user_dense + schema.item_dense:
        values = np.array([x for cell in table.column(feat.column).to_pylist() for x in (cell or [])], dtype=np.float64)
        if (~np.isfinite(values)).any():
            dense[feat.column] = int((~np.isfinite(values)).sum())
    first = int(np.flatnonzero(ts < 0)[0]) if (ts < 0).any() else None
    return table.column("label_type").null_count, int((ts < 0).sum()), first, dense


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(LABELS, TIMESTAMPS, st.lists(DENSE, max_size=4)), min_size=1, max_size=40),
       st.integers(1, 17))
def test_value_counts_match_independent_ones(tmp_path, cells, group_rows):
    """Label and timestamp edge values, NaN / inf dense values, any row-group size: the counts, the first
    negative timestamp's row, the warnings and the refusal agree with a count made from the decoded file."""
    schema = small_schema()
    rows = [{"label_type": label, "timestamp": ts, "user_dense_feats_2": dense} for label, ts, dense in cells]
    path = tmp_path / "v.parquet"
    _write(path, schema, rows, row_group_size=group_rows)
    counts = scan_values(pq.ParquetFile(path), schema)
    null_labels, negative, first, dense = _independent(path, schema)
    assert (counts.rows, counts.null_labels, counts.negative_timestamps) == (len(rows), null_labels, negative)
    assert counts.non_finite_dense == dense
    warnings = counts.warnings(path)
    said = f"{null_labels:,} of {len(rows):,} rows have a null label_type"
    assert any(said in w for w in warnings) == bool(null_labels)
    assert any(f"{sum(dense.values()):,} dense values are NaN or infinite" in w for w in warnings) == bool(dense)
    assert counts.warnings(path, labels=False, dense=False) == []
    if first is None:
        counts.refuse_negative_timestamps(path)
    else:
        assert counts.first_negative_timestamp == (first, cells[first][1])
        with pytest.raises(DataError, match=rf"{negative:,} negative request timestamp\(s\) \(first in row {first}: "):
            counts.refuse_negative_timestamps(path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=12))
def test_random_bytes_in_dense_pages_are_counted(tmp_path, edits):
    """Bytes overwritten inside a dense column's (plain, uncompressed, unchecksummed) data page decode as other
    floats, some NaN or infinite: inspect and ValueCounts count exactly what the decoded file holds, or the
    file fails loudly; a changed value is never read as missing uncounted."""
    schema = small_schema()
    marker = np.full(3, 1.5, dtype=np.float32)  # 0x3fc00000, found in the file by its bytes
    rows = [{"user_dense_feats_2": marker.tolist(), "timestamp": 1000 + i} for i in range(60)]
    path = tmp_path / "d.parquet"
    _write(path, schema, rows, compression="NONE", use_dictionary=False)
    data = bytearray(path.read_bytes())
    start = bytes(data).find(np.tile(marker, 60).tobytes())
    assert start > 0
    for at, value in edits:
        data[start + at % (60 * 3 * 4)] = value
    path.write_bytes(bytes(data))
    try:
        _, _, _, dense = _independent(path, schema)
    except (OSError, pa.ArrowException):
        with pytest.raises((DataError, OSError, pa.ArrowException)):
            inspect_file(path, schema)
        return
    report = inspect_file(path, schema)
    assert report["values"]["non_finite_dense"] == dense
    assert scan_values(pq.ParquetFile(path), schema).non_finite_dense == dense


def test_inspect_reports_the_counts(tmp_path, capsys):
    from pcvr_lib.cli import main

    schema = small_schema()
    rows = [{"label_type": None, "timestamp": -5, "item_dense_feats_7": [float("nan"), 1.0]}, {"timestamp": 7}]
    path = tmp_path / "i.parquet"
    _write(path, schema, rows)
    (tmp_path / "s.json").write_text(json.dumps(SMALL))
    assert main(["inspect", str(path), "--schema", str(tmp_path / "s.json"), "--max-lens", "s:3,t:2"]) == 0
    out = capsys.readouterr().out
    assert "null labels: 1 (read as negative)" in out
    assert "negative request timestamps: 1 (first in row 0: -5; train, val and infer refuse them)" in out
    assert "NaN / infinite dense values: 1 in 1 column(s) (read as missing): item_dense_feats_7 1" in out


# ------------------------------------------------------------------------------- the file's own schema
def test_generated_files_carry_their_schema(tmp_path, repo_root):
    demo = load_schema(repo_root / "fixtures/sample_1000_raw.schema.json")
    online = load_schema(repo_root / "fixtures/online.schema.json")
    path = generate.generate_dataset(online, rows=20, out=tmp_path / "g" / "d.parquet", progress=False)
    alone = tmp_path / "alone" / "d.parquet"  # moved without its schema.json: the footer still says it
    alone.parent.mkdir()
    shutil.copy(path, alone)
    for file in (path, alone):
        theirs, where = data_schema(file)
        assert where == "its footer" and theirs == online
        check_data_schema(file, load_schema(online.raw, max_lens="seq_a:3"), "x", "y")  # lengths are run options
        with pytest.raises(DataError, match=r"holds data of another schema than --schema S: user_int fid 1 "
                                            r"vocab_size 5 vs 6; .* more \(first value the run's, second the data's, "
                                            r"from its footer\); fix it"):
            check_data_schema(file, demo, "--schema S", "fix it")


def test_schema_beside_a_file_without_footer(tmp_path):
    schema = small_schema()
    path = tmp_path / "d.parquet"
    _write(path, schema, [{}])
    assert data_schema(path) is None
    check_data_schema(path, schema, "x", "y")  # nothing to compare with
    (tmp_path / "schema.json").write_text(json.dumps({**SMALL, "user_dense": [[2, 4]]}))
    with pytest.raises(DataError, match=r"user_dense fid 2 dim 3 vs 4 \(first value the run's, second the data's, "
                                        r"from schema.json beside it\)"):
        check_data_schema(path, schema, "the checkpoint's schema", "score data of its schema")


# ------------------------------------------------------------------------------- generate, cache, converter
def test_memory_estimate_is_close_and_refuses_before_generating(tmp_path, repo_root, monkeypatch):
    schema = load_schema(repo_root / "fixtures/sample_1000_raw.schema.json")
    sample = generate.generate_table(schema, generate.MEMORY_SAMPLE_ROWS).nbytes / generate.MEMORY_SAMPLE_ROWS
    actual = generate.generate_table(schema, 1000).nbytes / 1000
    assert sample == pytest.approx(actual, rel=0.1)  # the per-row estimate holds at 5x the sample
    monkeypatch.setattr(generate, "available_memory", lambda: (50 * 2**20, "a test limit"))
    out = tmp_path / "big.parquet"
    wanted = (r"--rows 5,000: generating needs about [\d.,]+ [MG]B of memory \(.* KB per row of this schema; .*\), "
              r"more than the 50.0 MB available \(a test limit\); use at most --rows \d+ \(--multiplier \d+ repeats "
              r"it to 5,000 rows")
    with pytest.raises(CommandError, match=wanted):
        generate.generate_dataset(schema, rows=5000, out=out, progress=False)
    assert not out.exists()


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    for value in (afile, afile / "sub"):
        monkeypatch.setenv("PCVR_CACHE_DIR", str(value))
        with pytest.raises(CommandError, match=f"PCVR_CACHE_DIR={value}: {afile} is a file, not a folder; point "
                                               "PCVR_CACHE_DIR at a folder or unset it"):
            generate.default_cache_dir()
        # the converter's kernels live there too: an error, not a silent numpy fallback
        monkeypatch.setattr(convert_native, "_native_state", {})
        with pytest.raises(CommandError, match="PCVR_CACHE_DIR"):
            convert.Converter(small_schema())


def test_numpy_fallback_is_said_once(monkeypatch, capsys):
    def unavailable():
        raise convert.NativeUnavailable("no C compiler (cc/gcc) on PATH")

    monkeypatch.setattr(convert, "native_library", unavailable)
    monkeypatch.setattr(convert, "_fallback_warned", [])
    for _ in range(2):
        assert convert.Converter(small_schema()).backend == "numpy"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: the converter's native C kernels are unavailable (no C compiler (cc/gcc) on PATH); "
                   "converting with the slower numpy path"]
    assert convert.Converter(small_schema(), backend="numpy").native_unavailable is None  # asked for: no warning
    assert capsys.readouterr().err == ""
