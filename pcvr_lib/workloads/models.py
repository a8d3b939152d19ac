"""The models' workload: the demo schema, random Batches built from a schema, and the batch size and table
cap of the GPU model-level measurements (smoke tests, model benchmark, kernel-variant recording, profiling)."""

from __future__ import annotations

from pathlib import Path

import torch

from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock
from pcvr_lib.schema import load_schema

ROOT = Path(__file__).resolve().parents[2]
DEMO_SCHEMA = ROOT / "fixtures" / "sample_1000_raw.schema.json"
# the GPU model-level measurements (perf_tests/test_models.py, tools/profile_models.py): batch rows and the
# cap on table rows per feature (a step touches only the batch's rows; full tables take minutes to build)
GPU_BATCH = 256
GPU_TABLE_CAP = 8192


def demo_schema(max_len: int = 32):
    """The demo schema with short sequences so the CPU tests stay fast."""
    schema = load_schema(DEMO_SCHEMA)
    return schema.with_max_lens({d.name: max_len for d in schema.domains})


def _ids(gen: torch.Generator, vocab: torch.Tensor, shape: tuple[int, ...], p_zero: float) -> torch.Tensor:
    """Ids uniform in [1, vocab) per position (vocab broadcast on the last dims), p_zero of them 0."""
    vocab = vocab.clamp(min=2).double()
    ids = (torch.rand(shape, generator=gen, dtype=torch.float64) * (vocab - 1)).long() + 1
    ids = torch.where(torch.rand(shape, generator=gen) < p_zero, torch.zeros_like(ids), ids)
    return ids.to(torch.int32)


def _block(gen, schema, side: str, batch: int, p_zero: float) -> FeatureBlock:
    vocab = torch.as_tensor(schema.int_vocab(side))
    ids = _ids(gen, vocab, (batch, len(vocab)), p_zero)
    width = schema.dense_width(side)
    dense = torch.randn(batch, width, generator=gen)
    dense_missing = torch.rand(batch, width, generator=gen) < 0.1
    return FeatureBlock(ids, ids == 0, torch.where(dense_missing, 0.0, dense), dense_missing)


def random_batch(schema, batch: int = 8, seed: int = 0, p_zero: float = 0.2, empty_rows: int = 1) -> Batch:
    """A Batch with the schema's layout: random ids within each vocabulary, random dense values,
    sequences of random lengths (the first `empty_rows` rows have empty sequences), timestamps before
    the request time, labels alternating so both classes are present."""
    gen = torch.Generator().manual_seed(seed)
    request = torch.full((batch,), 1_700_000_000, dtype=torch.int64)
    sequences = {}
    for domain in schema.domains:
        length = domain.max_len
        lengths = torch.randint(0, length + 1, (batch,), generator=gen, dtype=torch.int32)
        lengths[:empty_rows] = 0
        lengths[empty_rows:empty_rows + 1] = length
        vocab = torch.as_tensor(domain.side_vocab)[:, None]
        values = _ids(gen, vocab, (batch, len(vocab), length), p_zero)
        valid = torch.arange(length)[None] < lengths[:, None].long()
        # oldest first: ages decrease along the list
        ages = torch.sort(torch.randint(1, 10_000_000, (batch, length), generator=gen), dim=1, descending=True).values
        sequences[domain.name] = SequenceBlock(
            values=values * valid[:, None, :].to(torch.int32),
            timestamps=(request[:, None] - ages) * valid,
            lengths=lengths,
        )
    return Batch(
        user=_block(gen, schema, "user", batch, p_zero),
        item=_block(gen, schema, "item", batch, p_zero),
        sequences=sequences,
        request_timestamp=request,
        label=(torch.arange(batch) % 2).float(),
        user_id=torch.arange(batch, dtype=torch.int64) // 2,
        row_index=torch.arange(batch, dtype=torch.int64),
    )
