"""TokenFormer reads what its stream is meant to hold (checked by perturbing one input at a time).

Sequences in a Batch are oldest first and left-aligned, the newest event at position length-1. The
per-domain tail window must take positions length-w .. length-1 of each row (not the last w slots of the
padded tensor), and the target token, whose output the head reads, must depend on every token of its own
row - field tokens and the newest events included - and on nothing else.
"""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.models import build_model
from pcvr_lib.workloads.models import demo_schema, random_batch

WINDOW = 4  # events per domain in the stream (and the top blocks' sliding window): shorter than the rows


@pytest.fixture(scope="module")
def setup():
    schema = demo_schema(max_len=16)
    torch.manual_seed(0)
    # fp64: a field's effect on one row's logit can be ~1e-8 at a random init, below fp32 noise
    model = build_model("tokenformer", schema, {"window": WINDOW, "vocab_cap": 256}).eval().double()
    batch = random_batch(schema, batch=6, seed=3, p_zero=0.0).map(
        lambda t: t.double() if t.is_floating_point() else t)
    with torch.no_grad():
        logits = model(batch)[:, 0]
    return schema, model, batch, logits


def _relabel_event(batch, schema, domain, rows, positions):
    """A copy of the batch where the side features 1.. of `domain` at positions[i] of rows[i] get another
    non-zero id. Feature 0, the zero pattern and the timestamps stay, so the sequence statistics (dense
    input) do not change: only the event's token can carry the change."""
    out = batch.clone()
    seq = out.sequences[domain]
    vocab = torch.as_tensor(schema.domain(domain).side_vocab)
    for r, p in zip(rows, positions, strict=True):
        v = seq.values[r, 1:, p].long()
        shifted = torch.remainder(v, (vocab[1:] - 1).clamp(min=1)) + 1
        seq.values[r, 1:, p] = torch.where((v > 0) & (vocab[1:] >= 3), shifted, v).to(seq.values.dtype)
    return out


def _changed(model, batch, reference):
    with torch.no_grad():
        return (model(batch)[:, 0] - reference).abs() > 1e-10


def test_newest_events_reach_the_target_and_older_ones_do_not(setup):
    schema, model, batch, logits = setup
    checked = 0
    for domain in schema.domains:
        lengths = batch.sequences[domain.name].lengths.long()
        rows = [r for r in range(len(lengths)) if lengths[r] > WINDOW]
        assert rows, "the test batch needs rows longer than the window"
        newest = [int(lengths[r]) - 1 for r in rows]
        changed = _changed(model, _relabel_event(batch, schema, domain.name, rows, newest), logits)
        assert changed[rows].all(), f"{domain.name}: the newest event (position length-1) does not reach the logit"
        others = [r for r in range(len(lengths)) if r not in rows]
        assert not changed[others].any(), f"{domain.name}: a row's logit depends on another row's events"
        oldest_in_window = [int(lengths[r]) - WINDOW for r in rows]
        assert _changed(model, _relabel_event(batch, schema, domain.name, rows, oldest_in_window), logits)[rows].all()
        outside = [int(lengths[r]) - WINDOW - 1 for r in rows]
        assert not _changed(model, _relabel_event(batch, schema, domain.name, rows, outside), logits).any(), (
            f"{domain.name}: an event older than the newest {WINDOW} reached the logit"
        )
        checked += len(rows)
    assert checked >= len(schema.domains)


def test_short_rows_use_their_last_valid_event_not_the_padding(setup):
    schema, model, batch, logits = setup
    for domain in schema.domains:
        seq = batch.sequences[domain.name]
        lengths = seq.lengths.long()
        rows = [r for r in range(len(lengths)) if 0 < lengths[r] < seq.values.shape[2]]
        assert rows
        newest = [int(lengths[r]) - 1 for r in rows]
        changed = _changed(model, _relabel_event(batch, schema, domain.name, rows, newest), logits)
        assert changed[rows].all(), f"{domain.name}: the newest event of a short row does not reach the logit"
        padded = batch.clone()  # ids written into the padding slots (past length-1) must be ignored
        for r in rows:
            padded.sequences[domain.name].values[r, :, -1] = 1
        assert not _changed(model, padded, logits).any(), f"{domain.name}: padding slots reached the logit"


@pytest.mark.parametrize("side", ["user", "item"])
def test_every_field_token_reaches_the_target(setup, side):
    schema, model, batch, logits = setup
    fields = schema.int_group(side)
    missed = []
    for feat in fields:
        changed_batch = batch.clone()
        block = getattr(changed_batch, side)
        cols = slice(feat.offset, feat.offset + feat.dim)
        block.int_values[:, cols] = torch.where(block.int_values[:, cols] > 0, 0, 1).to(block.int_values.dtype)
        if not _changed(model, changed_batch, logits).all():
            missed.append(feat.fid)
    assert not missed, f"{side} fields {missed} do not reach the target token's logit"
