"""Training-time augmentations of converted batches (data.md section 5).

Each transform is a small frozen config; `Augmenter` runs them in config order, drawing every random
number from one `torch.Generator` so the same seed gives the same batch. Transforms are functional: they
build new tensors and never write into their input, so a batch handed out by the cache (or shared with a
caller) is never changed. Everything is vectorised over the batch with torch ops.

- SequenceCrop(views_per_row, mode, min_len): each row is repeated `views_per_row` times (interleaved:
  row0, row0, row1, row1, ...; labels, user ids and row indices repeat with it). Per domain and view a
  window of w events is kept: w uniform in [min(min_len, len), len] for `random_tail` and `rolling`,
  w = len for `tail`. The window ends at the newest event (start = len - w) for `random_tail` and `tail`,
  or starts uniformly in [0, len - w] for `rolling`. The window is moved to the front (events stay oldest
  first, left-aligned) and everything past w is zero.
- FeatureMask(p): each user/item int slot is zeroed with probability p and marked missing; each valid
  sequence event is dropped with probability p (all its features and its timestamp), and the surviving
  events are compacted to the front in their order.
- DomainDropout(p): per domain and row, with probability p the whole sequence is zeroed (length 0).
- SparseDropout(p): per row, with probability p all user and item int values are zeroed and marked missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock

CROP_MODES = ("random_tail", "rolling", "tail")


def _check_p(name: str, p) -> float:
    if not isinstance(p, int | float) or isinstance(p, bool) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name}: p must be a probability in [0, 1], got {p!r}")
    return float(p)


@dataclass(frozen=True)
class SequenceCrop:
    views_per_row: int = 1
    mode: str = "random_tail"
    min_len: int = 1

    def __post_init__(self):
        if not isinstance(self.views_per_row, int) or self.views_per_row < 1:
            raise ValueError(f"crop: views_per_row must be an integer >= 1, got {self.views_per_row!r}")
        if self.mode not in CROP_MODES:
            raise ValueError(f"crop: mode must be one of {', '.join(CROP_MODES)}, got {self.mode!r}")
        if not isinstance(self.min_len, int) or self.min_len < 0:
            raise ValueError(f"crop: min_len must be an integer >= 0, got {self.min_len!r}")

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        if self.views_per_row > 1:
            rows = torch.arange(batch.batch_size).repeat_interleave(self.views_per_row)
            batch = batch.map(lambda t: t.index_select(0, rows))
        if self.mode == "tail":  # w = len, start = 0: the window is the whole sequence
            return batch
        return replace(batch, sequences={k: self._crop(s, gen) for k, s in batch.sequences.items()})

    def _crop(self, seq: SequenceBlock, gen: torch.Generator) -> SequenceBlock:
        rows, length = seq.lengths.shape[0], seq.max_len
        lengths = seq.lengths.long()
        low = lengths.clamp(max=self.min_len)
        width = low + (torch.rand(rows, generator=gen) * (lengths - low + 1)).long()
        width = torch.minimum(width, lengths)  # guards rand() == 1.0 rounding
        if self.mode == "random_tail":
            start = lengths - width
        else:  # rolling
            start = (torch.rand(rows, generator=gen) * (lengths - width + 1)).long()
            start = torch.minimum(start, lengths - width)
        positions = torch.arange(length)
        source = (start[:, None] + positions[None, :]).clamp_(max=length - 1)
        keep = positions[None, :] < width[:, None]
        values = torch.gather(seq.values, 2, source[:, None, :].expand(-1, seq.values.shape[1], -1))
        values.mul_(keep[:, None, :])  # zero past the window (a multiply is much faster than masked_fill)
        timestamps = torch.gather(seq.timestamps, 1, source).mul_(keep)
        return SequenceBlock(values, timestamps, width.to(seq.lengths.dtype))


def _mask_ints(block: FeatureBlock, drop: torch.Tensor) -> FeatureBlock:
    return replace(block, int_values=block.int_values.masked_fill(drop, 0), int_missing=block.int_missing | drop)


@dataclass(frozen=True)
class FeatureMask:
    p: float

    def __post_init__(self):
        _check_p("mask", self.p)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        if self.p == 0.0:
            return batch
        user = _mask_ints(batch.user, torch.rand(batch.user.int_values.shape, generator=gen) < self.p)
        item = _mask_ints(batch.item, torch.rand(batch.item.int_values.shape, generator=gen) < self.p)
        sequences = {k: self._drop_events(s, gen) for k, s in batch.sequences.items()}
        return replace(batch, user=user, item=item, sequences=sequences)

    def _drop_events(self, seq: SequenceBlock, gen: torch.Generator) -> SequenceBlock:
        rows, length = seq.lengths.shape[0], seq.max_len
        valid = seq.valid_mask()
        keep = valid & ~(torch.rand(rows, length, generator=gen) < self.p)
        # Compaction by gathering: a stable sort puts the kept positions first, in their order; every
        # output position at or past the new length is zeroed.
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
        lengths = keep.sum(1)
        inside = torch.arange(length)[None, :] < lengths[:, None]
        values = torch.gather(seq.values, 2, order[:, None, :].expand(-1, seq.values.shape[1], -1))
        values.mul_(inside[:, None, :])
        timestamps = torch.gather(seq.timestamps, 1, order).mul_(inside)
        return SequenceBlock(values, timestamps, lengths.to(seq.lengths.dtype))


@dataclass(frozen=True)
class DomainDropout:
    p: float

    def __post_init__(self):
        _check_p("domain_dropout", self.p)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        if self.p == 0.0:
            return batch
        sequences = {}
        for name, seq in batch.sequences.items():
            drop = torch.rand(seq.lengths.shape[0], generator=gen) < self.p
            keep = ~drop
            sequences[name] = SequenceBlock(
                seq.values * keep[:, None, None], seq.timestamps * keep[:, None], seq.lengths * keep
            )
        return replace(batch, sequences=sequences)


@dataclass(frozen=True)
class SparseDropout:
    p: float

    def __post_init__(self):
        _check_p("sparse_dropout", self.p)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        if self.p == 0.0:
            return batch
        drop = (torch.rand(batch.batch_size, generator=gen) < self.p)[:, None]
        return replace(batch, user=_mask_ints(batch.user, drop), item=_mask_ints(batch.item, drop))


TRANSFORMS = {
    "crop": SequenceCrop,
    "mask": FeatureMask,
    "domain_dropout": DomainDropout,
    "sparse_dropout": SparseDropout,
}
Transform = SequenceCrop | FeatureMask | DomainDropout | SparseDropout

# The reference's benchmark augmentations: crop 2 views random_tail min_len 8, mask 0.05, domain dropout 0.05.
BENCHMARK_AUGMENTATIONS: tuple[Transform, ...] = (
    SequenceCrop(views_per_row=2, mode="random_tail", min_len=8),
    FeatureMask(0.05),
    DomainDropout(0.05),
)


def parse_transform(spec: Transform | Mapping) -> Transform:
    """A transform from a config object or a dict like {"type": "crop", "views_per_row": 2, ...}."""
    if isinstance(spec, tuple(TRANSFORMS.values())):
        return spec
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(f"augmentation must be a transform or a dict with a 'type' key, got {spec!r}")
    kind = spec["type"]
    if kind not in TRANSFORMS:
        raise ValueError(f"unknown augmentation type {kind!r}; allowed: {', '.join(TRANSFORMS)}")
    params = {k: v for k, v in spec.items() if k != "type"}
    try:
        return TRANSFORMS[kind](**params)
    except TypeError as exc:
        raise ValueError(f"augmentation {kind!r}: bad parameters {sorted(params)} ({exc})") from exc


class Augmenter:
    """Runs transforms in config order; `generator` (or the augmenter's own seeded one) drives all draws."""

    def __init__(self, transforms: Sequence[Transform | Mapping] = (), seed: int = 0):
        self.transforms = tuple(parse_transform(t) for t in transforms)
        self._generator = torch.Generator().manual_seed(seed)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, batch: Batch, generator: torch.Generator | None = None) -> Batch:
        gen = generator if generator is not None else self._generator
        for transform in self.transforms:
            batch = transform(batch, gen)
        return batch

    def describe(self) -> list[dict]:
        return [{"type": k, **vars(t)} for t in self.transforms for k, c in TRANSFORMS.items() if type(t) is c]
