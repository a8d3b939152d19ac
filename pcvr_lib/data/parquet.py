"""Opening and validating PCVR parquet files and Arrow columns against a schema.

Every column the converter reads has one expected Arrow type (data.md section 1):
`timestamp` int64, `label_type` int32, `user_id` int64, width-1 int features int64, width>1 int features
and sequence features list<int64>, dense features list<float>. Lists may also be large_list. A mismatch is
an error naming the column, the type found and the type expected; a missing column names the column.

A file's own schema (`data_schema`: the one `pcvr generate` writes into its footer, else the schema.json
beside it) must describe the same columns as the schema it is read with (`check_data_schema`): columns of
the same names under other vocabularies or dims would convert without an error and score wrongly.

Values read in a documented but lossy way are counted over a file (`ValueCounts`): null labels (read as
negative), non-finite dense values (read as missing) and negative request timestamps (refused by train, val
and infer: no time split or time filter means anything with them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pcvr_lib.schema import Schema, SchemaError, load_schema, parse_schema, schema_differences

SCHEMA_METADATA_KEY = b"pcvr.schema"  # the footer key under which pcvr generate stores the schema JSON
SCHEMA_BESIDE = "schema.json"

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


# ------------------------------------------------------------------------------------- the file's own schema
def data_schema(path: str | Path) -> tuple[Schema, str] | None:
    """(schema, where it was found) of the data file: its footer's pcvr.schema, else the schema.json beside it;
    None when it has neither (data written by other tools)."""
    path = Path(path)
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):
        metadata = {}  # an unreadable file is reported by whoever opens it
    if SCHEMA_METADATA_KEY in metadata:
        where = "its footer"
        try:
            return parse_schema(json.loads(metadata[SCHEMA_METADATA_KEY])), where
        except (ValueError, SchemaError) as exc:
            raise DataError(f"{path}: the schema in its footer is not valid ({exc}); regenerate the file") from exc
    beside = path.parent / SCHEMA_BESIDE
    if beside.is_file():
        return load_schema(beside), f"{SCHEMA_BESIDE} beside it"
    return None


def check_data_schema(path: str | Path, schema: Schema, what: str, fix: str) -> None:
    """Refuse data whose own schema (data_schema) differs from the run's `schema` (`what` names it: an option, a
    checkpoint's schema); the message lists the first differences, the run's value first, and says `fix`."""
    found = data_schema(path)
    if found is None:
        return
    theirs, where = found
    differences = schema_differences(schema, theirs)
    if differences:
        raise DataError(f"{path} holds data of another schema than {what}: {'; '.join(differences)} (first value "
                        f"the run's, second the data's, from {where}); {fix}")


# ------------------------------------------------------------------------------------- lossy values
def value_columns(schema: Schema) -> list[str]:
    """The columns ValueCounts reads: the two scalars it checks and every dense feature."""
    return ["timestamp", "label_type"] + [f.column for f in schema.user_dense + schema.item_dense]


@dataclass
class ValueCounts:
    """Values of a file the converter reads in a documented but lossy way, counted table by table (`add`)."""

    rows: int = 0
    null_labels: int = 0  # label_type null: read as negative
    negative_timestamps: int = 0  # request timestamp < 0
    first_negative_timestamp: tuple[int, int] | None = None  # (row, value)
    non_finite_dense: dict[str, int] = field(default_factory=dict)  # column -> NaN / inf values (read as missing)

    def add(self, table: pa.Table, schema: Schema, row_offset: int) -> None:
        self.rows += table.num_rows
        self.null_labels += table.column("label_type").null_count
        ts = table.column("timestamp").combine_chunks()
        negative = pc.fill_null(pc.less(ts, 0), False).to_numpy(zero_copy_only=False)
        if negative.any():
            row = int(np.flatnonzero(negative)[0])
            self.negative_timestamps += int(negative.sum())
            if self.first_negative_timestamp is None:
                self.first_negative_timestamp = (row_offset + row, int(ts[row].as_py()))
        for feat in schema.user_dense + schema.item_dense:
            values = pc.list_flatten(table.column(feat.column))
            bad = int(pc.sum(pc.invert(pc.is_finite(values))).as_py() or 0)
            if bad:
                self.non_finite_dense[feat.column] = self.non_finite_dense.get(feat.column, 0) + bad

    def warnings(self, path: str | Path, labels: bool = True, dense: bool = True) -> list[str]:
        """One line per kind of lossy value found (`labels`, `dense`: whether to report those: val reads the
        labels but scores the dense values as its model was trained on them, which training reported)."""
        out = []
        if labels and self.null_labels:
            out.append(f"{path}: {self.null_labels:,} of {self.rows:,} rows have a null label_type, read as negative "
                       "(not converted)")
        if dense and self.non_finite_dense:
            total = sum(self.non_finite_dense.values())
            top = ", ".join(f"{k} {v:,}" for k, v in sorted(self.non_finite_dense.items(), key=lambda kv: -kv[1])[:3])
            more = f" and {len(self.non_finite_dense) - 3} more" if len(self.non_finite_dense) > 3 else ""
            out.append(f"{path}: {total:,} dense values are NaN or infinite, read as missing, in "
                       f"{len(self.non_finite_dense)} column(s): {top}{more}")
        return out

    def refuse_negative_timestamps(self, path: str | Path) -> None:
        if self.negative_timestamps:
            row, value = self.first_negative_timestamp
            raise DataError(f"{path}: column 'timestamp': {self.negative_timestamps:,} negative request timestamp(s) "
                            f"(first in row {row}: {value}); request times are Unix seconds, and the time split and "
                            "time filter need them: fix or drop those rows")

    def to_dict(self) -> dict:
        return {"rows": self.rows, "null_labels": self.null_labels, "negative_timestamps": self.negative_timestamps,
                "first_negative_timestamp": self.first_negative_timestamp,
                "non_finite_dense": dict(self.non_finite_dense)}


def scan_values(parquet: pq.ParquetFile, schema: Schema) -> ValueCounts:
    """ValueCounts over every row group of an opened file (reads only value_columns)."""
    counts = ValueCounts()
    offset = 0
    for group in range(parquet.metadata.num_row_groups):
        table = parquet.read_row_group(group, columns=value_columns(schema))
        counts.add(table, schema, offset)
        offset += table.num_rows
    return counts
