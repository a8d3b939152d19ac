"""Bad input for the converter and pcvr_lib.data.parquet.open_dataset: missing columns, wrong types, nulls
where none may be, files that are not parquet."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from accuracy_tests.convert_cases import make_batch, small_schema
from pcvr_lib.data.convert import Converter
from pcvr_lib.data.parquet import DataError, MissingColumnError, open_dataset

# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def test_missing_column_raises_key_error_naming_it(backend):
    schema = small_schema()
    rb = make_batch(schema, [{}])
    rb = rb.drop_columns(["user_int_feats_2"])
    with pytest.raises(KeyError, match="user_int_feats_2"):
        Converter(schema, backend=backend)(rb)


def test_missing_item_dense_column_raises(backend):
    schema = small_schema()
    rb = make_batch(schema, [{}]).drop_columns(["item_dense_feats_7"])
    with pytest.raises(MissingColumnError, match="item_dense_feats_7"):
        Converter(schema, backend=backend)(rb)


@pytest.mark.parametrize(
    "column,arrow_type,expected",
    [
        ("user_int_feats_1", pa.list_(pa.int64()), "int64"),
        ("user_int_feats_2", pa.int64(), "list<int64>"),
        ("user_dense_feats_2", pa.list_(pa.float64()), "list<float>"),
        ("sq_8", pa.list_(pa.int32()), "list<int64>"),
        ("timestamp", pa.int32(), "int64"),
        ("label_type", pa.string(), "int32"),
    ],
)
def test_wrong_type_names_column_found_and_expected(backend, column, arrow_type, expected):
    schema = small_schema()
    rb = make_batch(schema, [{}])
    value = {pa.string(): "x", pa.int64(): 1, pa.int32(): 1}.get(arrow_type, [])
    rb = rb.set_column(rb.schema.get_field_index(column), column, pa.array([value], arrow_type))
    with pytest.raises(DataError, match=rf"column '{column}' has type .+, expected {expected}"):
        Converter(schema, backend=backend)(rb)


def test_null_element_inside_list_raises(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"sq_8": [1, None, 3], "sq_9": [1, 2, 3]}])
    with pytest.raises(DataError, match=r"column 'sq_8': 1 null element\(s\) inside lists \(first in row 0\)"):
        Converter(schema, backend=backend)(rb)


def test_null_timestamp_raises(backend):
    schema = small_schema()
    rb = make_batch(schema, [{}, {"timestamp": None}])
    with pytest.raises(DataError, match=r"column 'timestamp': 1 null request timestamp\(s\) \(first in row 1\)"):
        Converter(schema, backend=backend)(rb)


def test_non_arrow_input_raises():
    with pytest.raises(TypeError, match="RecordBatch or Table"):
        Converter(small_schema())({"timestamp": [1]})


def _write(path, schema, rows):
    pq.write_table(pa.Table.from_batches([make_batch(schema, rows)]), path)
    return path


def test_open_dataset_ok_and_bad_files(tmp_path):
    schema = small_schema()
    good = _write(tmp_path / "good.parquet", schema, [{}, {}])
    assert open_dataset(good, schema).metadata.num_rows == 2
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        open_dataset(tmp_path / "missing.parquet", schema)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty file"):
        open_dataset(empty, schema)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match="not a readable parquet file"):
        open_dataset(truncated, schema)
    text = tmp_path / "text.parquet"
    text.write_text("hello, not parquet\n")
    with pytest.raises(DataError, match="not a readable parquet file"):
        open_dataset(text, schema)
    zero = _write(tmp_path / "zero.parquet", schema, [])
    with pytest.raises(DataError, match="zero rows"):
        open_dataset(zero, schema)


def test_open_dataset_missing_column_and_wrong_type(tmp_path):
    schema = small_schema()
    table = pa.Table.from_batches([make_batch(schema, [{}])])
    pq.write_table(table.drop_columns(["sq_10"]), tmp_path / "a.parquet")
    with pytest.raises(MissingColumnError, match="'sq_10'"):
        open_dataset(tmp_path / "a.parquet", schema)
    col = table.schema.get_field_index("user_id")
    pq.write_table(table.set_column(col, "user_id", pa.array(["u"])), tmp_path / "b.parquet")
    with pytest.raises(DataError, match="column 'user_id' has type string, expected int64"):
        open_dataset(tmp_path / "b.parquet", schema)

