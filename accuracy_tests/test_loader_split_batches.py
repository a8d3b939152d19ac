"""Split first, then batch: with a split, `batch_size` is the number of rows of the chosen side in every
batch except the last of each row group, and the side's rows come out exactly once per sweep."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from pcvr_lib.data.generate import generate_table
from pcvr_lib.data.loader import PcvrLoader
from pcvr_lib.schema import load_schema

ROWS, GROUP = 300, 100


@pytest.fixture(scope="module")
def schema(repo_root):
    return load_schema(repo_root / "fixtures" / "sample_1000_raw.schema.json", "seq_a:4,seq_b:4,seq_c:4,seq_d:4")


@pytest.fixture(scope="module")
def dataset(schema, tmp_path_factory):
    path = tmp_path_factory.mktemp("split_batches") / "demo.parquet"
    pq.write_table(generate_table(schema, ROWS, seed=1), path, row_group_size=GROUP)
    return path


@pytest.mark.parametrize("split", ["sample_hash", "user_hash", "timestamp_auto"])
@pytest.mark.parametrize("side", ["train", "valid"])
@pytest.mark.parametrize("batch_size", [7, 32])
def test_batches_hold_batch_size_rows_of_the_side(schema, dataset, split, side, batch_size):
    loader = PcvrLoader(dataset, schema, batch_size=batch_size, split=split, side=side, valid_ratio=0.3)
    batches = list(loader)
    side_rows = np.flatnonzero(loader.split.mask(side))
    got = np.concatenate([b.row_index.numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(got), side_rows)  # each side row once, no other row
    group_of = np.searchsorted(loader.row_group_offsets, side_rows, side="right") - 1
    expected = []
    for g in range(len(loader.row_group_rows)):
        n = int((group_of == g).sum())
        expected += [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    assert [b.batch_size for b in batches] == expected


def test_steps_mode_draws_full_batches(schema, dataset):
    loader = PcvrLoader(dataset, schema, batch_size=16, mode="steps", steps=30, seed=3, split="sample_hash",
                        side="train", valid_ratio=0.3)
    sizes = [b.batch_size for b in loader]
    train_mask = loader.split.mask("train")
    per_group = [int(train_mask[g * GROUP:(g + 1) * GROUP].sum()) for g in range(ROWS // GROUP)]
    allowed = {16} | {n % 16 for n in per_group if n % 16}
    assert len(sizes) == 30 and set(sizes) <= allowed
