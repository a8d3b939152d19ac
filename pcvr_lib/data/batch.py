"""The batch carrier: what the converter produces and what models, caches and augmentations take.

Layout (B rows; widths from the compiled schema, see pcvr_lib.schema):

- `user` / `item`: FeatureBlock
    int_values    [B, D]  int32   ids; 0 = padding / missing / clipped out-of-vocab
    int_missing   [B, D]  bool
    dense_values  [B, Dd] float32 non-finite and padding -> 0.0
    dense_missing [B, Dd] bool
- `sequences`: {domain name (sorted): SequenceBlock}
    values     [B, F, L] int32  side features (schema order, timestamp feature excluded)
    timestamps [B, L]    int64  raw event timestamps
    lengths    [B]       int32  valid events; positions >= length are zero
  Events are oldest first and left-aligned: position length-1 is the newest kept event.
- `request_timestamp` [B] int64, `label` [B] float32 (1.0 for label_type == 2),
  `user_id` [B] int64, `row_index` [B] int64 (row position in the source file: a stable sample key).

Ids are int32 because every vocabulary of the schema fits (largest 278,677,640 < 2**31); that halves the
bytes of the biggest tensors compared with int64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch


def _map_tensors(obj, fn: Callable, leaf: type = torch.Tensor):
    """Apply fn to every tensor field of a dataclass (recursing into nested dataclasses and dicts); `leaf`:
    what counts as a tensor field (the loader's workers send batches whose fields are slot descriptors)."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, leaf):
            changes[f.name] = fn(value)
        elif isinstance(value, dict):
            changes[f.name] = {k: _map_tensors(v, fn, leaf) for k, v in value.items()}
        elif hasattr(value, "__dataclass_fields__"):
            changes[f.name] = _map_tensors(value, fn, leaf)
    return replace(obj, **changes)


def _tensors(obj):
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from _tensors(v)
        elif hasattr(value, "__dataclass_fields__"):
            yield from _tensors(value)


class _TensorTree:
    def map(self, fn: Callable, leaf: type = torch.Tensor):
        return _map_tensors(self, fn, leaf)

    def tensors(self):
        return list(_tensors(self))

    def clone(self):
        return self.map(torch.clone)

    def to(self, device, non_blocking: bool = False):
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        return self.map(lambda t: t.pin_memory())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class FeatureBlock(_TensorTree):
    int_values: torch.Tensor
    int_missing: torch.Tensor
    dense_values: torch.Tensor
    dense_missing: torch.Tensor


@dataclass
class SequenceBlock(_TensorTree):
    values: torch.Tensor
    timestamps: torch.Tensor
    lengths: torch.Tensor

    @property
    def max_len(self) -> int:
        return self.values.shape[-1]

    def valid_mask(self) -> torch.Tensor:
        """[B, L] bool: True at positions < length."""
        positions = torch.arange(self.max_len, device=self.lengths.device)
        return positions[None, :] < self.lengths[:, None]


@dataclass
class Batch(_TensorTree):
    user: FeatureBlock
    item: FeatureBlock
    sequences: dict[str, SequenceBlock]
    request_timestamp: torch.Tensor
    label: torch.Tensor
    user_id: torch.Tensor
    row_index: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.label.shape[0])

    @property
    def device(self) -> torch.device:
        return self.label.device

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows at `rows` (int index or bool mask over the batch), every tensor indexed on dim 0."""
        return self.map(lambda t: t[rows])
