"""Converter (pcvr_lib.data.convert) against the per-row reference, every rule of data.md section 2, and
bad input for the converter and pcvr_lib.data.parquet.open_dataset."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accuracy_tests.convert_reference import ReferenceNonMonotonic, ReferenceOOB, reference_convert, row_order
from pcvr_lib.data import convert_numpy
from pcvr_lib.data.convert import (
    LIST_ORDERS,
    NON_MONOTONIC_POLICIES,
    ORDER_CLASSES,
    Converter,
    NativeUnavailable,
    OutOfVocabError,
    classify_list_order,
    native_library,
)
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.data.parquet import DataError, MissingColumnError, expected_columns, open_dataset
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


@pytest.fixture(scope="module", params=["numpy", "native"])
def backend(request):
    """Both converter backends; native is skipped (with the reason) where it cannot be built."""
    if request.param == "native":
        try:
            native_library()
        except NativeUnavailable as exc:
            pytest.skip(f"native converter kernels unavailable: {exc}")
    return request.param


@pytest.fixture(scope="module")
def demo_schema(repo_root):
    return load_schema(repo_root / DEMO_SCHEMA)


@pytest.fixture(scope="module")
def demo_batches(demo_schema, data_cache_dir):
    path = generate_dataset(demo_schema, rows=200, seed=3, row_group_size=100, cache_dir=data_cache_dir, progress=False)
    return list(pq.ParquetFile(path).iter_batches(batch_size=72))


# ----------------------------------------------------------------------------------------------
# against the per-row reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_reference_on_generated_data(backend, demo_schema, demo_batches, strict, training):
    converter = Converter(demo_schema, backend=backend, training=training, strict_time_filter=strict)
    applied = strict and training  # strict filtering is for training batches only
    oob = {}
    offset = 0
    for rb in demo_batches:
        batch = converter(rb, row_offset=offset)
        ref = reference_convert(rb, demo_schema, training=training, strict=applied)
        compare(batch, ref, demo_schema)
        np.testing.assert_array_equal(batch.row_index.numpy(), np.arange(offset, offset + rb.num_rows))
        offset += rb.num_rows
        for k, v in ref["oob"].items():
            oob[k] = oob.get(k, 0) + v
    assert oob, "generated data should contain out-of-vocab values"
    assert converter.stats["oob_per_feature"] == oob
    assert converter.stats["oob_total"] == sum(oob.values())
    assert converter.stats["rows"] == offset and converter.stats["batches"] == len(demo_batches)
    assert converter.stats["strict_time_filter"] is applied and converter.strict_time_filter is applied


def test_strict_filter_on_evaluation_only_when_asked(backend, demo_schema, demo_batches):
    rb = demo_batches[0]
    plain = Converter(demo_schema, backend=backend, training=False)(rb)
    ignored = Converter(demo_schema, backend=backend, training=False, strict_time_filter=True)
    assert ignored.strict_time_filter is False
    asked = Converter(demo_schema, backend=backend, training=False, strict_time_filter=True, strict_on_eval=True)
    ref = reference_convert(rb, demo_schema, training=False, strict=True)
    compare(asked(rb), ref, demo_schema)
    got = ignored(rb)
    for d in demo_schema.domains:
        assert torch.equal(got.sequences[d.name].values, plain.sequences[d.name].values)


def test_numpy_strict_rows_rescanned_in_full(demo_schema, demo_batches, monkeypatch):
    # with no slack every row whose tail window lacks L valid events takes the whole-list path
    monkeypatch.setattr(convert_numpy, "STRICT_SLACK", 0)
    rb = demo_batches[1]
    batch = Converter(demo_schema, backend="numpy", strict_time_filter=True)(rb)
    compare(batch, reference_convert(rb, demo_schema, strict=True), demo_schema)


def test_backend_recorded_and_checked(backend):
    converter = Converter(small_schema(), backend=backend)
    assert converter.backend == backend and converter.stats["backend"] == backend
    with pytest.raises(ValueError, match="backend must be one of"):
        Converter(small_schema(), backend="fast")


def test_generated_data_exercises_truncation_and_strict_filter(backend, demo_schema, demo_batches):
    rb = demo_batches[0]
    loose = Converter(demo_schema, backend=backend)(rb)
    strict = Converter(demo_schema, backend=backend, strict_time_filter=True)(rb)
    for domain in demo_schema.domains:
        lengths = np.diff(rb.column(domain.ts_feature.column).offsets.to_numpy())
        assert (lengths > domain.max_len).any(), domain.name
        # strict drops future / zero-time events, so some rows keep fewer events
        assert (strict.sequences[domain.name].lengths <= loose.sequences[domain.name].lengths).all()
    assert any((strict.sequences[d.name].lengths < loose.sequences[d.name].lengths).any() for d in demo_schema.domains)


def test_clip_off_raises_naming_column_and_value(backend, demo_schema, demo_batches):
    rb = demo_batches[0]
    with pytest.raises(ReferenceOOB):
        reference_convert(rb, demo_schema, clip_oov=False)
    with pytest.raises(OutOfVocabError, match=r"column '.+': value \d+ \(row \d+\) is out of vocabulary"):
        Converter(demo_schema, backend=backend, clip_oov=False)(rb)


def test_clip_off_passes_clean_data(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"user_int_feats_1": 9, "sq_8": [49, 1], "sq_9": [5, 6]}])
    batch = Converter(schema, backend=backend, clip_oov=False)(rb)
    assert batch.user.int_values[0, 0] == 9
    assert batch.sequences["s"].values[0, 0, :2].tolist() == [49, 1]


# hypothesis: random small schemas and batches -----------------------------------------------------

_vocab = st.sampled_from([0, 1, 2, 3, 7, 50])
_ids = st.integers(min_value=-3, max_value=60)


@st.composite
def schema_and_batch(draw):
    n_user = draw(st.integers(1, 3))
    n_item = draw(st.integers(1, 2))
    user_int = [[fid, draw(_vocab), draw(st.integers(1, 3))] for fid in range(1, n_user + 1)]
    item_int = [[fid, draw(_vocab), draw(st.integers(1, 3))] for fid in range(1, n_item + 1)]
    user_dense = [[fid, draw(st.integers(1, 3))] for fid in range(1, draw(st.integers(0, 2)) + 1)]
    item_dense = [[fid, draw(st.integers(1, 2))] for fid in range(1, draw(st.integers(0, 1)) + 1)]
    seq, lens = {}, {}
    for d in range(draw(st.integers(0, 2))):
        n_feat = draw(st.integers(1, 3))
        fids = list(range(20, 20 + n_feat))
        seq[f"d{d}"] = {
            "prefix": f"p{d}",
            "ts_fid": draw(st.sampled_from(fids)),
            "features": [[fid, draw(_vocab)] for fid in fids],
        }
        lens[f"d{d}"] = draw(st.integers(1, 4))
    raw = {
        "format": "raw_parquet",
        "user_int": user_int,
        "item_int": item_int,
        "user_dense": user_dense,
        "item_dense": item_dense,
        "seq": seq,
    }
    schema = load_schema(raw, max_lens=lens)
    n_rows = draw(st.integers(0, 5))
    request = [draw(st.integers(0, 30)) for _ in range(n_rows)]
    arrays = {
        "timestamp": pa.array(request, pa.int64()),
        "label_type": pa.array([draw(st.sampled_from([None, 0, 1, 2])) for _ in range(n_rows)], pa.int32()),
        "user_id": pa.array([draw(st.one_of(st.none(), st.integers(0, 9))) for _ in range(n_rows)], pa.int64()),
    }
    maybe_null_list = lambda elems, n: st.one_of(st.none(), st.lists(elems, max_size=n))  # noqa: E731
    for feat in schema.user_int + schema.item_int:
        if feat.dim == 1:
            cells = [draw(st.one_of(st.none(), _ids)) for _ in range(n_rows)]
            arrays[feat.column] = pa.array(cells, pa.int64())
        else:
            cells = [draw(maybe_null_list(_ids, feat.dim + 2)) for _ in range(n_rows)]
            arrays[feat.column] = pa.array(cells, pa.list_(pa.int64()))
    floats = st.one_of(st.floats(-5, 5, width=32), st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    for feat in schema.user_dense + schema.item_dense:
        cells = [draw(maybe_null_list(floats, feat.dim + 1)) for _ in range(n_rows)]
        arrays[feat.column] = pa.array(cells, pa.list_(pa.float32()))
    for domain in schema.domains:
        base_len = [draw(st.integers(0, domain.max_len + 3)) for _ in range(n_rows)]
        for feat in domain.features:
            cells = []
            for r in range(n_rows):
                if draw(st.integers(0, 9)) == 0:
                    cells.append(None)  # a null list
                    continue
                n = base_len[r] if draw(st.integers(0, 4)) else draw(st.integers(0, domain.max_len + 3))
                elems = st.integers(-2, 40) if feat.fid == domain.ts_fid else _ids
                cell = [draw(elems) for _ in range(n)]
                if feat.fid == domain.ts_fid:  # event times: any order, oldest first, newest first, all tied
                    shape = draw(st.sampled_from(["any", "up", "down", "tie"]))
                    cell = {"any": cell, "up": sorted(cell), "down": sorted(cell, reverse=True)}.get(shape, [7] * n)
                cells.append(cell)
            arrays[feat.column] = pa.array(cells, pa.list_(pa.int64()))
    names = list(arrays)
    perm = draw(st.permutations(names))
    batch = pa.RecordBatch.from_arrays([arrays[n] for n in perm], names=perm)
    return schema, batch


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    case=schema_and_batch(),
    strict=st.booleans(),
    training=st.booleans(),
    order=st.sampled_from(LIST_ORDERS),
    policy=st.sampled_from(NON_MONOTONIC_POLICIES),
)
def test_matches_reference_on_hypothesis_schemas(backend, case, strict, training, order, policy):
    schema, rb = case
    options = dict(training=training, strict_time_filter=strict, list_order=order, non_monotonic=policy)
    converter = Converter(schema, backend=backend, **options)
    applied = strict and training  # strict filtering is for training batches only
    try:
        ref = reference_convert(rb, schema, training=training, strict=applied, list_order=order, non_monotonic=policy)
    except ReferenceNonMonotonic as exc:
        with pytest.raises(DataError, match=f"column '{exc.args[0]}': row .* neither non-decreasing"):
            converter(rb)
        return
    batch = converter(rb)
    compare(batch, ref, schema)
    assert converter.stats["oob_per_feature"] == ref["oob"]
    assert converter.stats["null_user_id"] == sum(u is None for u in rb.column("user_id").to_pylist())
    # missing <=> value 0 for int features
    for side in ("user", "item"):
        block = getattr(batch, side)
        assert torch.equal(block.int_missing, block.int_values == 0)
    # a table of several chunks and slices give the same result
    if rb.num_rows >= 2:
        table = pa.Table.from_batches([rb.slice(0, 1), rb.slice(1)])
        compare(Converter(schema, backend=backend, **options)(table), ref, schema)


# ----------------------------------------------------------------------------------------------
# each rule of data.md section 2, small and exact
# ----------------------------------------------------------------------------------------------


def test_strict_example_from_the_spec(backend):
    # events ts [10, 150, 90] at request 100 -> events 1 and 3 kept: length 2, values [1, 3, 0]
    schema = small_schema()
    rb = make_batch(schema, [{"timestamp": 100, "sq_9": [10, 150, 90], "sq_8": [1, 2, 3], "sq_10": [4, 5, 6]}])
    seq = Converter(schema, backend=backend, strict_time_filter=True)(rb).sequences["s"]
    assert seq.lengths.tolist() == [2]
    assert seq.values[0, 0].tolist() == [1, 3, 0]
    assert seq.values[0, 1].tolist() == [0, 0, 0]  # vocab 0 zeroes the feature
    assert seq.timestamps[0].tolist() == [10, 90, 0]


def test_strict_keeps_last_L_valid_events_and_drops_zero_times(backend):
    schema = small_schema()
    ts = [5, 0, 6, 7, 8, 200, 9, -4]  # request 100: valid 5,6,7,8,9 -> last three 7, 8, 9
    rb = make_batch(schema, [{"timestamp": 100, "sq_9": ts, "sq_8": list(range(1, 9))}])
    seq = Converter(schema, backend=backend, strict_time_filter=True)(rb).sequences["s"]
    assert seq.lengths.tolist() == [3]
    assert seq.timestamps[0].tolist() == [7, 8, 9]
    assert seq.values[0, 0].tolist() == [4, 5, 7]


def test_nonstrict_keeps_newest_L_elements_left_aligned(backend):
    schema = small_schema()
    rows = [
        {"sq_9": [1, 2, 3, 4, 5], "sq_8": [11, 12, 13, 14, 15]},  # longer than L=3: the last three
        {"sq_9": [7], "sq_8": [21]},  # shorter: left-aligned, zero padded
        {},  # empty
    ]
    seq = Converter(schema, backend=backend)(make_batch(schema, rows)).sequences["s"]
    assert seq.lengths.tolist() == [3, 1, 0]
    assert seq.values[:, 0].tolist() == [[13, 14, 15], [21, 0, 0], [0, 0, 0]]
    assert seq.timestamps.tolist() == [[3, 4, 5], [7, 0, 0], [0, 0, 0]]


def test_nonstrict_copies_timestamps_raw_and_length_is_max_over_side_columns(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"timestamp": 5, "sq_9": [-3, 0, 99], "sq_8": [1], "sq_10": [1, 1]}])
    seq = Converter(schema, backend=backend)(rb).sequences["s"]
    assert seq.timestamps[0].tolist() == [-3, 0, 99]  # never zeroed or clipped
    assert seq.lengths.tolist() == [2]
    # a domain with only its timestamp feature takes the timestamp column's length
    rb = make_batch(schema, [{"tq_1": [4, 5, 6]}])
    t = Converter(schema, backend=backend)(rb).sequences["t"]
    assert t.values.shape == (1, 0, 2) and t.lengths.tolist() == [2] and t.timestamps[0].tolist() == [5, 6]


def test_sequence_tokens_nonpositive_and_oob_are_zeroed_and_counted(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"sq_9": [1, 2, 3], "sq_8": [-1, 50, 49]}])
    converter = Converter(schema, backend=backend)
    seq = converter(rb).sequences["s"]
    assert seq.values[0, 0].tolist() == [0, 0, 49]
    assert seq.lengths.tolist() == [3]
    assert converter.stats["oob_per_group"]["s"] == 1 and converter.stats["oob_per_feature"] == {"sq_8": 1}
    with pytest.raises(OutOfVocabError, match=r"'sq_8': value 50 \(row 0\)"):
        Converter(schema, backend=backend, clip_oov=False)(rb)


def test_width1_missing_mask_nulls_nonpositive_oob(backend):
    schema = small_schema()
    cells = [None, 0, -5, 3, 10, 9]  # vocab 10: 10 is out of vocab, 9 is the largest valid id
    rb = make_batch(schema, [{"user_int_feats_1": c} for c in cells])
    converter = Converter(schema, backend=backend)
    user = converter(rb).user
    assert user.int_values[:, 0].tolist() == [0, 0, 0, 3, 0, 9]
    assert user.int_missing[:, 0].tolist() == [True, True, True, False, True, False]
    assert converter.stats["oob_per_feature"] == {"user_int_feats_1": 1}
    assert converter.stats["oob_per_group"] == {"user_int": 1, "item_int": 0, "s": 0, "t": 0}


def test_list_int_pads_truncates_to_first_dim_elements(backend):
    schema = small_schema()
    rows = [
        {"user_int_feats_2": [1, 2, 3, 4, 5]},  # first dim=3 kept (not time-ordered)
        {"user_int_feats_2": [4, 0]},  # padding is missing
        {"user_int_feats_2": None},  # null list = empty
        {"user_int_feats_2": [5, -1, 2]},  # vocab 5: 5 is OOB
    ]
    converter = Converter(schema, backend=backend)
    user = converter(make_batch(schema, rows)).user
    assert user.int_values[:, 1:4].tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0], [0, 0, 2]]
    assert user.int_missing[:, 1:4].tolist() == [
        [False, False, False],
        [False, True, True],
        [True, True, True],
        [True, True, False],
    ]
    assert converter.stats["oob_per_feature"] == {"user_int_feats_2": 1}


def test_vocab_zero_zeroes_the_column(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"item_int_feats_3": 5}, {"item_int_feats_3": 123456}])
    converter = Converter(schema, backend=backend, clip_oov=False)  # vocab 0 is not out-of-vocab: no error
    item = converter(rb).item
    assert item.int_values[:, 0].tolist() == [0, 0] and item.int_missing[:, 0].all()
    assert converter.stats["oob_total"] == 0


def test_dense_pad_truncate_nonfinite(backend):
    schema = small_schema()
    nan, inf = float("nan"), float("inf")
    rows = [
        {"user_dense_feats_2": [1.5, nan, -inf, 7.0]},
        {"user_dense_feats_2": [2.5]},
        {"user_dense_feats_2": None},
    ]
    user = Converter(schema, backend=backend)(make_batch(schema, rows)).user
    assert user.dense_values.tolist() == [[1.5, 0.0, 0.0], [2.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert user.dense_missing.tolist() == [[False, True, True], [False, True, True], [True, True, True]]


def test_empty_item_dense_gives_zero_width(backend):
    schema = small_schema(item_dense=[])
    item = Converter(schema, backend=backend)(make_batch(schema, [{}, {}])).item
    assert item.dense_values.shape == (2, 0) and item.dense_missing.shape == (2, 0)
    assert item.dense_values.dtype == torch.float32


def test_labels_and_eval_mode(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"label_type": t} for t in [2, 1, 0, None, 2, 3]])
    assert Converter(schema, backend=backend)(rb).label.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert Converter(schema, backend=backend, training=False)(rb).label.tolist() == [0.0] * 6


def test_null_user_id_becomes_minus_one_and_is_counted(backend):
    schema = small_schema()
    rb = make_batch(schema, [{"user_id": None}, {"user_id": 42}])
    converter = Converter(schema, backend=backend)
    assert converter(rb).user_id.tolist() == [-1, 42]
    assert converter.stats["null_user_id"] == 1


def test_column_order_does_not_matter(backend):
    schema = small_schema()
    rows = [{"user_int_feats_1": 3, "sq_9": [1, 2, 3, 4], "sq_8": [5, 6, 7, 8], "timestamp": 3}, {"label_type": 2}]
    plain = Converter(schema, backend=backend, strict_time_filter=True)(make_batch(schema, rows))
    n = len(expected_columns(schema))
    shuffled = Converter(schema, backend=backend, strict_time_filter=True)(
        make_batch(schema, rows, order=list(range(n))[::-1])
    )
    assert all(torch.equal(a, b) for a, b in zip(plain.tensors(), shuffled.tensors(), strict=True))


def test_sliced_batches_and_row_offset(backend, demo_schema, demo_batches):
    rb = demo_batches[0]
    converter = Converter(demo_schema, backend=backend)
    full = converter(rb, row_offset=1000)
    part = converter(rb.slice(10, 25), row_offset=1010)
    rows = torch.arange(10, 35)
    assert all(torch.equal(a, b) for a, b in zip(full.select(rows).tensors(), part.tensors(), strict=True))


def test_null_list_over_values_is_empty(backend):
    # an in-memory list array whose null row spans values: the null row must read as empty
    schema = small_schema()
    rb = make_batch(schema, [{}, {}])
    offsets = pa.array([0, 2, 3], pa.int32())
    lists = pa.ListArray.from_arrays(offsets, pa.array([1, 2, 3], pa.int64()), mask=pa.array([True, False]))
    rb = rb.set_column(rb.schema.get_field_index("sq_8"), "sq_8", lists)
    rb = rb.set_column(rb.schema.get_field_index("sq_9"), "sq_9", lists)
    seq = Converter(schema, backend=backend)(rb).sequences["s"]
    assert seq.lengths.tolist() == [0, 1]
    assert seq.values[:, 0].tolist() == [[0, 0, 0], [3, 0, 0]]


def test_zero_row_batch_gives_empty_batch(backend):
    schema = small_schema()
    batch = Converter(schema, backend=backend, strict_time_filter=True)(make_batch(schema, []))
    assert batch.batch_size == 0
    assert batch.user.int_values.shape == (0, schema.int_width("user"))
    assert batch.sequences["s"].values.shape == (0, 2, 3)


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


# ----------------------------------------------------------------------------------------------
# output memory recycling and input variants
# ----------------------------------------------------------------------------------------------


def test_kept_batches_are_never_overwritten(backend, demo_schema, demo_batches):
    # output arenas are recycled only once nothing refers to a batch: kept batches and kept single
    # tensors (views) must survive later conversions untouched
    converter = Converter(demo_schema, backend=backend)
    kept = converter(demo_batches[0])
    expected = kept.clone()
    one_tensor = converter(demo_batches[1]).sequences["seq_d"].values
    one_expected = one_tensor.clone()
    for _ in range(3):
        for rb in demo_batches:
            converter(rb)  # dropped at once: their arenas are reused
    assert all(torch.equal(a, b) for a, b in zip(kept.tensors(), expected.tensors(), strict=True))
    assert torch.equal(one_tensor, one_expected)
    assert len(converter._pool.arenas) <= converter._pool.size


def test_recycled_output_matches_fresh(backend, demo_schema, demo_batches):
    converter = Converter(demo_schema, backend=backend, strict_time_filter=True)
    for _ in range(2):
        for rb in demo_batches:
            compare(converter(rb), reference_convert(rb, demo_schema, strict=True), demo_schema)


def test_large_list_columns(backend):
    schema = small_schema()
    rows = [{"sq_9": [5, 6, 7, 8], "sq_8": [1, 2, 3, 4], "user_int_feats_2": [1, 2], "user_dense_feats_2": [0.5]}, {}]
    rb = make_batch(schema, rows)
    large = rb
    for name, kind in expected_columns(schema).items():
        if kind.startswith("list"):
            i = large.schema.get_field_index(name)
            col = large.column(i)
            large = large.set_column(i, name, col.cast(pa.large_list(col.type.value_type)))
    a, b = Converter(schema, backend=backend)(rb), Converter(schema, backend=backend)(large)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


def test_one_converter_shared_by_threads(backend, demo_schema, demo_batches):
    # the native kernels release the GIL; output arenas and pointer tables must not be shared by mistake
    from concurrent.futures import ThreadPoolExecutor

    converter = Converter(demo_schema, backend=backend)
    expected = [Converter(demo_schema, backend=backend)(rb).clone() for rb in demo_batches]
    work = list(range(len(demo_batches))) * 4
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda i: (i, converter(demo_batches[i])), work))
    for i, batch in results:
        assert all(torch.equal(a, b) for a, b in zip(batch.tensors(), expected[i].tensors(), strict=True))


class _ConvertingDataset(torch.utils.data.IterableDataset):
    """Converts the batches of a parquet file inside a DataLoader worker (each worker its own half)."""

    def __init__(self, path, schema, backend):
        self.path, self.schema, self.backend = path, schema, backend

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        converter = Converter(self.schema, backend=self.backend)
        for i, rb in enumerate(pq.ParquetFile(self.path).iter_batches(batch_size=50)):
            if info is None or i % info.num_workers == info.id:
                yield converter(rb, row_offset=50 * i)


def test_batches_cross_dataloader_workers_intact(backend, demo_schema, data_cache_dir):
    # workers hand batches to the main process through shared memory while their converter recycles
    # output arenas: every received batch must equal the one converted in the main process
    path = generate_dataset(demo_schema, rows=200, seed=3, row_group_size=100, cache_dir=data_cache_dir, progress=False)
    expected = {}
    for i, rb in enumerate(pq.ParquetFile(path).iter_batches(batch_size=50)):
        expected[50 * i] = Converter(demo_schema, backend=backend)(rb, row_offset=50 * i)
    loader = torch.utils.data.DataLoader(_ConvertingDataset(path, demo_schema, backend), batch_size=None, num_workers=2)
    got = list(loader)
    assert sorted(int(b.row_index[0]) for b in got) == sorted(expected)
    for batch in got:
        want = expected[int(batch.row_index[0])]
        assert all(torch.equal(a, b) for a, b in zip(batch.tensors(), want.tensors(), strict=True))


# ----------------------------------------------------------------------------------------------
# list order: told per row from the event times, or given
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ordered_batches(demo_schema, data_cache_dir):
    """The same generated events written newest last, newest first and mixed (a seeded half reversed)."""
    out = {}
    for order in ("newest-last", "newest-first", "mixed"):
        path = generate_dataset(
            demo_schema, rows=200, seed=3, row_group_size=100, cache_dir=data_cache_dir, progress=False,
            list_order=order,
        )  # fmt: skip
        out[order] = list(pq.ParquetFile(path).iter_batches(batch_size=72))
    return out


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_newest_first_and_mixed_files_give_the_newest_last_batches(backend, demo_schema, ordered_batches, strict):
    """Reversing the lists changes nothing: every order keeps the newest L events, oldest first (the demo
    schema's L is a multiple of 8, so the AVX-512 reversed copy runs where the CPU has it)."""
    for order in ("newest-first", "mixed"):
        converter = Converter(demo_schema, backend=backend, strict_time_filter=strict)
        for want_rb, rb in zip(ordered_batches["newest-last"], ordered_batches[order], strict=True):
            want = Converter(demo_schema, backend=backend, strict_time_filter=strict)(want_rb)
            got = converter(rb)
            ref = reference_convert(rb, demo_schema, strict=strict)
            compare(got, ref, demo_schema)
            for d in demo_schema.domains:
                # rows too short to tell take the batch's majority order; compare the rows that tell
                ts = rb.column(d.ts_feature.column)
                tells = classify_list_order(ts) != 0
                for key in ("values", "timestamps", "lengths"):
                    a = getattr(got.sequences[d.name], key).numpy()[tells]
                    b = getattr(want.sequences[d.name], key).numpy()[tells]
                    np.testing.assert_array_equal(a, b, err_msg=f"{order} {d.name}.{key}")
        counts = converter.stats["list_order_rows"]
        for d in demo_schema.domains:
            c = counts[d.name]
            assert sum(c[k] for k in ORDER_CLASSES) == 200 and c["non_monotonic"] == 0 and c["given"] == 0
            if order == "newest-first":
                assert c["newest_last"] == 0 and c["newest_first"] > 150
            else:
                assert c["newest_last"] > 50 and c["newest_first"] > 50


def test_generated_order_detected_per_row(demo_schema, ordered_batches):
    for order, want in (("newest-last", 1), ("newest-first", 2)):
        for rb in ordered_batches[order]:
            for d in demo_schema.domains:
                cls = classify_list_order(rb.column(d.ts_feature.column))
                assert set(cls.tolist()) <= {0, want}
                assert [ORDER_CLASSES[c] for c in cls] == [
                    row_order(x or []) for x in rb.column(d.ts_feature.column).to_pylist()
                ]


def test_order_rules_ties_and_majority(backend):
    schema = small_schema()  # domain s: L = 3, side fid 8 (vocab 50)
    rows = [
        {"sq_9": [1, 2, 2, 3, 4], "sq_8": [11, 12, 13, 14, 15]},  # ties inside, newest last: 13 14 15
        {"sq_9": [9, 8, 8, 0, 7], "sq_8": [21, 22, 23, 24, 25]},  # newest first, a tie and a 0 time
        {"sq_9": [5, 5, 5, 5], "sq_8": [31, 32, 33, 34]},  # all tied: too short to tell -> majority
        {"sq_9": [0, 6], "sq_8": [41, 42]},  # one positive time: too short to tell -> majority
        {"sq_9": [3, 1, 2, 9], "sq_8": [1, 2, 3, 4]},  # not monotonic: sorted 1 2 3 9 -> events 1 2 3 kept
        {"sq_9": [5, 4, 3], "sq_8": [7, 8, 9]},  # newest first
    ]
    converter = Converter(schema, backend=backend)
    seq = converter(make_batch(schema, rows)).sequences["s"]
    # newest first wins the majority 2:1, so the too-short rows are read newest first (reversed)
    assert seq.values[:, 0].tolist() == [
        [13, 14, 15],
        [23, 22, 21],  # kept 21 22 23 (times 9 8 8), oldest first
        [33, 32, 31],
        [42, 41, 0],
        [3, 1, 4],  # times 2, 3, 9 -> events 2, 0, 3
        [9, 8, 7],
    ]
    assert seq.timestamps.tolist() == [[2, 3, 4], [8, 8, 9], [5, 5, 5], [6, 0, 0], [2, 3, 9], [3, 4, 5]]
    assert converter.stats["list_order_rows"]["s"] == {
        "too_short": 2, "newest_last": 1, "newest_first": 2, "non_monotonic": 1, "given": 0,
    }  # fmt: skip
    # without a majority for newest first, too-short rows keep the stored order (newest last)
    seq = Converter(schema, backend=backend)(make_batch(schema, rows[2:4])).sequences["s"]
    assert seq.values[:, 0].tolist() == [[32, 33, 34], [41, 42, 0]]


def test_given_order_is_not_checked(backend):
    schema = small_schema()
    rows = [{"sq_9": [3, 1, 2, 9], "sq_8": [1, 2, 3, 4]}, {"sq_9": [1, 2], "sq_8": [5, 6]}]
    first = Converter(schema, backend=backend, list_order="newest-first")
    seq = first(make_batch(schema, rows)).sequences["s"]
    assert seq.values[:, 0].tolist() == [[3, 2, 1], [6, 5, 0]]  # the first L, reversed, whatever the times
    assert first.stats["list_order_rows"]["s"]["given"] == 2
    seq = Converter(schema, backend=backend, list_order="newest-last")(make_batch(schema, rows)).sequences["s"]
    assert seq.values[:, 0].tolist() == [[2, 3, 4], [5, 6, 0]]


def test_non_monotonic_rows_rejected_by_the_error_policy(backend):
    schema = small_schema()
    rows = [{"sq_9": [1, 2, 3]}, {"sq_9": [3, 1, 2]}]
    converter = Converter(schema, backend=backend, non_monotonic="error")
    with pytest.raises(DataError, match=r"column 'sq_9': row 11: .*neither non-decreasing nor non-increasing"):
        converter(make_batch(schema, rows), row_offset=10)
    with pytest.raises(ValueError, match="list_order must be one of auto, newest-first, newest-last"):
        Converter(schema, list_order="oldest-first")
    with pytest.raises(ValueError, match="non_monotonic must be one of sort, error"):
        Converter(schema, non_monotonic="drop")


@settings(max_examples=300, deadline=None)
@given(
    cells=st.lists(
        st.one_of(
            st.none(),
            st.lists(st.integers(-2, 30), max_size=40),
            st.lists(st.integers(-1, 1000), max_size=40).map(sorted),
            st.lists(st.integers(-1, 1000), max_size=40).map(lambda x: sorted(x, reverse=True)),
        ),
        max_size=12,
    ),
    cut=st.integers(0, 3),
)
def test_order_classes_match_the_reference_on_long_rows(cells, cut):
    """Rows long enough for the 8-wide compare, with times <= 0 anywhere (bridged), nulls and slices."""
    array = pa.array(cells, pa.list_(pa.int64()))[cut:]
    got = [ORDER_CLASSES[c] for c in classify_list_order(array)]
    assert got == [row_order(x or []) for x in array.to_pylist()]


def _tied_and_shuffled(rb: pa.RecordBatch, schema, seed: int) -> pa.RecordBatch:
    """The batch with every 5th row's event times all tied (too short to tell) and every 5th other row's
    shuffled (not monotonic), in every domain."""
    rng = np.random.default_rng(seed)
    for d in schema.domains:
        col = d.ts_feature.column
        lists = rb.column(col).to_pylist()
        for r, x in enumerate(lists):
            if x and r % 5 == 1:
                lists[r] = [x[0]] * len(x)
            elif x and r % 5 == 3:
                lists[r] = rng.permutation(x).tolist()
        rb = rb.set_column(rb.schema.get_field_index(col), col, pa.array(lists, rb.schema.field(col).type))
    return rb


@pytest.mark.parametrize(
    ("list_order", "strict"), [("auto", False), ("auto", True), ("newest-first", False), ("newest-last", True)]
)
def test_native_batch_call_matches_the_numpy_backend(demo_schema, ordered_batches, list_order, strict):
    """The one-call-per-batch native path (C data interface, order check fused into the row loop, too-short
    rows deferred to the majority, not-monotonic rows sorted in C) against the numpy backend, bit for bit:
    newest-first, mixed and newest-last files, tied and shuffled rows, slices and multi-chunk tables."""
    try:
        native_library()
    except NativeUnavailable as exc:
        pytest.skip(f"native converter kernels unavailable: {exc}")
    kw = dict(strict_time_filter=strict, list_order=list_order)
    native, numpy_ = Converter(demo_schema, backend="native", **kw), Converter(demo_schema, backend="numpy", **kw)
    for order in ("newest-first", "mixed", "newest-last"):
        for i, rb in enumerate(b.slice(0, 40) for b in ordered_batches[order][:2]):  # (the numpy side is slow)
            tied = _tied_and_shuffled(rb, demo_schema, seed=i)
            chunked = pa.Table.from_batches([tied.slice(0, 17), tied.slice(17)])
            for data in (rb, tied, tied.slice(7, 25), chunked):
                got, want = native(data, row_offset=100 * i), numpy_(data, row_offset=100 * i)
                for a, b in zip(got.tensors(), want.tensors(), strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), order
    assert native.backend == "native" and numpy_.backend == "numpy"
    drop = {"backend"}
    assert {k: v for k, v in native.stats.items() if k not in drop} == {
        k: v for k, v in numpy_.stats.items() if k not in drop
    }
    if list_order == "auto":
        counts = native.stats["list_order_rows"][demo_schema.domains[-1].name]
        assert counts["non_monotonic"] > 0 and counts["too_short"] > 0
