"""Converter (pcvr_lib.data.convert) against the per-row reference and every rule of data.md section 2.
Bad input: test_convert_errors.py; output memory, input variants and list order: test_convert_order.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accuracy_tests.convert_cases import compare, make_batch, small_schema
from accuracy_tests.convert_reference import ReferenceNonMonotonic, ReferenceOOB, reference_convert
from pcvr_lib.data import convert_numpy
from pcvr_lib.data.convert import LIST_ORDERS, NON_MONOTONIC_POLICIES, Converter, OutOfVocabError
from pcvr_lib.data.parquet import DataError, expected_columns
from pcvr_lib.schema import load_schema

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

