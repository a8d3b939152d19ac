"""The seeded data generator (pcvr_lib.data.generate): determinism, columns and types, realistic shapes,
about 10% positives, the planted signal, amplification jitter, the cache and the CLI."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pcvr_lib.cli import main as cli_main
from pcvr_lib.data.convert import Converter
from pcvr_lib.data.generate import generate_dataset, generate_table, generation_info, planted_score
from pcvr_lib.data.parquet import expected_columns, open_dataset
from pcvr_lib.schema import SCALAR_COLUMNS, load_schema

DEMO_SCHEMA = "fixtures/sample_1000_raw.schema.json"
SCALAR_TYPES = {"int64": pa.int64(), "int32": pa.int32()}


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties get their average rank)."""
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    uniq, start = np.unique(sorted_scores, return_index=True)
    ends = np.append(start[1:], len(score))
    avg = (start + ends + 1) / 2  # 1-based average rank of each tie group
    ranks[order] = np.repeat(avg, ends - start)
    pos = label == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_auc_helper():
    assert auc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert auc(np.array([0.5, 0.5, 0.5, 0.5]), np.array([0, 1, 0, 1])) == 0.5
    assert auc(np.array([0.4, 0.3, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0


@pytest.fixture(scope="module")
def demo_schema(repo_root):
    return load_schema(repo_root / DEMO_SCHEMA)


@pytest.fixture(scope="module")
def demo_path(demo_schema, data_cache_dir):
    return generate_dataset(demo_schema, rows=1000, seed=0, cache_dir=data_cache_dir, progress=False)


@pytest.fixture(scope="module")
def demo_table(demo_path):
    return pq.read_table(demo_path)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    schema = load_schema(DEMO_SCHEMA)
    kwargs = dict(rows=60, multiplier=2, row_group_size=30, progress=False)
    a = generate_dataset(schema, seed=5, cache_dir=tmp_path / "a", **kwargs)
    b = generate_dataset(schema, seed=5, cache_dir=tmp_path / "b", **kwargs)
    c = generate_dataset(schema, seed=6, cache_dir=tmp_path / "c", **kwargs)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.name == "demo_120.parquet" and (a.parent / "schema.json").is_file()


def test_columns_and_types_match_schema(demo_schema, demo_path, demo_table):
    open_dataset(demo_path, demo_schema)  # every converter column present with its type
    expected = set(expected_columns(demo_schema)) | set(SCALAR_COLUMNS)
    assert set(demo_table.column_names) == expected
    assert demo_table.num_columns == 120  # like the reference's demo file
    for name, kind in SCALAR_COLUMNS.items():
        assert demo_table.schema.field(name).type == SCALAR_TYPES[kind], name
    assert demo_table.num_rows == 1000


def test_about_ten_percent_positives(demo_table):
    label_type = demo_table.column("label_type").to_numpy()
    assert set(np.unique(label_type)) <= {1, 2}
    assert 0.07 <= (label_type == 2).mean() <= 0.13
    positive = label_type == 2
    delay = demo_table.column("label_time").to_numpy() - demo_table.column("timestamp").to_numpy()
    assert (delay[positive] > 0).all() and (delay[~positive] == 0).all()


def _list_lengths(table, column):
    col = table.column(column).combine_chunks()
    return np.diff(col.offsets.to_numpy()), col


def test_sequences_heavy_tailed_chronological_mostly_before_request(demo_schema, demo_table):
    request = demo_table.column("timestamp").to_numpy()
    for domain in demo_schema.domains:
        lengths, col = _list_lengths(demo_table, domain.ts_feature.column)
        assert (lengths > domain.max_len).mean() > 0.1, domain.name  # truncation matters
        assert lengths.max() <= 4000 and (lengths == 0).any()
        ts = col.values.to_numpy()
        row = np.repeat(np.arange(len(lengths)), lengths)
        nonzero = ts > 0
        assert (ts[nonzero] < request[row][nonzero]).mean() > 0.95
        assert (ts >= request[row]).any()  # some events after the request (strict mode drops them)
        # newest last: within a row, nonzero times never decrease
        same_row = row[1:] == row[:-1]
        both = nonzero[1:] & nonzero[:-1] & same_row
        assert (np.diff(ts)[both] >= 0).all()
    last, _ = _list_lengths(demo_table, demo_schema.domains[-1].ts_feature.column)
    assert 1000 <= last.mean() <= 2000 and np.percentile(last, 95) > 3000  # seq_d-like


def test_noise_is_present(demo_schema, demo_table):
    feat = next(f for f in demo_schema.user_int if f.dim == 1 and f.vocab_size > 100)
    col = demo_table.column(feat.column)
    values = col.to_numpy(zero_copy_only=False)
    assert col.null_count > 0
    valid = values[~np.isnan(values)]
    assert (valid == 0).any() and (valid < 0).any() and (valid >= feat.vocab_size).any()
    oob_eq = 0  # values exactly == vocab (the boundary case) appear
    for f in demo_schema.user_int + demo_schema.item_int:
        if f.dim == 1:
            oob_eq += int(pc.sum(pc.equal(demo_table.column(f.column), f.vocab_size)).as_py() or 0)
    assert oob_eq > 0
    # Zipf-like ids: the most common valid id is far more frequent than the median one
    ids = valid[(valid > 0) & (valid < feat.vocab_size)].astype(np.int64)
    counts = np.bincount(ids)
    assert counts.max() > 10 * max(np.median(counts[counts > 0]), 1)
    # non-finite dense values
    dense = pc.list_flatten(demo_table.column("user_dense_feats_61")).to_numpy()
    assert (~np.isfinite(dense)).any()
    # width>1 lists longer than dim, and null lists
    lengths, col = _list_lengths(demo_table, "user_int_feats_66")
    assert (lengths > 66).any() and col.null_count > 0


def test_dense_lists_aligned_with_same_fid_int_lists(demo_schema, demo_table):
    int_fids = {f.fid for f in demo_schema.user_int if f.dim > 1}
    aligned = [f.fid for f in demo_schema.user_dense if f.fid in int_fids]
    assert aligned == [62, 63, 64, 65, 66, 89, 90, 91]
    for fid in aligned:
        li, ci = _list_lengths(demo_table, f"user_int_feats_{fid}")
        ld, cd = _list_lengths(demo_table, f"user_dense_feats_{fid}")
        np.testing.assert_array_equal(li, ld)
        np.testing.assert_array_equal(
            ci.is_null().to_numpy(zero_copy_only=False), cd.is_null().to_numpy(zero_copy_only=False)
        )


def test_planted_signal_is_learnable(demo_schema, demo_path):
    batch = Converter(demo_schema)(pq.read_table(demo_path))
    label = batch.label.numpy()
    score = planted_score(batch, demo_schema)
    assert auc(score, label) > 0.65
    # each planted term on its own is informative
    assert len(np.unique(score)) >= 8


def test_multiplier_jitter_and_row_groups(tmp_path):
    schema = load_schema(DEMO_SCHEMA)
    path = generate_dataset(
        schema, rows=40, multiplier=3, seed=1, row_group_size=20, cache_dir=tmp_path, progress=False
    )
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 120 and meta.num_row_groups == 6
    assert all(meta.row_group(i).num_rows == 20 for i in range(6))
    table = pq.read_table(path)
    base = generate_table(schema, 40, seed=1)
    for i in range(3):
        part = table.slice(40 * i, 40)
        for name, shift in (
            ("user_id", 40 * i),
            ("item_id", 40 * i),
            ("timestamp", 86400 * i),
            ("label_time", 86400 * i),
        ):
            np.testing.assert_array_equal(part.column(name).to_numpy(), base.column(name).to_numpy() + shift)
        for name in ("label_type", "user_int_feats_1", "domain_d_seq_26", "user_int_feats_66"):
            assert part.column(name).equals(base.column(name)), name
        dense = [pc.list_flatten(t.column("user_dense_feats_61")).to_numpy() for t in (part, base)]
        np.testing.assert_array_equal(*dense)  # NaN-aware: the values are the same
    info = generation_info(path)  # written beside the file
    assert info["rows"] == 120 and info["row_groups"] == 6 and info["bytes"] == path.stat().st_size
    assert info["seconds"] > 0 and info["peak_rss_bytes"] > 0


def test_list_orders_hold_the_same_events(tmp_path):
    schema = load_schema(DEMO_SCHEMA)
    tables = {o: generate_table(schema, 60, seed=2, list_order=o) for o in ("newest-last", "newest-first", "mixed")}
    flipped = 0
    for domain in schema.domains:
        for feat in domain.features:
            last, first, mixed = (tables[o].column(feat.column).to_pylist() for o in tables)
            for a, b, c in zip(last, first, mixed, strict=True):
                assert b == (None if a is None else a[::-1])
                assert c in (a, b)
                flipped += c != a
    assert flipped > 0
    # the other columns are untouched
    for name in ("user_id", "timestamp", "user_int_feats_1", "label_type"):
        assert tables["newest-first"].column(name).equals(tables["newest-last"].column(name))
    with pytest.raises(ValueError, match="list_order must be one of newest-last, newest-first, mixed"):
        generate_table(schema, 5, list_order="oldest")


def test_cache_reuse_force_and_out(tmp_path):
    schema = load_schema(DEMO_SCHEMA)
    path = generate_dataset(schema, rows=20, cache_dir=tmp_path, progress=False)
    stamp = path.stat().st_mtime_ns
    assert generate_dataset(schema, rows=20, cache_dir=tmp_path, progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # reused, not rewritten
    other = generate_dataset(schema, rows=20, seed=1, cache_dir=tmp_path, progress=False)
    assert other != path and other.parent != path.parent
    generate_dataset(schema, rows=20, cache_dir=tmp_path, progress=False, force=True)
    assert path.stat().st_mtime_ns != stamp
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temp files

    out = tmp_path / "mine" / "data.parquet"
    generate_dataset(schema, rows=20, out=out, progress=False)
    assert (out.parent / "schema.json").is_file()
    with pytest.raises(FileExistsError, match="pass --force"):
        generate_dataset(schema, rows=20, out=out, progress=False)
    generate_dataset(schema, rows=20, out=out, progress=False, force=True)


def test_env_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PCVR_CACHE_DIR", str(tmp_path / "env"))
    path = generate_dataset(DEMO_SCHEMA, rows=10, progress=False)
    assert path.is_relative_to(tmp_path / "env")


@pytest.mark.parametrize("kwargs,message", [({"rows": 0}, "rows must be"), ({"multiplier": 0}, "multiplier must be")])
def test_bad_parameters(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_dataset(DEMO_SCHEMA, cache_dir=tmp_path, progress=False, **kwargs)


def test_cli_generate(tmp_path, capsys):
    out = tmp_path / "cli" / "demo.parquet"
    args = ["generate", "--schema", DEMO_SCHEMA, "--rows", "30", "--multiplier", "2", "--row-group-size", "30"]
    assert cli_main([*args, "--out", str(out), "--no-progress"]) == 0
    assert "rows=60 row_groups=2" in capsys.readouterr().out
    assert cli_main([*args, "--out", str(out), "--no-progress"]) == 2  # the CLI boundary: one line, exit 2
    assert "pcvr generate: error: --out" in capsys.readouterr().err
    assert cli_main([*args, "--out", str(out), "--no-progress", "--force"]) == 0


def test_any_valid_schema(tmp_path):
    raw = {
        "format": "raw_parquet",
        "user_int": [[1, 0, 1], [2, 1, 4]],
        "item_int": [[3, 2, 1]],
        "user_dense": [[2, 4], [5, 3]],
        "item_dense": [[6, 2]],
        "seq": {
            "z": {"prefix": "zz", "ts_fid": 4, "features": [[4, 10]]},
            "y": {"prefix": "yy", "ts_fid": 1, "features": [[1, 3], [2, 0]]},
        },
    }
    schema = load_schema(raw, max_lens={"z": 4, "y": 2})
    path = generate_dataset(schema, rows=50, cache_dir=tmp_path, progress=False)
    open_dataset(path, schema)
    batch = Converter(schema)(pq.read_table(path))
    assert batch.batch_size == 50 and batch.item.dense_values.shape == (50, 2)
