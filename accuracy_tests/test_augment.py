"""Augmentations: bounds, zeros past length, p=0 identity, p=1 zeroes everything, seeding, view repeats."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.data.augment import (
    BENCHMARK_AUGMENTATIONS,
    Augmenter,
    DomainDropout,
    FeatureMask,
    SequenceCrop,
    SparseDropout,
    parse_transform,
)
from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock


def make_batch(rows: int = 16, seed: int = 0, lengths: dict[str, int] | None = None) -> Batch:
    """A small random batch obeying the carrier's invariants (zeros past length, ids >= 1 when valid)."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or {"seq_a": 12, "seq_b": 20}

    def block(d_int: int, d_dense: int) -> FeatureBlock:
        values = torch.randint(0, 50, (rows, d_int), generator=g, dtype=torch.int32)
        dense = torch.randn(rows, d_dense, generator=g)
        return FeatureBlock(values, values == 0, dense, torch.zeros(rows, d_dense, dtype=torch.bool))

    sequences = {}
    for name, length in lengths.items():
        lens = torch.randint(0, length + 1, (rows,), generator=g, dtype=torch.int32)
        lens[0], lens[-1] = length, 0  # a full and an empty row always present
        valid = torch.arange(length)[None, :] < lens[:, None]
        values = torch.randint(1, 1000, (rows, 3, length), generator=g, dtype=torch.int32) * valid[:, None]
        ts = (1_000 + torch.arange(length, dtype=torch.int64))[None, :].expand(rows, -1) * valid
        sequences[name] = SequenceBlock(values, ts.contiguous(), lens)
    return Batch(
        user=block(7, 4),
        item=block(3, 0),
        sequences=sequences,
        request_timestamp=torch.full((rows,), 5_000, dtype=torch.int64),
        label=(torch.arange(rows) % 3 == 0).float(),
        user_id=torch.arange(rows, dtype=torch.int64) * 11,
        row_index=torch.arange(rows, dtype=torch.int64) + 100,
    )


def assert_zero_past_length(batch: Batch) -> None:
    for name, seq in batch.sequences.items():
        pad = ~seq.valid_mask()
        assert (seq.values.masked_select(pad[:, None, :].expand_as(seq.values)) == 0).all(), name
        assert (seq.timestamps[pad] == 0).all(), name
        assert ((seq.lengths >= 0) & (seq.lengths <= seq.max_len)).all(), name


