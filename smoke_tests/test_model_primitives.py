"""Shared model primitives against slow, obviously-right references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcvr_lib.data.batch import SequenceBlock
from pcvr_lib.models.common import FeatureEmbeddings
from pcvr_lib.models.kernel_ops import attention, rms_norm
from pcvr_lib.models.onetrans import dedup_tail, keep_newest
from pcvr_lib.models.sequences import TIME_BOUNDARIES_SEC, pack_segments, sequence_stats, time_buckets, trim_sequence
from pcvr_lib.workloads.models import demo_schema, random_batch


def test_time_buckets_match_the_rule():
    assert len(TIME_BOUNDARIES_SEC) == 63
    assert TIME_BOUNDARIES_SEC[0] == pytest.approx(5) and TIME_BOUNDARIES_SEC[-1] == pytest.approx(31_536_000)
    request = torch.tensor([1000, 10**9])
    events = torch.tensor([[999, 996, 0, -5], [10**9 - 10**8, 10**9 + 5, 10**9 - 4, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, False]])
    got = time_buckets(request, events, valid)
    for b in range(2):
        for i in range(4):
            delta = int(request[b] - events[b, i])
            expect = min(int(np.searchsorted(TIME_BOUNDARIES_SEC, delta)) + 1, 63) if valid[b, i] else 0
            assert got[b, i].item() == expect
    assert got[0, 0] == 1 and got[1, 0] == 63 and got[0, 3] == 0  # 1 s; 10^8 s is past the last boundary


def test_hashing_maps_ids_into_each_features_rows():
    schema = demo_schema(4)
    emb = FeatureEmbeddings(schema, emb_dim=4, vocab_cap=100, hash_large=True)
    ids = torch.tensor([[0, 1, 100, 101, 250]], dtype=torch.int32)
    base, mod = torch.tensor(10), torch.tensor(100)
    rows = FeatureEmbeddings._rows(ids, base, mod)
    assert rows.tolist() == [[0, 10, 109, 10, 59]]  # id -> ((id - 1) mod N) + 1, offset by the base
    assert emb.table.weight[0].abs().sum() == 0
    assert "seq_c_47" in emb.hashed_features and "user_int_1" not in emb.hashed_features


def test_reference_thresholds_drop_or_hash_large_vocabularies():
    """Above emb_skip_threshold a feature is dropped (every id reads the zero row) or hashed to threshold
    rows; below it the table is the identity; vocab_cap bounds every table on top of that."""
    schema = demo_schema(4)
    large = {"seq_a_38", "seq_b_69", "seq_c_29", "seq_c_34", "seq_c_36", "seq_c_47"}  # vocab > 1M
    with torch.device("meta"):
        dropped = FeatureEmbeddings(schema, emb_dim=2)
        hashed = FeatureEmbeddings(schema, emb_dim=2, hash_large=True)
        seq_small = FeatureEmbeddings(schema, emb_dim=2, hash_large=True, seq_threshold=10_000)
    assert set(dropped.dropped_features) == large and not dropped.hashed_features
    assert set(hashed.hashed_features) == large and not hashed.dropped_features
    assert hashed.table.weight.shape[0] - dropped.table.weight.shape[0] == 6 * 1_000_000
    assert "seq_a_44" in seq_small.hashed_features and "user_int_16" not in seq_small.hashed_features
    emb = FeatureEmbeddings(schema, emb_dim=2, vocab_cap=50)  # dropped stays dropped under a cap
    batch = random_batch(schema, batch=2, seed=0, empty_rows=0)
    a38 = emb.sequence(batch.sequences["seq_a"], "seq_a")[..., :2]  # fid 38 is the first side feature
    assert a38.abs().sum() == 0 and emb.sequence(batch.sequences["seq_a"], "seq_a").abs().sum() > 0


def test_bag_mean_over_nonzero_ids():
    schema = demo_schema(4)
    emb = FeatureEmbeddings(schema, emb_dim=3, vocab_cap=50)
    batch = random_batch(schema, batch=3, seed=1)
    got = emb.fields(batch, "user")
    rows = FeatureEmbeddings._rows(batch.user.int_values, emb.user_base, emb.user_mod)
    table = emb.table.weight.detach()
    for f_index, feat in enumerate(schema.user_int):
        for b in range(3):
            r = rows[b, feat.offset: feat.offset + feat.dim]
            r = r[r > 0]
            expect = table[r].mean(0) if len(r) else torch.zeros(3)
            torch.testing.assert_close(got[b, f_index].detach(), expect)


def test_pack_segments_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    segments = []
    for size in (3, 1, 4, 2):
        tokens = torch.randn(5, size, 2, generator=gen)
        lengths = torch.randint(0, size + 1, (5,), generator=gen)
        segments.append((tokens, lengths))
    stream, total = pack_segments(segments)
    for b in range(5):
        expect = torch.cat([t[b, : n[b]] for t, n in segments])
        assert total[b] == len(expect)
        torch.testing.assert_close(stream[b, : len(expect)], expect)
        assert (stream[b, len(expect):] == 0).all()


def test_trim_tail_keeps_newest_events():
    values = torch.arange(1, 11, dtype=torch.int32).view(1, 1, 10).repeat(2, 1, 1)
    ts = torch.arange(10, dtype=torch.int64).view(1, 10).repeat(2, 1)
    lengths = torch.tensor([7, 2], dtype=torch.int32)
    valid = torch.arange(10)[None] < lengths[:, None]
    seq = SequenceBlock(values * valid[:, None], ts * valid, lengths)
    out = trim_sequence(seq, max_len=3, tail=True)
    assert out.values[0, 0].tolist() == [5, 6, 7] and out.values[1, 0].tolist() == [1, 2, 0]
    assert out.lengths.tolist() == [3, 2]


def test_dedup_tail_drops_older_duplicates_and_keeps_newest_k():
    first = torch.tensor([[4, 5, 4, 6, 5, 7, 0, 0]], dtype=torch.int32)
    values = torch.stack([first, first * 10], dim=1)
    lengths = torch.tensor([6], dtype=torch.int32)
    seq = SequenceBlock(values, torch.arange(8)[None] * (torch.arange(8)[None] < 6), lengths)
    out = dedup_tail(seq, k=3, window=8)
    # events 4,5,4,6,5,7 -> drop the older 4 and 5 -> 4,6,5,7 -> newest 3: 6,5,7
    assert out.values[0, 0].tolist() == [6, 5, 7]
    assert out.timestamps[0].tolist() == [3, 4, 5]
    assert out.lengths.tolist() == [3]
    x = torch.arange(12.0).view(1, 6, 2)
    kept, n = keep_newest(x, torch.tensor([4]), 2)
    assert kept[0].tolist() == [[4.0, 5.0], [6.0, 7.0]] and n.tolist() == [2]


def test_sequence_stats_by_hand():
    values = torch.tensor([[[3, 3, 5, 0], [1, 0, 2, 0]]], dtype=torch.int32)  # 1 row, 2 features, L 4
    ts = torch.tensor([[100, 200, 300, 0]])
    seq = SequenceBlock(values, ts, torch.tensor([3], dtype=torch.int32))
    stats = sequence_stats(seq, torch.tensor([310]))[0]
    assert stats[0] == pytest.approx(3 / 4)  # length / L
    assert stats[1] == pytest.approx(1.0)  # all 3 events active
    assert stats[2] == pytest.approx(2 / 3)  # ids 3, 5 distinct among 3 active
    assert stats[3] == pytest.approx(1 / 3)
    assert stats[4] == pytest.approx(5 / 6)  # 5 non-zero slots of 2 x 3
    expect_bucket = min(int(np.searchsorted(TIME_BOUNDARIES_SEC, 10)) + 1, 63)
    assert stats[5] == pytest.approx(expect_bucket / 63)


def test_attention_masks_against_fp64_reference():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([4, 0])
    out = attention(q, k, v, key_lengths=lengths, causal=True, window=3, global_last=True)
    assert torch.isfinite(out).all()  # a row with no valid key attends to itself
    for b in range(2):
        n = max(int(lengths[b]), 1)
        for i in range(6):
            allowed = [j for j in range(6) if j < n and j <= i and j > i - 3]
            if i == int(lengths[b]) - 1:
                allowed = list(range(n))
            if i >= n:  # a padded query also sees itself, so no row is empty
                allowed = allowed + [i]
            s = torch.einsum("hd,hnd->hn", q[b, :, i], k[b, :, allowed]) / 2.0  # 1 / sqrt(head dim 4)
            expect = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v[b, :, allowed])
            torch.testing.assert_close(out[b, :, i], expect)


def test_rms_norm_torch_formula():
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expect)


def test_rope_rotates_pairs_by_position():
    from pcvr_lib.models.common import apply_rope

    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    out = apply_rope(x)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps norms
    torch.testing.assert_close(out[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    # relative property: <rope(q)_i, rope(k)_j> depends on i - j only
    q = torch.randn(8, dtype=torch.float64).expand(1, 1, 5, 8)
    k = torch.randn(8, dtype=torch.float64).expand(1, 1, 5, 8)
    rq, rk = apply_rope(q.contiguous()), apply_rope(k.contiguous())
    torch.testing.assert_close((rq[0, 0, 3] * rk[0, 0, 1]).sum(), (rq[0, 0, 4] * rk[0, 0, 2]).sum())
