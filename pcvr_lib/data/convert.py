"""Arrow RecordBatch / Table -> Batch (data.md section 2), vectorised with Arrow offsets and numpy.

Semantics (see notes/data-convert.md for the decisions and the reference quirks fixed):
- Columns are selected by name; any column order and any batch size (0 rows gives an empty batch).
- A null list is empty, always (also in-memory batches whose null rows span values). A null element inside
  a list, a null `timestamp` or a wrong column type is an error naming the column.
- Int features: width 1: null or <= 0 -> 0 and missing. Width > 1: the first `dim` elements (these lists are
  not time-ordered), padding and values <= 0 -> 0 and missing. Values >= vocab (vocab > 0) are out of
  vocabulary: counted in `stats`, then clipped to 0 and missing (`clip_oov=True`) or an error naming the
  column and value (`clip_oov=False`). vocab 0 zeroes the column (all missing). So int_missing is exactly
  int_values == 0.
- Dense: the first `dim` elements as float32; padding and non-finite -> 0.0 and missing.
- Sequences (lists are chronological, newest last). Non-strict: every column keeps its LAST
  min(len, L) elements, left-aligned (oldest kept first); length = max over side columns (the timestamp
  column's own when a domain has no side feature). Strict (`strict_time_filter=True`): the valid events
  are those with 0 < ts < request timestamp; the last L valid ones are kept, in order, for every column
  (a side column shorter than the timestamp column gives 0 at the positions it lacks); length = the number
  kept. Side tokens <= 0 -> 0, out-of-vocab counted and clipped (or raised), vocab 0 zeroes the feature.
  Timestamps are copied raw.
- Labels: label_type == 2 -> 1.0, else (null included) 0.0; all zero when not training.
- user_id: a null user_id becomes -1 and is counted in stats["null_user_id"].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock
from pcvr_lib.data.parquet import DataError, check_arrow_schema, expected_columns
from pcvr_lib.schema import Schema

NULL_USER_ID = -1


class OutOfVocabError(DataError):
    """An id >= vocab_size met with clip_oov=False."""


def _column(data: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    """One column as a single Arrow array (table chunks are concatenated)."""
    col = data.column(name)
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return col.chunk(0)
        if col.num_chunks == 0:
            return pa.array([], type=col.type)
        return pa.concat_arrays(col.chunks)
    return col


def _buffer(array: pa.Array, dtype: np.dtype) -> np.ndarray:
    """The values buffer of a primitive array as numpy (zero copy; null slots hold whatever is there)."""
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=dtype)
    buf = array.buffers()[1]
    return np.frombuffer(buf, dtype=dtype, count=array.offset + n)[array.offset :]


def _nulls(array: pa.Array) -> np.ndarray | None:
    """Bool mask of null slots, or None when there are none."""
    if array.null_count == 0:
        return None
    return array.is_null().to_numpy(zero_copy_only=False)


@dataclass
class _Lists:
    """A list column as numpy: absolute start offsets into `values`, lengths (null rows 0), flat values."""

    starts: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    values: np.ndarray


def _lists(array: pa.Array, name: str, dtype: np.dtype) -> _Lists:
    offsets = array.offsets.to_numpy().astype(np.int64, copy=False)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    null = _nulls(array)
    if null is not None:
        lengths = np.where(null, 0, lengths)
    child = array.values
    if child.null_count:
        # a null element is an error only where a (non-null) row uses it
        child_null = child.is_null().to_numpy(zero_copy_only=False)
        used = np.zeros(len(child_null) + 1, dtype=np.int64)
        np.add.at(used, starts, 1)
        np.add.at(used, starts + lengths, -1)
        inside = np.cumsum(used[:-1]) > 0
        bad = np.flatnonzero(child_null & inside)
        if len(bad):
            row = int(np.searchsorted(starts + lengths, bad[0], side="right"))
            raise DataError(
                f"column {name!r}: {len(bad)} null element(s) inside lists (first in row {row}); "
                "null elements are not allowed (a whole list may be null)"
            )
    return _Lists(starts, lengths, _buffer(child, dtype))


def _take(values: np.ndarray, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """values[index] with out-of-range indices clipped (they are masked afterwards); empty-safe."""
    if len(values) == 0:
        if out is None:
            return np.zeros(index.shape, dtype=values.dtype)
        out[...] = 0
        return out
    return np.take(values, index, mode="clip", out=out)


class Converter:
    """Converts Arrow record batches / tables of PCVR data into `Batch`es for one schema.

    `stats` counts rows, batches, out-of-vocab values (total, per group, per column) and null user ids;
    `strict_time_filter`, `training` and `clip_oov` are attributes and are repeated in `stats`.
    """

    def __init__(
        self, schema: Schema, *, training: bool = True, strict_time_filter: bool = False, clip_oov: bool = True
    ) -> None:
        self.schema = schema
        self.training = bool(training)
        self.strict_time_filter = bool(strict_time_filter)
        self.clip_oov = bool(clip_oov)
        self.expected = expected_columns(schema)
        self._checked: pa.Schema | None = None
        self.reset_stats()

    # ------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        groups = ["user_int", "item_int"] + [d.name for d in self.schema.domains]
        self.stats = {
            "rows": 0,
            "batches": 0,
            "oob_total": 0,
            "oob_per_group": dict.fromkeys(groups, 0),
            "oob_per_feature": {},
            "null_user_id": 0,
            "strict_time_filter": self.strict_time_filter,
            "training": self.training,
            "clip_oov": self.clip_oov,
        }

    def _count_oob(self, group: str, column: str, count: int) -> None:
        if count:
            self.stats["oob_total"] += count
            self.stats["oob_per_group"][group] += count
            per = self.stats["oob_per_feature"]
            per[column] = per.get(column, 0) + count

    def _raise_oob(self, column: str, values: np.ndarray, bad: np.ndarray, vocab: int) -> None:
        where = np.argwhere(bad)[0]
        raise OutOfVocabError(
            f"column {column!r}: value {int(values[tuple(where)])} (row {int(where[0])}) is out of vocabulary "
            f"(vocab_size {vocab}); {int(bad.sum())} such value(s) in this batch (clip_oov=False)"
        )

    # ------------------------------------------------------------------------------------------
    def __call__(self, data: pa.RecordBatch | pa.Table, row_offset: int = 0) -> Batch:
        if not isinstance(data, pa.RecordBatch | pa.Table):
            raise TypeError(f"Converter takes a pyarrow RecordBatch or Table, got {type(data).__name__}")
        if self._checked is None or not data.schema.equals(self._checked):
            check_arrow_schema(data.schema, self.schema)
            self._checked = data.schema
        rows = data.num_rows
        cols = {name: _column(data, name) for name in self.expected}

        ts_arr = cols["timestamp"]
        if ts_arr.null_count:
            row = int(np.flatnonzero(ts_arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"column 'timestamp': {ts_arr.null_count} null request timestamp(s) (first in row {row}); "
                "every row needs its request timestamp"
            )
        request_ts = _buffer(ts_arr, np.int64).copy()

        if self.training:
            lt = cols["label_type"]
            label = (_buffer(lt, np.int32) == 2).astype(np.float32)
            null = _nulls(lt)
            if null is not None:
                label[null] = 0.0
        else:
            label = np.zeros(rows, dtype=np.float32)

        uid_arr = cols["user_id"]
        user_id = _buffer(uid_arr, np.int64).copy()
        null = _nulls(uid_arr)
        if null is not None:
            user_id[null] = NULL_USER_ID
            self.stats["null_user_id"] += int(null.sum())

        user = self._features("user", cols, rows)
        item = self._features("item", cols, rows)
        sequences = {d.name: self._domain(d, cols, request_ts, rows) for d in self.schema.domains}

        self.stats["rows"] += rows
        self.stats["batches"] += 1
        return Batch(
            user=user,
            item=item,
            sequences=sequences,
            request_timestamp=torch.from_numpy(request_ts),
            label=torch.from_numpy(label),
            user_id=torch.from_numpy(user_id),
            row_index=torch.arange(row_offset, row_offset + rows, dtype=torch.int64),
        )

    # ------------------------------------------------------------------------------------------
    def _features(self, side: str, cols: dict[str, pa.Array], rows: int) -> FeatureBlock:
        schema = self.schema
        group = f"{side}_int"
        width = schema.int_width(side)
        values = np.zeros((rows, width), dtype=np.int32)
        missing = np.ones((rows, width), dtype=bool)

        for feat in schema.int_group(side):
            arr = cols[feat.column]
            if feat.dim == 1:
                v = _buffer(arr, np.int64)
                ok = v > 0
                null = _nulls(arr)
                if null is not None:
                    ok &= ~null
                valid = None
            else:
                lists = _lists(arr, feat.column, np.int64)
                pos = np.arange(feat.dim)
                valid = pos < np.minimum(lists.lengths, feat.dim)[:, None]
                v = _take(lists.values, lists.starts[:, None] + pos)
                ok = valid & (v > 0)
            if feat.vocab_size == 0:
                continue  # zeroed column: values 0, all missing
            oob = ok & (v >= feat.vocab_size)
            n_oob = int(np.count_nonzero(oob))
            if n_oob:
                if not self.clip_oov:
                    self._raise_oob(feat.column, v.reshape(rows, -1), oob.reshape(rows, -1), feat.vocab_size)
                self._count_oob(group, feat.column, n_oob)
                ok &= ~oob
            target = slice(feat.offset, feat.offset + feat.dim)
            if feat.dim == 1:
                values[:, feat.offset] = np.where(ok, v, 0)
                missing[:, feat.offset] = ~ok
            else:
                values[:, target] = np.where(ok, v, 0)
                missing[:, target] = ~ok

        dwidth = schema.dense_width(side)
        dense = np.zeros((rows, dwidth), dtype=np.float32)
        dmissing = np.ones((rows, dwidth), dtype=bool)
        for feat in schema.dense_group(side):
            lists = _lists(cols[feat.column], feat.column, np.float32)
            pos = np.arange(feat.dim)
            valid = pos < np.minimum(lists.lengths, feat.dim)[:, None]
            v = _take(lists.values, lists.starts[:, None] + pos)
            ok = valid & np.isfinite(v)
            target = slice(feat.offset, feat.offset + feat.dim)
            dense[:, target] = np.where(ok, v, 0.0)
            dmissing[:, target] = ~ok

        return FeatureBlock(
            int_values=torch.from_numpy(values),
            int_missing=torch.from_numpy(missing),
            dense_values=torch.from_numpy(dense),
            dense_missing=torch.from_numpy(dmissing),
        )

    # ------------------------------------------------------------------------------------------
    def _strict_plan(self, ts: _Lists, request_ts: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
        """Element index [B, L] (absolute into the timestamp values) of the last L valid events, and the
        number kept per row. Valid: 0 < ts < request timestamp of the row."""
        rows = len(ts.lengths)
        index = np.zeros((rows, L), dtype=np.int64)
        total = int(ts.lengths.sum())
        if total == 0:
            return index, np.zeros(rows, dtype=np.int64)
        row_of = np.repeat(np.arange(rows), ts.lengths)
        # absolute element positions of every (non-null) row's events
        first = np.cumsum(ts.lengths) - ts.lengths
        elem = np.arange(total) - np.repeat(first, ts.lengths) + np.repeat(ts.starts, ts.lengths)
        t = ts.values[elem]
        valid = (t > 0) & (t < request_ts[row_of])
        cum = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(valid, out=cum[1:])  # cum[i] = valid events among the first i
        ends = first + ts.lengths
        row_total = cum[ends] - cum[first]
        after = cum[np.repeat(ends, ts.lengths)] - cum[1:]  # valid events after this one in its row
        keep = valid & (after < L)
        kept = np.minimum(row_total, L)
        pos = kept[row_of] - 1 - after
        index[row_of[keep], pos[keep]] = elem[keep]
        return index, kept

    def _domain(self, domain, cols: dict[str, pa.Array], request_ts: np.ndarray, rows: int) -> SequenceBlock:
        L = domain.max_len
        side = domain.side_features
        positions = np.arange(L)
        values = np.zeros((rows, len(side), L), dtype=np.int32)
        ts = _lists(cols[domain.ts_feature.column], domain.ts_feature.column, np.int64)

        if self.strict_time_filter:
            ts_index, kept = self._strict_plan(ts, request_ts, L)
            ts_valid = positions < kept[:, None]
            lengths = kept
            rel = ts_index - ts.starts[:, None]  # event number within the row
        else:
            k = np.minimum(ts.lengths, L)
            ts_index = (ts.starts + ts.lengths - k)[:, None] + positions
            ts_valid = positions < k[:, None]
            lengths = np.zeros(rows, dtype=np.int64) if side else k

        timestamps = np.where(ts_valid, _take(ts.values, ts_index), 0)

        for f, feat in enumerate(side):
            lists = _lists(cols[feat.column], feat.column, np.int64)
            if self.strict_time_filter:
                index = lists.starts[:, None] + rel
                valid = ts_valid & (rel < lists.lengths[:, None])
            else:
                k = np.minimum(lists.lengths, L)
                index = (lists.starts + lists.lengths - k)[:, None] + positions
                valid = positions < k[:, None]
                lengths = np.maximum(lengths, k)
            v = _take(lists.values, index)
            if feat.vocab_size == 0:
                continue
            ok = valid & (v > 0)
            oob = ok & (v >= feat.vocab_size)
            n_oob = int(np.count_nonzero(oob))
            if n_oob:
                if not self.clip_oov:
                    self._raise_oob(feat.column, v, oob, feat.vocab_size)
                self._count_oob(domain.name, feat.column, n_oob)
                ok &= ~oob
            values[:, f, :] = np.where(ok, v, 0)

        return SequenceBlock(
            values=torch.from_numpy(values),
            timestamps=torch.from_numpy(timestamps.astype(np.int64, copy=False)),
            lengths=torch.from_numpy(lengths.astype(np.int32)),
        )
