"""Per-model behaviour beyond the contract: empty histories, training mode, non-finite losses skipped and
counted, and the model-specific pieces (symbiosis's event selector, dualq's order-free merged sequence)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib.data.batch import SequenceBlock
from pcvr_lib.models import build_model, model_names
from pcvr_lib.models.symbiosis import select_events
from pcvr_lib.optim import build_optimizer_set, train_step
from pcvr_lib.workloads.models import demo_schema, random_batch

MODELS = model_names()
TINY = {"vocab_cap": 64}


@pytest.fixture(scope="module")
def schema():
    return demo_schema(max_len=10)


@pytest.fixture(scope="module")
def batch(schema):
    return random_batch(schema, batch=4, seed=7)


def _model(name, schema, seed=0):
    torch.manual_seed(seed)
    return build_model(name, schema, TINY).eval()


def _without_history(batch, fill: int = 0):
    """Every row of every domain empty; `fill` written into the (all padding) values and timestamps."""
    empty = batch.clone()
    for name, seq in empty.sequences.items():
        empty.sequences[name] = SequenceBlock(values=torch.full_like(seq.values, fill),
                                              timestamps=torch.full_like(seq.timestamps, fill),
                                              lengths=torch.zeros_like(seq.lengths))
    return empty


@pytest.mark.parametrize("name", MODELS)
def test_empty_histories_are_finite_and_ignore_padding(name, schema, batch):
    model = _model(name, schema)
    with torch.no_grad():
        clean = model(_without_history(batch))
        noisy = model(_without_history(batch, fill=5))
    assert clean.shape == (batch.batch_size, 1) and torch.isfinite(clean).all()
    torch.testing.assert_close(noisy, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_training_mode_forward_backward_finite(name, schema, batch):
    """The training-only paths (dropout, symbiosis's risk-token dropout, dualq's id dropout)."""
    model = _model(name, schema).train()
    logits = model(batch)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    for pname, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            assert torch.isfinite(g).all(), pname


@pytest.mark.parametrize("name", MODELS)
def test_non_finite_loss_is_skipped_and_counted(name, schema, batch):
    model = _model(name, schema).train()
    optimizers = build_optimizer_set(model.dense_parameters(), model.sparse_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    skipped = 0
    for scale in (float("nan"), float("inf")):
        loss = F.binary_cross_entropy_with_logits(model(batch)[:, 0], batch.label) * scale
        skipped += int(train_step(loss, optimizers)["skipped"])
    assert skipped == 2
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    info = train_step(F.binary_cross_entropy_with_logits(model(batch)[:, 0], batch.label), optimizers)
    assert not info["skipped"] and math.isfinite(info["loss"])
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))


def _select_loop(values, timestamps, length, recent, memory):
    """The selector written out per row: recent slots, then one argmax per memory bucket."""
    prefix = max(length - recent, 0)
    chosen = []
    for m in range(memory):
        lo, hi = (m * prefix) // memory, ((m + 1) * prefix) // memory
        best, best_score = None, -math.inf
        for j in range(lo, hi):
            nonzero = int((values[:, j] != 0).sum()) / values.shape[0]
            dup = j > 0 and bool((values[:, j] == values[:, j - 1]).all())
            score = nonzero + 0.3 * float(timestamps[j] > 0) + 0.2 * j / max(prefix, 1) - 0.5 * dup
            if score > best_score:
                best, best_score = j, score
        chosen.append(best)
    chosen += [length - recent + r if length - recent + r >= 0 else None for r in range(recent)]
    return chosen


def test_symbiosis_selector_matches_a_loop():
    gen = torch.Generator().manual_seed(1)
    b, f, length = 12, 3, 20
    values = torch.randint(0, 3, (b, f, length), generator=gen, dtype=torch.int32)
    values[:, :, 5] = values[:, :, 4]  # duplicates of the previous event
    lengths = torch.tensor([0, 1, 2, 3, 5, 8, 9, 12, 15, 17, 19, 20], dtype=torch.int32)
    valid = torch.arange(length)[None] < lengths[:, None].long()
    timestamps = torch.randint(0, 2, (b, length), generator=gen) * 1000 * valid
    seq = SequenceBlock(values=values * valid[:, None].to(torch.int32), timestamps=timestamps, lengths=lengths)
    for recent, memory in ((4, 3), (2, 5), (8, 4)):
        positions, ok = select_events(seq, recent, memory)
        for row in range(b):
            expect = _select_loop(seq.values[row], timestamps[row], int(lengths[row]), recent, memory)
            got = [int(p) if v else None for p, v in zip(positions[row], ok[row], strict=True)]
            assert got == expect, (recent, memory, row)


def test_dualq_merged_sequence_order_does_not_change_the_output(schema, batch, monkeypatch):
    """The reference sorts the merged sequence by age; nothing after the merge depends on the order, so
    ours does not sort: permuting the valid merged tokens (with their ages and gaps) changes nothing."""
    model = _model("dualq", schema)
    with torch.no_grad():
        expect = model(batch)
        seq, lengths, age, gap, stats = model._sequence(batch)
    gen = torch.Generator().manual_seed(0)
    order = torch.arange(seq.shape[1]).repeat(seq.shape[0], 1)
    for row, n in enumerate(lengths.tolist()):
        order[row, :n] = torch.randperm(n, generator=gen)
    assert not torch.equal(order, torch.arange(seq.shape[1]).expand_as(order))
    permuted = (seq.gather(1, order[..., None].expand_as(seq)), lengths, age.gather(1, order), gap.gather(1, order),
                stats)
    monkeypatch.setattr(model, "_sequence", lambda _batch: permuted)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expect, rtol=1e-5, atol=1e-5)
