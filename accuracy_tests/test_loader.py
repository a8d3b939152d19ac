"""The loader: every preset yields batches, sweeps cover each row once per pass, steps are seeded,
split sides are respected, the cache never changes what comes out, workers agree, bad options fail clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pcvr_lib.data.cache import belady_hit_count
from pcvr_lib.data.convert import Converter
from pcvr_lib.data.generate import generate_table
from pcvr_lib.data.loader import PRESETS, CorruptRowGroupError, LoaderError, PcvrLoader
from pcvr_lib.data.parquet import DataError
from pcvr_lib.schema import load_schema

ROWS, GROUP, BATCH = 400, 100, 64  # 4 row groups of 2 batches (64 + 36 rows)


@pytest.fixture(scope="module")
def schema(repo_root):
    # short windows keep the tests fast; the benchmark uses the default max_len
    return load_schema(repo_root / "fixtures" / "sample_1000_raw.schema.json", "seq_a:8,seq_b:8,seq_c:16,seq_d:16")


@pytest.fixture(scope="module")
def dataset(schema, tmp_path_factory):
    """Generated demo data with every event list cut to its first 24 events, so the tests stay fast
    (the benchmark runs the full-length data)."""
    table = generate_table(schema, ROWS, seed=0)
    for domain in schema.domains:
        for feat in domain.features:
            i = table.schema.get_field_index(feat.column)
            table = table.set_column(i, feat.column, pc.list_slice(table.column(i), 0, 24))
    path = tmp_path_factory.mktemp("loader") / "demo_short.parquet"
    pq.write_table(table, path, row_group_size=GROUP)
    return path


def row_indices(batches) -> list[np.ndarray]:
    return [b.row_index.numpy() for b in batches]


def assert_batches_equal(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_yields_batches(preset, schema, dataset):
    loader = PcvrLoader(dataset, schema, preset=preset, batch_size=BATCH, passes=2, shuffle=True, cache_capacity=3)
    batches = list(loader)
    views = 2 if "augment" in preset else 1
    assert len(batches) == 2 * 8 == loader.planned_batches
    assert sum(b.batch_size for b in batches) == 2 * ROWS * views
    stats = loader.stats()
    assert stats["rows"] == 2 * ROWS * views and stats["batches"] == 16
    assert stats["cache_impl"] == PRESETS[preset].cache_policy
    assert stats["strict_time_filter"] == PRESETS[preset].strict_time_filter
    if preset != "none":
        assert stats["cache"]["hits"] > 0 and stats["cache"]["hits"] + stats["cache"]["misses"] == 16
    for b in batches:  # batches never cross row groups
        groups = np.unique(b.row_index.numpy() // GROUP)
        assert groups.size == 1


def test_sweep_covers_each_row_once_per_pass(schema, dataset):
    loader = PcvrLoader(dataset, schema, batch_size=BATCH, passes=3, shuffle=True, seed=4)
    batches = list(loader)
    per_pass = len(batches) // 3
    orders = []
    for p in range(3):
        rows = np.concatenate(row_indices(batches[p * per_pass : (p + 1) * per_pass]))
        assert np.array_equal(np.sort(rows), np.arange(ROWS))
        orders.append(rows)
    assert not all(np.array_equal(orders[0], o) for o in orders[1:])  # shuffled row-group order per pass


def test_batches_match_a_direct_conversion(schema, dataset):
    table = pq.read_table(dataset, columns=schema.converter_columns)
    loader = PcvrLoader(dataset, schema, batch_size=BATCH)
    converter = Converter(schema)
    for batch in loader:
        start = int(batch.row_index[0])
        expected = converter(table.slice(start, batch.batch_size), row_offset=start)
        assert_batches_equal(batch, expected)


def test_cache_presets_give_the_same_batches_as_no_cache(schema, dataset):
    plain = list(PcvrLoader(dataset, schema, preset="none", batch_size=BATCH, mode="steps", steps=30, seed=1))
    for preset in ("cache", "opt"):
        cached = PcvrLoader(
            dataset, schema, preset=preset, batch_size=BATCH, mode="steps", steps=30, seed=1, cache_capacity=3
        )
        got = list(cached)
        assert cached.stats()["cache"]["hits"] > 0
        for a, b in zip(plain, got, strict=True):
            assert_batches_equal(a, b)


def test_evictions_behind_the_read_ahead(schema, dataset):
    # a deep read-ahead looks at the cache long before the consumer uses a key, so keys it saw cached are
    # often evicted by then; the consumer counts the miss and reuses the batch the reader passed along
    # (earlier versions decoded it again in the consuming thread, once with the reader's ParquetFile
    # handle from two threads at once, which failed)
    kwargs = dict(batch_size=BATCH, mode="steps", steps=60, seed=9)
    plain = list(PcvrLoader(dataset, schema, **kwargs))
    lru = PcvrLoader(dataset, schema, preset="cache", cache_capacity=2, read_ahead=0, **kwargs)
    list(lru)
    expected_cache = lru.stats()["cache"]
    for _ in range(3):
        loader = PcvrLoader(dataset, schema, preset="cache", cache_capacity=2, read_ahead=8, **kwargs)
        for a, b in zip(plain, loader, strict=True):
            assert_batches_equal(a, b)
        stats = loader.stats()
        assert stats["batches"] == 60 and stats["late_reads"] == 0
        assert stats["cache"] == expected_cache  # read-ahead never changes what the cache does


def test_opt_loader_reaches_belady_and_beats_lru(schema, dataset):
    kwargs = dict(batch_size=BATCH, mode="steps", steps=120, seed=3, cache_capacity=3)
    opt = PcvrLoader(dataset, schema, preset="opt", **kwargs)
    lru = PcvrLoader(dataset, schema, preset="cache", **kwargs)
    for loader in (opt, lru):
        for _ in loader:
            pass
    trace = [key for _, _, key in opt.plan_items()]
    assert opt.stats()["cache"]["hits"] == belady_hit_count(trace, 3)
    assert opt.stats()["cache"]["hit_rate"] > lru.stats()["cache"]["hit_rate"]


def test_steps_are_seeded_and_weighted(schema, dataset):
    def draw(seed):
        return [
            int(b.row_index[0])
            for b in PcvrLoader(dataset, schema, batch_size=BATCH, mode="steps", steps=40, seed=seed)
        ]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    # weighted by rows: 64-row batches are drawn about 64/36 times as often as 36-row ones
    loader = PcvrLoader(dataset, schema, batch_size=BATCH, mode="steps", steps=4000, seed=0)
    full = sum(1 for _, _, key in loader.plan_items() if key[2] == 0)
    assert 0.6 < full / 4000 < 0.68  # expected 64 / 100


def test_split_sides_are_respected(schema, dataset):
    train = PcvrLoader(dataset, schema, batch_size=BATCH, split="timestamp_auto", side="train")
    valid = PcvrLoader(dataset, schema, batch_size=BATCH, split="timestamp_auto", side="valid")
    train_rows = np.concatenate(row_indices(train))
    valid_rows = np.concatenate(row_indices(valid))
    assert np.array_equal(np.sort(train_rows), train.split.rows("train"))
    assert np.array_equal(np.sort(valid_rows), valid.split.rows("valid"))
    assert train.planned_rows == train_rows.size
    # augmentations apply to training only: the valid side of an augment preset is not cropped/masked
    aug_valid = PcvrLoader(dataset, schema, preset="augment", batch_size=BATCH, split="timestamp_auto", side="valid")
    assert sum(b.batch_size for b in aug_valid) == valid_rows.size
    # a user-hash split keeps each user on one side
    users = PcvrLoader(dataset, schema, batch_size=BATCH, split="user_hash", side="valid", valid_ratio=0.3)
    valid_users = set(torch.cat([b.user_id for b in users]).tolist())
    other = PcvrLoader(dataset, schema, batch_size=BATCH, split="user_hash", side="train", valid_ratio=0.3)
    assert not valid_users & set(torch.cat([b.user_id for b in other]).tolist())


def test_augment_preset_is_reproducible(schema, dataset):
    a = list(PcvrLoader(dataset, schema, preset="opt-augment", batch_size=BATCH, seed=5, cache_capacity=2))
    b = list(PcvrLoader(dataset, schema, preset="opt-augment", batch_size=BATCH, seed=5, cache_capacity=2))
    for x, y in zip(a, b, strict=True):
        assert_batches_equal(x, y)
    c = list(PcvrLoader(dataset, schema, preset="opt-augment", batch_size=BATCH, seed=6, cache_capacity=2))
    assert any(
        not torch.equal(x.sequences["seq_d"].lengths, y.sequences["seq_d"].lengths) for x, y in zip(a, c, strict=True)
    )


def test_workers_give_the_same_batches_in_order(schema, dataset):
    kwargs = dict(preset="augment", batch_size=BATCH, passes=2, shuffle=True, seed=2, cache_capacity=4)
    local = list(PcvrLoader(dataset, schema, **kwargs))
    loader = PcvrLoader(dataset, schema, num_workers=2, **kwargs)
    workers = list(loader)
    assert len(local) == len(workers)
    for a, b in zip(local, workers, strict=True):
        assert_batches_equal(a, b)
    stats = loader.stats()
    assert stats["batches"] == len(local) and stats["cache"]["hits"] + stats["cache"]["misses"] == len(local)
    # a second iteration reuses the persistent workers and starts from a fresh cache and counters
    again = list(loader)
    for a, b in zip(local, again, strict=True):
        assert_batches_equal(a, b)
    again_stats = loader.stats()
    assert again_stats["cache"] == stats["cache"]  # (late reads depend on thread timing, not compared)
    assert (again_stats["rows"], again_stats["batches"]) == (stats["rows"], stats["batches"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preset="fast"), "unknown preset 'fast'; allowed: none, cache, opt, augment, opt-augment"),
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(mode="epoch"), "mode must be one of sweep, steps"),
        (dict(mode="steps"), "needs steps"),
        (dict(cache_policy="mru"), "cache_policy must be one of none, lru, fifo, lfu, rr, opt"),
        (dict(side="valid"), "needs a split"),
        (dict(split="by_day"), "split must be None, a SplitPlan or one of timestamp_auto"),
        (dict(num_workers=-1), "num_workers must be an integer >= 0"),
        (dict(cache_capacity=0), "cache_capacity must be an integer >= 1"),
        (dict(augmentations=[{"type": "crop", "mode": "middle"}]), "mode must be one of random_tail"),
        (dict(list_order="oldest"), "list_order must be one of auto, newest-first, newest-last"),
        (dict(non_monotonic="drop"), "non_monotonic must be one of sort, error"),
    ],
)
def test_bad_options_name_the_option(kwargs, match, schema, dataset):
    with pytest.raises(ValueError, match=match):
        PcvrLoader(dataset, schema, **kwargs)


def test_missing_file_and_bad_parquet(schema, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        PcvrLoader(tmp_path / "nope.parquet", schema)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        PcvrLoader(empty, schema)


def test_strict_filter_for_training_batches_only(schema, dataset):
    """The augment presets ask for the strict filter: it applies to training batches, not to the valid side
    nor to training=False, unless strict_on_eval asks for it by name."""
    split = dict(split="timestamp_auto", valid_ratio=0.25)
    cases = [
        (dict(side="train", **split), True),
        (dict(side="valid", **split), False),
        (dict(training=False), False),
        (dict(side="valid", strict_on_eval=True, **split), True),
        (dict(training=False, strict_on_eval=True), True),
    ]
    for kwargs, strict in cases:
        loader = PcvrLoader(dataset, schema, preset="augment", batch_size=BATCH, **kwargs)
        assert loader.strict_time_filter is strict, kwargs
        assert loader.strict_time_filter_requested is True
        first = next(iter(loader))
        want = Converter(schema, training=loader.training, strict_time_filter=strict, strict_on_eval=True)
        key = loader.plan_items()[0][2]
        start, stop = loader.spans[key]  # the file rows the batch is cut from
        group_start = int(loader.row_group_offsets[key[1]])
        table = pq.ParquetFile(dataset).read_row_group(key[1]).slice(start - group_start, stop - start)
        direct = loader.filter_rows(want(table, row_offset=start), key)
        if not loader.augment_active:  # compare exactly where no augmentation reshapes the batch
            assert_batches_equal(first, direct)


def _reversed_copy(path, out, flip_groups):
    """The file with every sequence list of the given row groups reversed (newest first)."""
    import pyarrow as pa

    from pcvr_lib.data.generate import _reverse_rows

    pf = pq.ParquetFile(path)
    with pq.ParquetWriter(out, pf.schema_arrow) as writer:
        for g in range(pf.metadata.num_row_groups):
            table = pf.read_row_group(g)
            if g in flip_groups:
                flip = np.ones(table.num_rows, dtype=bool)
                for i, name in enumerate(table.column_names):
                    if name.startswith("domain_"):
                        col = pa.concat_arrays(table.column(i).chunks)
                        table = table.set_column(i, name, _reverse_rows(col, flip))
            writer.write_table(table)
    return out


def test_loader_reports_the_list_order_of_the_file(schema, dataset, tmp_path):
    plain = PcvrLoader(dataset, schema, batch_size=BATCH)
    want = list(plain)
    assert set(plain.stats()["list_order_detected"].values()) == {"newest-last"}
    for flip, detected in (({0, 1, 2, 3}, "newest-first"), ({1, 3}, "mixed")):
        path = _reversed_copy(dataset, tmp_path / f"flip{len(flip)}.parquet", flip)
        loader = PcvrLoader(path, schema, batch_size=BATCH, num_workers=0)
        got = list(loader)
        stats = loader.stats()
        assert set(stats["list_order_detected"].values()) == {detected}
        for name, counts in stats["list_order_rows"].items():
            assert sum(counts.values()) == ROWS and counts["non_monotonic"] == 0, name
        # the same events in another order give the same batches (rows too short to tell aside)
        for a, b in zip(want, got, strict=True):
            for d in schema.domains:
                tells = (a.sequences[d.name].lengths > 1).numpy()
                assert torch.equal(a.sequences[d.name].values[tells], b.sequences[d.name].values[tells])
    given = PcvrLoader(dataset, schema, batch_size=BATCH, list_order="newest-last")
    list(given)
    assert set(given.stats()["list_order_detected"].values()) == {"given"}


def test_corrupt_page_names_file_and_row_group(schema, dataset, tmp_path):
    """A data page zeroed with the footer intact: open_dataset passes (footer fine), the loader fails at
    the first read of that row group, naming the file and the group, after serving the groups before it."""
    meta = pq.ParquetFile(dataset).metadata
    name = schema.domains[-1].side_features[0].column  # a column the loader reads
    group = meta.row_group(2)
    chunks = [group.column(i) for i in range(group.num_columns)]
    column = next(c for c in chunks if c.path_in_schema.startswith(name + "."))
    bad = tmp_path / "corrupt.parquet"
    data = bytearray(dataset.read_bytes())
    start = column.data_page_offset + 64
    data[start : start + 256] = bytes(256)
    bad.write_bytes(bytes(data))
    for workers in (0, 1):
        loader = PcvrLoader(bad, schema, batch_size=BATCH, num_workers=workers)
        served = 0
        match = r"corrupt\.parquet: row group 2 \(file rows 200\.\.299\) cannot be decoded"
        with pytest.raises(CorruptRowGroupError, match=match) as info:
            for batch in loader:
                served += batch.batch_size
        assert served == 200
        assert "200 rows served before it" in str(info.value)


def test_list_order_flag_on_the_commands_that_load_data():
    from pcvr_lib.cli import build_parser

    for command, extra in (("train", ["--model", "baseline", "--data", "x", "--run-dir", "r"]), ("val", []),
                           ("infer", ["--checkpoint", "c"])):  # fmt: skip
        args = build_parser(command).parse_args([command, *extra, "--list-order", "newest-first"])
        assert args.list_order == "newest-first"
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, *extra, "--list-order", "oldest-first"])


@pytest.mark.parametrize(
    "policy, mode, batch_size", [("lru", "sweep", 40), ("opt", "sweep", 40), ("rr", "steps", 40), ("opt", "sweep", 100)]
)
def test_workers_share_one_cache(policy, mode, batch_size, schema, dataset):
    """The workers' shared cache gives the single-process loader's batches and exactly its hits (same
    policy, same full capacity), a batch converted by one worker serves the other, a hit decodes nothing,
    and every published batch is read and released by the end of the iteration."""
    # 3 batches per row group (40 + 40 + 20 rows): with an even number of batches per pass, round-robin
    # dealing would give every key to the same worker in every pass, and nothing would cross workers;
    # 100: one batch per group, runs of one item, whose decoding worker often holds no item of the run
    kwargs = dict(cache_policy=policy, batch_size=batch_size, mode=mode, passes=3, steps=30, shuffle=True, seed=3,
                  cache_capacity=8)
    local_loader = PcvrLoader(dataset, schema, **kwargs)
    local = list(local_loader)
    local_cache = local_loader.stats()["cache"]
    assert local_cache["hits"] > 0
    for workers in (1, 2):
        loader = PcvrLoader(dataset, schema, num_workers=workers, **kwargs)
        got = list(loader)
        assert len(got) == len(local)
        for a, b in zip(local, got, strict=True):
            assert_batches_equal(a, b)
        cache = loader.stats()["cache"]
        assert cache["shared_across_workers"] and len(cache["per_worker"]) == workers
        assert (cache["hits"], cache["misses"]) == (local_cache["hits"], local_cache["misses"])
        assert sum(w["hits"] for w in cache["per_worker"]) == cache["hits"]
        per_worker_accesses = [w["hits"] + w["misses"] for w in cache["per_worker"]]
        assert per_worker_accesses == [len(local[w::workers]) for w in range(workers)]
        if workers == 2:
            assert cache["served_by_other_workers"] > 0
        else:
            assert cache["served_by_other_workers"] == 0
        # each run of the plan's items from one row group is decoded once, by one worker, and only when
        # it holds a miss; that worker converts the run's misses for the others
        plan, items = loader.shared_cache_plan(), loader.plan_items()
        runs = [[0]]
        for p in range(1, len(items)):
            if items[p][2][1] == items[runs[-1][-1]][2][1]:
                runs[-1].append(p)
            else:
                runs.append([p])
        expected_reads = sum(any(plan.source[p] < 0 for p in run) for run in runs)
        # (every case here has runs made of hits only, so decoding them anyway would fail this)
        assert sum(w["row_groups_read"] for w in loader.stats_per_worker()) == expected_reads < len(runs)
        # an insertion its own worker converted and only that worker hits later stays in that process; the
        # shared-memory store gets only what another worker reads (1 worker: nothing written)
        producer = {p: r % workers for r, run in enumerate(runs) for p in run}
        own = [p for p, readers in plan.readers.items()
               if producer[p] == p % workers and all(r % workers == p % workers for r in readers)]
        assert cache["kept_in_process"] == len(own)
        assert cache["writes"] == sum(producer[p] == p % workers for p in plan.readers) - len(own)
        assert workers == 2 or (cache["writes"] == 0 and len(own) > 0)
        if workers == 2:
            assert all(w["row_groups_read"] > 0 for w in loader.stats_per_worker())  # the decoding is split
            # (one-item runs are decoded by the worker holding the item: nothing to convert for others)
            assert (cache["converted_for_other_workers"] > 0) == (batch_size == 40)
            by_others = sum(w["converted_by_other_workers"] for w in cache["per_worker"])
            assert cache["converted_for_other_workers"] == by_others
        assert [p for p in Path(loader._store_dir).rglob("*") if p.is_file()] == []


def test_shared_cache_replay_is_the_policy(schema, dataset):
    """The shared cache's plan replays the policy: OPT's hits are Belady's on the loader's trace."""
    loader = PcvrLoader(dataset, schema, cache_policy="opt", batch_size=BATCH, passes=3, shuffle=True, cache_capacity=5)
    plan = loader.shared_cache_plan()
    keys = [key for _, _, key in loader.plan_items()]
    hits = sum(s >= 0 for s in plan.source)
    assert hits == plan.stats["hits"] == belady_hit_count(keys, 5)
    for insert, readers in plan.readers.items():
        assert plan.source[insert] == -1 and all(plan.source[r] == insert and keys[r] == keys[insert] for r in readers)


def test_converter_errors_come_wrapped_naming_file_group_and_rows_served(schema, dataset, tmp_path):
    """The converter is the one place that checks the list-order options and rejects rows; the loader
    raises its LoaderError for both, a rejected row naming the file, the row group and the rows served."""
    with pytest.raises(LoaderError, match="non_monotonic must be one of sort, error, got 'drop'") as info:
        PcvrLoader(dataset, schema, non_monotonic="drop")
    assert isinstance(info.value.__cause__, ValueError)
    table = pq.read_table(dataset)
    column = schema.domains[0].ts_feature.column
    times = table.column(column).to_pylist()
    times[130] = [5, 1, 9]  # row group 1, its first batch: neither non-decreasing nor non-increasing
    i = table.schema.get_field_index(column)
    table = table.set_column(i, column, pa.array(times, table.schema.field(i).type))
    bad = tmp_path / "non_monotonic.parquet"
    pq.write_table(table, bad, row_group_size=GROUP)
    assert sum(b.batch_size for b in PcvrLoader(bad, schema, batch_size=BATCH)) == ROWS  # sorted by default
    for workers in (0, 1):
        loader = PcvrLoader(bad, schema, batch_size=BATCH, non_monotonic="error", num_workers=workers)
        served = 0
        match = (
            rf"non_monotonic\.parquet: row group 1 \(file rows 100\.\.199\), batch 0: column '{column}': row 130: "
            r"event timestamps are neither non-decreasing nor non-increasing .*; 100 rows served before it"
        )
        with pytest.raises(LoaderError, match=match) as info:
            for batch in loader:
                served += batch.batch_size
        assert served == 100
        if workers == 0:
            assert isinstance(info.value.__cause__, DataError)


def test_loaders_reuse_decoded_row_groups_inside_the_block_only(schema, dataset, tmp_path):
    """reusing_decoded_row_groups (the smoke's): a later loader of the same file gets the row groups decoded
    already and the same batches; outside the block, or once the file changed, row groups are decoded again."""
    import os
    import shutil

    from pcvr_lib.data.loader_pipeline import reusing_decoded_row_groups

    def sweep(path):
        loader = PcvrLoader(path, schema, preset="none", batch_size=BATCH, passes=1)
        return list(loader), loader.stats()

    plain, plain_stats = sweep(dataset)
    assert plain_stats["row_groups_read"] == ROWS // GROUP
    copy = tmp_path / "copy.parquet"
    shutil.copy(dataset, copy)
    with reusing_decoded_row_groups():
        first, first_stats = sweep(copy)
        again, again_stats = sweep(copy)
        assert (first_stats["row_groups_read"], again_stats["row_groups_read"]) == (ROWS // GROUP, 0)
        assert again_stats["row_groups_reused"] == ROWS // GROUP
        for a, b, c in zip(plain, first, again, strict=True):
            assert_batches_equal(a, b)
            assert_batches_equal(a, c)
        stat = copy.stat()
        os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the file changed: decode again
        assert sweep(copy)[1]["row_groups_read"] == ROWS // GROUP
    assert sweep(copy)[1]["row_groups_read"] == ROWS // GROUP  # the block ended: nothing kept
