"""Splits: disjoint, covering, ties to valid, hash stability, users on one side, empty-side errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pcvr_lib.data.split import (
    HASH_MODULUS,
    SplitError,
    hash_scores,
    plan_split,
    row_group_tail,
    sample_hash,
    splitmix64,
    timestamp_auto,
    user_hash,
)


def check_partition(plan, expect_cover: bool = True):
    assert not (plan.train_mask & plan.valid_mask).any()
    if expect_cover:
        assert (plan.train_mask | plan.valid_mask).all()
        assert plan.dropped_rows == 0


def test_timestamp_auto_ties_go_to_valid():
    # 1000 rows, 0.2 -> target 200; the 200th newest timestamp is shared by rows 799 and 800 -> 201 valid
    ts = np.arange(1000, dtype=np.int64)
    ts[800] = ts[799]
    rng = np.random.default_rng(0)
    perm = rng.permutation(1000)
    plan = timestamp_auto(ts[perm], valid_ratio=0.2)
    check_partition(plan)
    assert int(plan.valid_mask.sum()) == 201 and int(plan.train_mask.sum()) == 799
    assert ts[perm][plan.valid_mask].min() > ts[perm][plan.train_mask].max() - 1
    assert plan.params["valid_start"] == 799


def test_timestamp_auto_clamps_the_target_and_limits_train():
    ts = np.arange(10, dtype=np.int64)
    assert int(timestamp_auto(ts, valid_ratio=0.01).valid_mask.sum()) == 1  # at least one valid row
    assert int(timestamp_auto(ts, valid_ratio=0.99).train_mask.sum()) == 1  # at least one train row
    plan = timestamp_auto(ts, valid_ratio=0.2, train_ratio=0.5)
    check_partition(plan, expect_cover=False)
    # the newest half of the 8 training rows is kept
    assert plan.rows("train").tolist() == [4, 5, 6, 7] and plan.dropped_rows == 4


def test_timestamp_auto_empty_side_is_an_error():
    with pytest.raises(SplitError, match="train side is empty"):
        timestamp_auto(np.full(50, 7, dtype=np.int64))  # every row ties with the validation start
    with pytest.raises(SplitError, match="at least 2 rows"):
        timestamp_auto(np.array([1], dtype=np.int64))
    with pytest.raises(SplitError, match="valid_ratio must be in"):
        timestamp_auto(np.arange(10), valid_ratio=1.0)


def test_row_group_tail_and_the_fixed_quirk():
    plan = row_group_tail([100] * 10, valid_ratio=0.2)
    check_partition(plan)
    assert plan.row_groups("valid").tolist() == [8, 9] and plan.row_groups("train").tolist() == list(range(8))
    plan = row_group_tail([100] * 10, valid_ratio=0.2, train_ratio=0.5)
    # dropped training groups are in neither side (the reference put them into valid)
    assert plan.row_groups("valid").tolist() == [8, 9]
    assert plan.row_groups("train").tolist() == [4, 5, 6, 7]
    assert plan.dropped_rows == 400
    check_partition(plan, expect_cover=False)


def test_row_group_tail_single_group_is_flagged():
    plan = row_group_tail([300], valid_ratio=0.2)
    assert plan.flags == ("single_row_group",)
    assert plan.train_mask.all() and plan.valid_mask.all()


def test_splitmix64_known_values():
    # splitmix64's reference outputs for seed 0 (state advanced by the golden gamma before mixing)
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([0x9E3779B97F4A7C15], dtype=np.uint64))[0]) == 0x6E789E6AA1B965F4


def test_hash_splits_are_stable_and_keep_users_on_one_side():
    rng = np.random.default_rng(1)
    users = rng.integers(-(2**40), 2**40, size=300)
    user_ids = users[rng.integers(0, 300, size=5000)]
    a = user_hash(user_ids, valid_ratio=0.3, salt=9)
    b = user_hash(user_ids.copy(), valid_ratio=0.3, salt=9)
    assert np.array_equal(a.valid_mask, b.valid_mask)
    check_partition(a)
    for u in np.unique(user_ids):
        sides = a.valid_mask[user_ids == u]
        assert sides.all() or not sides.any()
    share = a.valid_mask.mean()
    assert 0.2 < share < 0.4
    assert not np.array_equal(a.valid_mask, user_hash(user_ids, valid_ratio=0.3, salt=10).valid_mask)
    scores = hash_scores(user_ids, 9)
    assert scores.min() >= 0 and scores.max() < HASH_MODULUS
    assert np.array_equal(a.valid_mask, scores < round(0.3 * HASH_MODULUS))


def test_string_user_ids_hash_like_their_bytes():
    names = [f"user-{i}" for i in range(40)]
    ids = np.array(names * 10, dtype=object)
    plan = user_hash(ids, valid_ratio=0.5)
    for name in names:
        sides = plan.valid_mask[ids == name]
        assert sides.all() or not sides.any()
    bytes_plan = user_hash(np.array([s.encode() for s in ids], dtype=object), valid_ratio=0.5)
    assert np.array_equal(plan.valid_mask, bytes_plan.valid_mask)


def test_sample_hash_split_and_train_ratio():
    plan = sample_hash(20_000, valid_ratio=0.1, salt=3)
    check_partition(plan)
    assert abs(plan.valid_mask.mean() - 0.1) < 0.01
    assert np.array_equal(plan.valid_mask, sample_hash(20_000, valid_ratio=0.1, salt=3).valid_mask)
    limited = sample_hash(20_000, valid_ratio=0.1, train_ratio=0.5, salt=3)
    assert np.array_equal(limited.valid_mask, plan.valid_mask)
    assert not (limited.train_mask & ~plan.train_mask).any()  # a subset of the full training side
    assert abs(limited.train_mask.mean() - 0.45) < 0.015
    with pytest.raises(SplitError, match="valid side is empty"):
        sample_hash(3, valid_ratio=1e-6)


def test_plan_split_reads_the_file(tmp_path):
    n = 1000
    table = pa.table(
        {
            "timestamp": pa.array(np.arange(n) // 5, pa.int64()),
            "user_id": pa.array(np.arange(n) % 37, pa.int64()),
        }
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=250)
    pf = pq.ParquetFile(path)
    plan = plan_split(pf, "timestamp_auto", valid_ratio=0.2)
    assert plan.row_group_rows.tolist() == [250] * 4
    assert int(plan.valid_mask.sum()) == 200 and plan.row_groups("valid").tolist() == [3]
    assert plan.row_group_counts("train").tolist() == [250, 250, 250, 50]
    plan = plan_split(pf, "row_group_tail", valid_ratio=0.25)
    assert plan.row_groups("valid").tolist() == [3]
    plan = plan_split(pf, "user_hash", valid_ratio=0.2)
    check_partition(plan)
    assert np.array_equal(plan.valid_mask, user_hash(np.arange(n) % 37, valid_ratio=0.2).valid_mask)
    plan = plan_split(pf, "sample_hash", valid_ratio=0.2)
    assert np.array_equal(plan.valid_mask, sample_hash(n, valid_ratio=0.2).valid_mask)
    with pytest.raises(SplitError, match="unknown split method 'by_day'"):
        plan_split(pf, "by_day")