def assert_same(a: Batch, b: Batch) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("mode", ["random_tail", "rolling", "tail"])
def test_crop_bounds_and_windows(mode):
    batch = make_batch(rows=64, seed=1)
    out = SequenceCrop(views_per_row=3, mode=mode, min_len=8)(batch, gen(2))
    assert out.batch_size == 3 * batch.batch_size
    assert_zero_past_length(out)
    for name, seq in out.sequences.items():
        src = batch.sequences[name]
        orig = src.lengths.repeat_interleave(3)
        new = seq.lengths
        assert (new <= orig).all()
        assert (new >= torch.clamp(orig, max=8)).all()  # min_len <= length unless the row is shorter
        if mode == "tail":
            assert torch.equal(new, orig)
        # every kept window is a contiguous run of the original events, in order
        src_ts = src.timestamps.repeat_interleave(3, dim=0)
        for r in range(out.batch_size):
            n, full = int(new[r]), int(orig[r])
            window = seq.timestamps[r, :n]
            if n:
                start = int(window[0] - 1_000)
                assert torch.equal(window, src_ts[r, start : start + n])
                assert torch.equal(seq.values[r, :, :n], src.values[r // 3, :, start : start + n])
                if mode in ("random_tail", "tail"):
                    assert start + n == full  # the window ends at the newest event


def test_crop_repeats_labels_user_ids_interleaved():
    batch = make_batch(rows=5)
    out = SequenceCrop(views_per_row=2)(batch, gen())
    assert torch.equal(out.label, batch.label.repeat_interleave(2))
    assert torch.equal(out.user_id, batch.user_id.repeat_interleave(2))
    assert torch.equal(out.row_index, batch.row_index.repeat_interleave(2))
    assert torch.equal(out.user.int_values[0::2], batch.user.int_values)
    assert torch.equal(out.user.int_values[1::2], batch.user.int_values)


def test_crop_random_tail_draws_cover_the_range():
    # one long row repeated: the window lengths must reach both ends of [min_len, len]
    batch = make_batch(rows=2, lengths={"seq_a": 16})
    out = SequenceCrop(views_per_row=400, mode="random_tail", min_len=4)(batch, gen(3))
    lens = out.sequences["seq_a"].lengths[:400]
    assert int(lens.min()) == 4 and int(lens.max()) == 16


def test_feature_mask_p0_identity_p1_zeroes_everything():
    batch = make_batch(rows=32, seed=4)
    assert_same(FeatureMask(0.0)(batch, gen()), batch)
    out = FeatureMask(1.0)(batch, gen())
    for side in (out.user, out.item):
        assert (side.int_values == 0).all() and side.int_missing.all()
    for seq in out.sequences.values():
        assert (seq.lengths == 0).all() and (seq.values == 0).all() and (seq.timestamps == 0).all()
    # dense features, labels and ids are untouched
    assert torch.equal(out.user.dense_values, batch.user.dense_values)
    assert torch.equal(out.label, batch.label)


def test_feature_mask_compacts_surviving_events_in_order():
    batch = make_batch(rows=64, seed=5)
    out = FeatureMask(0.3)(batch, gen(6))
    assert_zero_past_length(out)
    for name, seq in out.sequences.items():
        src = batch.sequences[name]
        assert (seq.lengths <= src.lengths).all()
        assert (seq.lengths < src.lengths).any()  # something was dropped at p=0.3
        for r in range(seq.lengths.shape[0]):
            n = int(seq.lengths[r])
            kept = seq.timestamps[r, :n] - 1_000  # timestamps encode the original positions
            assert (kept[1:] > kept[:-1]).all()  # order kept, no duplicates
            assert torch.equal(seq.values[r, :, :n], src.values[r, :, kept])
    masked = out.user.int_values != batch.user.int_values
    assert (out.user.int_missing[masked]).all()


def test_domain_and_sparse_dropout_extremes():
    batch = make_batch(rows=32, seed=7)
    assert_same(DomainDropout(0.0)(batch, gen()), batch)
    assert_same(SparseDropout(0.0)(batch, gen()), batch)
    out = DomainDropout(1.0)(batch, gen())
    for seq in out.sequences.values():
        assert (seq.lengths == 0).all() and (seq.values == 0).all() and (seq.timestamps == 0).all()
    out = SparseDropout(1.0)(batch, gen())
    assert (out.user.int_values == 0).all() and out.user.int_missing.all()
    assert (out.item.int_values == 0).all() and out.item.int_missing.all()
    assert torch.equal(out.sequences["seq_a"].values, batch.sequences["seq_a"].values)


def test_dropouts_act_per_row():
    batch = make_batch(rows=400, seed=8)
    out = SparseDropout(0.5)(batch, gen(9))
    dropped = (out.user.int_values == 0).all(1) & out.user.int_missing.all(1)
    assert 100 < int(dropped.sum()) < 300
    # a dropped row loses its item ints too; a kept row keeps both blocks
    item_dropped = out.item.int_missing.all(1) & (out.item.int_values == 0).all(1)
    assert (item_dropped[dropped]).all()
    assert torch.equal(out.user.int_values[~dropped], batch.user.int_values[~dropped])
    out = DomainDropout(0.5)(batch, gen(9))
    seq, src = out.sequences["seq_b"], batch.sequences["seq_b"]
    zeroed = (seq.lengths == 0) & (src.lengths > 0)
    assert 100 < int(zeroed.sum()) < 300
    assert torch.equal(seq.values[seq.lengths > 0], src.values[seq.lengths > 0])


def test_same_seed_same_result_and_input_untouched():
    batch = make_batch(rows=32, seed=10)
    before = batch.clone()
    aug = Augmenter(list(BENCHMARK_AUGMENTATIONS) + [SparseDropout(0.2)])
    a, b = aug(batch, gen(11)), aug(batch, gen(11))
    assert_same(a, b)
    assert_same(batch, before)  # transforms never write into their input
    c = aug(batch, gen(12))
    assert any(not torch.equal(x, y) for x, y in zip(a.tensors(), c.tensors(), strict=True))
    assert a.batch_size == 64
    assert_zero_past_length(a)


@pytest.mark.parametrize("mode", ["random_tail", "rolling", "tail"])
def test_fused_chain_equals_one_transform_at_a_time(mode):
    # the Augmenter plans all sequence moves and gathers once; applying each transform on its own (each
    # gathering its output) with the same generator must give the same batch
    batch = make_batch(rows=40, seed=14)
    chain = [
        SequenceCrop(2, mode, 3),
        FeatureMask(0.3),
        DomainDropout(0.3),
        SequenceCrop(2, mode, 2),
        FeatureMask(0.2),
        SparseDropout(0.3),
    ]
    fused = Augmenter(chain)(batch, gen(15))
    g = gen(15)
    stepwise = batch
    for transform in chain:
        stepwise = transform(stepwise, g)
    assert fused.batch_size == 160
    assert_same(fused, stepwise)
    assert_zero_past_length(fused)


def test_config_order_matters():
    batch = make_batch(rows=32, seed=13)
    nonempty = batch.sequences["seq_a"].lengths > 0
    # dropout before the crop zeroes both views of a row together ...
    out = Augmenter([DomainDropout(0.5), SequenceCrop(2)])(batch, gen(1))
    empty = (out.sequences["seq_a"].lengths == 0).view(-1, 2)[nonempty]
    assert empty.any() and torch.equal(empty[:, 0], empty[:, 1])
    # ... after the crop, the views of a row are dropped independently
    out = Augmenter([SequenceCrop(2), DomainDropout(0.5)])(batch, gen(1))
    empty = (out.sequences["seq_a"].lengths == 0).view(-1, 2)[nonempty]
    assert (empty[:, 0] != empty[:, 1]).any()


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "crop", "mode": "middle"}, "mode must be one of"),
        ({"type": "crop", "views_per_row": 0}, "views_per_row"),
        ({"type": "mask", "p": 1.5}, r"p must be a probability"),
        ({"type": "blur", "p": 0.1}, "unknown augmentation type 'blur'"),
        ({"type": "mask", "q": 0.1}, "bad parameters"),
    ],
)
def test_bad_configs_name_the_option(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_transform(spec)
