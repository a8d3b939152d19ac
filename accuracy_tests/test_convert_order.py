"""The converter's output memory recycling and input variants (large lists, threads, DataLoader workers),
and list order: told per row from the event times, or given."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accuracy_tests.convert_cases import compare, make_batch, small_schema
from accuracy_tests.convert_reference import reference_convert, row_order
from pcvr_lib.data.convert import ORDER_CLASSES, Converter, NativeUnavailable, classify_list_order, native_library
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.data.parquet import DataError, expected_columns

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
