"""Opening and validating PCVR parquet files and Arrow columns against a schema.

Every column the converter reads has one expected Arrow type (data.md section 1):
`timestamp` int64, `label_type` int32, `user_id` int64, width-1 int features int64, width>1 int features
and sequence features list<int64>, dense features list<float>. Lists may also be large_list. A mismatch is
an error naming the column, the type found and the type expected; a missing column names the column.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pcvr_lib.schema import Schema

INT64 = "int64"
INT32 = "int32"
LIST_INT64 = "list<int64>"
LIST_FLOAT = "list<float>"


class DataError(ValueError):
    """Input data (a file, a column, a value) does not match what the schema says."""


class MissingColumnError(DataError, KeyError):
    """A column the schema needs is not in the data (also a KeyError, like the reference's)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def expected_columns(schema: Schema) -> dict[str, str]:
    """Every column the converter reads -> its expected type name, in layout order."""
    out = {"timestamp": INT64, "label_type": INT32, "user_id": INT64}
    for feat in schema.user_int + schema.item_int:
        out[feat.column] = INT64 if feat.dim == 1 else LIST_INT64
    for feat in schema.user_dense + schema.item_dense:
        out[feat.column] = LIST_FLOAT
    for domain in schema.domains:
        for feat in domain.features:
            out[feat.column] = LIST_INT64
    return out


def type_matches(arrow_type: pa.DataType, expected: str) -> bool:
    if expected == INT64:
        return arrow_type == pa.int64()
    if expected == INT32:
        return arrow_type == pa.int32()
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    value_type = arrow_type.value_type
    return value_type == (pa.int64() if expected == LIST_INT64 else pa.float32())


def check_arrow_schema(arrow_schema: pa.Schema, schema: Schema, where: str = "batch") -> None:
    """Raise MissingColumnError / DataError unless every needed column is present with its type."""
    names = arrow_schema.names
    expected = expected_columns(schema)
    missing = [name for name in expected if name not in names]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingColumnError(f"{where}: missing column(s) {shown} required by the schema")
    for name, kind in expected.items():
        if names.count(name) > 1:
            raise DataError(f"{where}: column {name!r} appears {names.count(name)} times")
        found = arrow_schema.field(name).type
        if not type_matches(found, kind):
            raise DataError(f"{where}: column {name!r} has type {found}, expected {kind}")


def open_dataset(path: str | Path, schema: Schema) -> pq.ParquetFile:
    """Open a parquet file after checking it exists, is parquet, has rows and has every column with its type."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"parquet file not found: {path}")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (0 bytes), not a parquet file")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file (truncated or corrupt?): {exc}") from exc
    if parquet.metadata.num_rows == 0:
        raise DataError(f"{path}: the parquet file has zero rows")
    check_arrow_schema(parquet.schema_arrow, schema, where=str(path))
    return parquet
