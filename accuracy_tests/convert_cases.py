"""What the converter tests share: the small schema with every kind of column, batches built from per-row
dicts, and the exact comparison of a converted Batch with the per-row reference (convert_reference)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from pcvr_lib.data.parquet import expected_columns
from pcvr_lib.schema import load_schema

DEMO_SCHEMA = "fixtures/sample_1000_raw.schema.json"

# A small schema with every kind of column: width-1 and list ints, a vocab-0 column, dense, a sequence
# domain with two side features (one of vocab 0) and one with only its timestamp.
SMALL = {
    "format": "raw_parquet",
    "user_int": [[1, 10, 1], [2, 5, 3]],
    "item_int": [[3, 0, 1], [4, 100, 2]],
    "user_dense": [[2, 3]],
    "item_dense": [[7, 2]],
    "seq": {
        "s": {"prefix": "sq", "ts_fid": 9, "features": [[8, 50], [9, 2_000_000_000], [10, 0]]},
        "t": {"prefix": "tq", "ts_fid": 1, "features": [[1, 0]]},
    },
}
SMALL_LENS = {"s": 3, "t": 2}
ARROW_TYPES = {
    "int64": pa.int64(),
    "int32": pa.int32(),
    "list<int64>": pa.list_(pa.int64()),
    "list<float>": pa.list_(pa.float32()),
}


def small_schema(**changes):
    raw = {**SMALL, **changes}
    return load_schema(raw, max_lens=SMALL_LENS)


def make_batch(schema, rows: list[dict], *, order=None) -> pa.RecordBatch:
    """A record batch from per-row dicts; absent list columns are empty lists, absent scalars defaults."""
    defaults = {"timestamp": 1000, "label_type": 1, "user_id": 7}
    arrays, names = [], []
    for name, kind in expected_columns(schema).items():
        default = defaults.get(name, 0 if kind in ("int64", "int32") else [])
        arrays.append(pa.array([r.get(name, default) for r in rows], type=ARROW_TYPES[kind]))
        names.append(name)
    batch = pa.RecordBatch.from_arrays(arrays, names=names)
    if order is not None:
        batch = batch.select([names[i] for i in order])
    return batch


def compare(batch, ref, schema) -> None:
    """Assert a converted Batch equals the reference's dict exactly (values, masks, dtypes)."""
    for side in ("user", "item"):
        block = getattr(batch, side)
        assert block.int_values.dtype == torch.int32 and block.dense_values.dtype == torch.float32
        for key in ("int_values", "int_missing", "dense_values", "dense_missing"):
            np.testing.assert_array_equal(getattr(block, key).numpy(), ref[side][key], err_msg=f"{side}.{key}")
    assert list(batch.sequences) == [d.name for d in schema.domains]
    for domain in schema.domains:
        got, want = batch.sequences[domain.name], ref["seq"][domain.name]
        assert got.values.dtype == torch.int32 and got.timestamps.dtype == torch.int64
        assert got.lengths.dtype == torch.int32
        for key in ("values", "timestamps", "lengths"):
            np.testing.assert_array_equal(getattr(got, key).numpy(), want[key], err_msg=f"{domain.name}.{key}")
    np.testing.assert_array_equal(batch.request_timestamp.numpy(), ref["request_timestamp"])
    np.testing.assert_array_equal(batch.label.numpy(), ref["label"])
    np.testing.assert_array_equal(batch.user_id.numpy(), ref["user_id"])

