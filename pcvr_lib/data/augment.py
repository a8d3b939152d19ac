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

How: sequence transforms do not move event data. Each domain carries a small plan, `_SeqPlan`: which
source row each output row reads, which source position each output position reads ([B, L] int64), and
the new lengths. A crop shifts the position map, the feature mask compacts it, a dropout sets lengths to
0; only at the end is each domain's [B, F, L] block gathered once and zeroed past its length. One gather
instead of one or two full passes per transform: the benchmark chain (crop x2, mask, dropout) costs about
one gather (measurements in notes/data-pipeline.md).
Running one transform alone (`transform(batch, gen)`) is the same code with a plan of one step.
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


@dataclass
class _SeqPlan:
    """A sequence block to be: out[r, :, j] = base[r // views, :, source[r, j]] for j < lengths[r], else 0.

    Only the crop changes rows, always by repeating each row `views` times in place (interleaved), so the
    row map is r // views and the final gather reads the base through a stride-0 view axis instead of
    materialising the repeated rows first."""

    base: SequenceBlock
    views: int  # output rows = base rows * views
    source: torch.Tensor | None  # [B, L] int64 into base positions; None = identity
    lengths: torch.Tensor  # [B] int64

    @property
    def max_len(self) -> int:
        return self.base.max_len

    def materialize(self) -> SequenceBlock:
        base = self.base
        if self.views == 1 and self.source is None and torch.equal(self.lengths, base.lengths.long()):
            return base
        rows, features, length = base.values.shape
        inside = torch.arange(length)[None, :] < self.lengths[:, None]
        if self.source is None and self.views == 1:  # only lengths changed: zero past them
            return SequenceBlock(
                base.values * inside[:, None, :], base.timestamps * inside, self.lengths.to(base.lengths.dtype)
            )
        if self.source is None:
            self.source = torch.arange(length).expand(rows * self.views, -1)
        source = self.source.view(rows, self.views, 1, length)
        values = torch.gather(
            base.values[:, None].expand(-1, self.views, -1, -1), 3, source.expand(-1, -1, features, -1)
        ).view(rows * self.views, features, length)
        timestamps = torch.gather(base.timestamps[:, None].expand(-1, self.views, -1), 2, source[:, :, 0]).view(
            rows * self.views, length
        )
        values.mul_(inside[:, None, :])  # zero past the length (a multiply is much faster than masked_fill)
        timestamps.mul_(inside)
        return SequenceBlock(values, timestamps, self.lengths.to(base.lengths.dtype))


@dataclass
class _State:
    """A batch whose sequences are plans; non-sequence fields are concrete."""

    batch: Batch  # its `sequences` are stale while plans are pending
    plans: dict[str, _SeqPlan]

    @classmethod
    def start(cls, batch: Batch) -> _State:
        plans = {k: _SeqPlan(s, 1, None, s.lengths.long()) for k, s in batch.sequences.items()}
        return cls(batch, plans)

    def finish(self) -> Batch:
        return replace(self.batch, sequences={k: p.materialize() for k, p in self.plans.items()})


class _Transform:
    def apply(self, state: _State, gen: torch.Generator) -> None:
        raise NotImplementedError

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        state = _State.start(batch)
        self.apply(state, gen)
        return state.finish()


@dataclass(frozen=True)
class SequenceCrop(_Transform):
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

    def apply(self, state: _State, gen: torch.Generator) -> None:
        if self.views_per_row > 1:
            views = self.views_per_row
            rows = torch.arange(state.batch.batch_size).repeat_interleave(views)
            stale = state.batch.sequences
            state.batch = replace(state.batch, sequences={}).map(lambda t: t.index_select(0, rows))
            state.batch = replace(state.batch, sequences=stale)
            for plan in state.plans.values():
                plan.views *= views
                if plan.source is not None:
                    plan.source = plan.source.index_select(0, rows)
                plan.lengths = plan.lengths.index_select(0, rows)
        if self.mode == "tail":  # w = len, start = 0: the window is the whole sequence
            return
        for plan in state.plans.values():
            self._crop(plan, gen)

    def _crop(self, plan: _SeqPlan, gen: torch.Generator) -> None:
        lengths = plan.lengths
        rows, length = lengths.shape[0], plan.max_len
        low = lengths.clamp(max=self.min_len)
        width = low + (torch.rand(rows, generator=gen) * (lengths - low + 1)).long()
        width = torch.minimum(width, lengths)  # guards rand() == 1.0 rounding
        if self.mode == "random_tail":
            start = lengths - width
        else:  # rolling
            start = (torch.rand(rows, generator=gen) * (lengths - width + 1)).long()
            start = torch.minimum(start, lengths - width)
        shifted = (start[:, None] + torch.arange(length)[None, :]).clamp_(max=length - 1)
        plan.source = shifted if plan.source is None else torch.gather(plan.source, 1, shifted)
        plan.lengths = width


def _mask_ints(block: FeatureBlock, drop: torch.Tensor) -> FeatureBlock:
    return replace(block, int_values=block.int_values.masked_fill(drop, 0), int_missing=block.int_missing | drop)


@dataclass(frozen=True)
class FeatureMask(_Transform):
    p: float

    def __post_init__(self):
        _check_p("mask", self.p)

    def apply(self, state: _State, gen: torch.Generator) -> None:
        if self.p == 0.0:
            return
        batch = state.batch
        user = _mask_ints(batch.user, torch.rand(batch.user.int_values.shape, generator=gen) < self.p)
        item = _mask_ints(batch.item, torch.rand(batch.item.int_values.shape, generator=gen) < self.p)
        state.batch = replace(batch, user=user, item=item)
        for plan in state.plans.values():
            rows, length = plan.lengths.shape[0], plan.max_len
            valid = torch.arange(length)[None, :] < plan.lengths[:, None]
            keep = valid & ~(torch.rand(rows, length, generator=gen) < self.p)
            # compaction: kept position j goes to slot (kept positions before j); the rest to a spare slot
            slot = torch.where(keep, keep.cumsum(1) - 1, length)
            order = torch.zeros(rows, length + 1, dtype=torch.int64)
            order.scatter_(1, slot, torch.arange(length).expand(rows, -1))
            order = order[:, :length]
            plan.source = order if plan.source is None else torch.gather(plan.source, 1, order)
            plan.lengths = keep.sum(1)


@dataclass(frozen=True)
class DomainDropout(_Transform):
    p: float

    def __post_init__(self):
        _check_p("domain_dropout", self.p)

    def apply(self, state: _State, gen: torch.Generator) -> None:
        if self.p == 0.0:
            return
        for plan in state.plans.values():
            drop = torch.rand(plan.lengths.shape[0], generator=gen) < self.p
            plan.lengths = plan.lengths.masked_fill(drop, 0)


@dataclass(frozen=True)
class SparseDropout(_Transform):
    p: float

    def __post_init__(self):
        _check_p("sparse_dropout", self.p)

    def apply(self, state: _State, gen: torch.Generator) -> None:
        if self.p == 0.0:
            return
        batch = state.batch
        drop = (torch.rand(batch.batch_size, generator=gen) < self.p)[:, None]
        state.batch = replace(batch, user=_mask_ints(batch.user, drop), item=_mask_ints(batch.item, drop))


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
        if not self.transforms:
            return batch
        state = _State.start(batch)
        for transform in self.transforms:
            transform.apply(state, gen)
        return state.finish()

    def describe(self) -> list[dict]:
        return [{"type": k, **vars(t)} for t in self.transforms for k, c in TRANSFORMS.items() if type(t) is c]
