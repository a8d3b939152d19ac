"""The converter's numpy backend: vectorised with Arrow offsets, sliding-window views and numpy.

`NumpyConversion` holds the Converter's numpy-backend methods; `pcvr_lib.data.convert` has the semantics
both backends implement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pcvr_lib.data.arrow_lists import ListColumn, list_column, null_mask, primitive_values
from pcvr_lib.data.list_order import (
    NEWEST_FIRST,
    NEWEST_LAST,
    NON_MONOTONIC,
    ORDER_CLASSES,
    classify_rows,
    non_monotonic_error,
)
from pcvr_lib.data.parquet import DataError

# Strict mode scans the last L + STRICT_SLACK events of a row first (enough unless many are invalid).
STRICT_SLACK = 64


class OutOfVocabError(DataError):
    """An id >= vocab_size met with clip_oov=False."""


@dataclass
class _Plan:
    """Which element of a list column each output position [b, j] (j < width) takes: element
    start[b] + j (contiguous windows, `rel` None) or start[b] + rel[b, j] (strict mode). Positions
    j >= count[b] are padding, and so are positions with rel[b, j] >= limit[b] when `limit` is set
    (a side column shorter than its domain's timestamp column)."""

    start: np.ndarray  # int64 [B]
    count: np.ndarray  # int64 [B]
    width: int
    rel: np.ndarray | None = None  # int64 [B, width]
    limit: np.ndarray | None = None  # int64 [B]
    _keep: np.ndarray | None = None

    @property
    def padded(self) -> bool:
        if self.limit is not None:
            return True
        return bool(len(self.count)) and int(self.count.min()) < self.width

    def keep(self) -> np.ndarray:
        """[B, width] bool: True where the position holds an element (numpy backend)."""
        if self._keep is None:
            keep = np.arange(self.width) < self.count[:, None]
            if self.limit is not None:
                keep &= self.rel < self.limit[:, None]
            self._keep = keep
        return self._keep

    def with_start(self, start: np.ndarray, limit: np.ndarray | None = None) -> _Plan:
        """The same events of another column (strict mode): same rel and count, its own start."""
        return _Plan(start, self.count, self.width, self.rel, limit)

    def source(self, b: int, j: int) -> int:
        return int(self.start[b] + (self.rel[b, j] if self.rel is not None else j))


def _canonical(
    lists: ListColumn, ts: ListColumn, order: np.ndarray, perm_start, perm, via_ts: np.ndarray
) -> ListColumn:
    """The column with every row's events rearranged oldest first (numpy backend). Rows with via_ts take the
    timestamp column's events by number (its length; 0 past this column's own end); the others reverse
    their own list where order is -1."""
    rows = len(order)
    new_len = np.where(via_ts, ts.lengths, lists.lengths)
    first = np.cumsum(new_len) - new_len
    row = np.repeat(np.arange(rows), new_len)
    w = np.arange(int(new_len.sum())) - np.repeat(first, new_len)
    d = order[row]
    e = w.copy()
    rev = d == -1
    e[rev] = new_len[row[rev]] - 1 - w[rev]
    srt = d == 2
    if srt.any():
        e[srt] = perm[perm_start[row[srt]] + w[srt]]
    inside = e < lists.lengths[row]
    values = np.zeros(len(e), dtype=lists.values.dtype)
    values[inside] = lists.values[lists.starts[row[inside]] + e[inside]]
    offsets = np.concatenate([[0], np.cumsum(new_len)])
    return ListColumn(offsets, first.astype(np.int64), new_len.astype(np.int64), values, False)


def _head_plan(lists: ListColumn, width: int) -> _Plan:
    """The first `width` elements of each list (width>1 int and dense features)."""
    return _Plan(lists.starts, np.minimum(lists.lengths, width), width)


def _tail_plan(lists: ListColumn, width: int) -> _Plan:
    """The last `width` elements of each list, left-aligned (non-strict sequences: the newest events)."""
    count = np.minimum(lists.lengths, width)
    return _Plan(lists.starts + lists.lengths - count, count, width)


def _gather(values: np.ndarray, plan: _Plan) -> np.ndarray:
    """[B, width] array of values at the plan's positions; padding positions hold arbitrary values of the
    buffer (callers mask them). Contiguous windows are copied row by row through a sliding-window view."""
    rows, width = len(plan.count), plan.width
    n = len(values)
    if n == 0 or rows == 0:
        return np.zeros((rows, width), dtype=values.dtype)
    if plan.rel is not None:
        return np.take(values, plan.start[:, None] + plan.rel, mode="clip")
    if n < width:
        return np.take(values, plan.start[:, None] + np.arange(width), mode="clip")
    item = values.itemsize
    windows = np.ndarray(
        (n - width + 1, width), dtype=values.dtype, buffer=values, strides=(item, item)
    )  # windows[s] = values[s : s + width], no copy
    last = n - width
    start = plan.start
    over = start > last
    if over.any():  # windows running past the buffer end: gather those few rows by index
        out = windows[np.minimum(start, last)]
        out[over] = np.take(values, start[over, None] + np.arange(width), mode="clip")
        return out
    return windows[start]


class NumpyConversion:
    """The numpy backend of `Converter` (its base class): user / item features and sequence domains into
    the batch's output arrays. Uses the converter's settings (schema, training, strict_time_filter,
    clip_oov, list_order, non_monotonic), its per-side feature tables and its `stats`."""

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

    def _scalar_ints(self, side: str, cols: dict[str, pa.Array], values, missing) -> None:
        """All width-1 int features of a side at once: a [rows, n] matrix, vectorised over columns."""
        group = f"{side}_int"
        feats = self._scalars[side]
        if not feats:
            return
        rows = values.shape[0]
        raw = np.empty((rows, len(feats)), dtype=np.int64)
        for i, feat in enumerate(feats):
            arr = cols[feat.column]
            raw[:, i] = primitive_values(arr, np.int64)
            null = null_mask(arr)
            if null is not None:
                raw[null, i] = 0
        vocab = self._scalar_vocab[side]
        ok = (raw > 0) & (raw < vocab)  # vocab 0 -> never ok: the column is zeroed
        oob = (raw >= vocab) & (vocab > 0)
        per_column = np.count_nonzero(oob, axis=0)
        if per_column.any():
            i = int(np.flatnonzero(per_column)[0])
            if not self.clip_oov:
                self._raise_oob(feats[i].column, raw[:, i : i + 1], oob[:, i : i + 1], feats[i].vocab_size)
            for i in np.flatnonzero(per_column):
                self._count_oob(group, feats[i].column, int(per_column[i]))
        cols_at = self._scalar_offsets[side]
        values[:, cols_at] = np.where(ok, raw, 0)
        missing[:, cols_at] = ~ok

    def _features(self, side: str, cols: dict[str, pa.Array], rows: int, out: dict) -> None:
        """The numpy backend's user / item features into `out`."""
        schema = self.schema
        group = f"{side}_int"
        values, missing = out[f"{side}.int_values"], out[f"{side}.int_missing"]
        self._scalar_ints(side, cols, values, missing)

        dense, dmissing = out[f"{side}.dense_values"], out[f"{side}.dense_missing"]
        for feat in self._lists_int[side]:
            lists = list_column(cols[feat.column], feat.column, np.int64)
            # the first dim elements: these lists are not time-ordered
            self._int_list_numpy(group, feat, lists, _head_plan(lists, feat.dim), values, missing)
        for feat in schema.dense_group(side):
            lists = list_column(cols[feat.column], feat.column, np.float32)
            plan = _head_plan(lists, feat.dim)
            target = slice(feat.offset, feat.offset + feat.dim)
            v = _gather(lists.values, plan)
            ok = np.isfinite(v)
            if plan.padded:
                ok &= plan.keep()
            dense[:, target] = np.where(ok, v, np.float32(0))
            np.logical_not(ok, out=dmissing[:, target])

    def _int_list_numpy(self, group: str, feat, lists: ListColumn, plan: _Plan, values, missing) -> None:
        v = _gather(lists.values, plan)
        ok = plan.keep() & (v > 0)
        if feat.vocab_size:
            oob = ok & (v >= feat.vocab_size)
            n_oob = int(np.count_nonzero(oob))
            if n_oob:
                if not self.clip_oov:
                    self._raise_oob(feat.column, v, oob, feat.vocab_size)
                self._count_oob(group, feat.column, n_oob)
                ok &= ~oob
        else:
            ok[:] = False  # vocab 0 zeroes the column
        target = slice(feat.offset, feat.offset + feat.dim)
        values[:, target] = np.where(ok, v, 0)
        missing[:, target] = ~ok

    # ------------------------------------------------------------------------------------------
    def _strict_plan(self, ts: ListColumn, request_ts: np.ndarray, L: int) -> _Plan:
        """The last L valid events (0 < ts < the row's request timestamp) of each row, oldest first, as
        event numbers within the row."""
        rows = len(ts.lengths)
        rel = np.zeros((rows, L), dtype=np.int64)
        count = np.zeros(rows, dtype=np.int64)
        if rows == 0 or len(ts.values) == 0:
            return _Plan(ts.starts, count, L, rel)
        # scan a tail window of each list first (newest events last, so the kept events are near
        # the end); rows whose window holds fewer than L valid events but whose list is longer are redone
        # over their whole list
        window = L + STRICT_SLACK
        tail = _tail_plan(ts, window)
        t = _gather(ts.values, tail)
        valid = (t > 0) & (t < request_ts[:, None])
        if tail.padded:
            valid &= tail.keep()
        redo = (np.count_nonzero(valid, axis=1) < L) & (ts.lengths > window)
        if redo.any():
            self._strict_rows_full(ts, request_ts, L, np.flatnonzero(redo), rel, count)
            valid[redo] = False
        done = ~redo
        cum = np.cumsum(valid, axis=1, dtype=np.int32)
        total = cum[:, -1:]
        after = total - cum  # valid events after this position in its row
        keep = valid & (after < L)
        kept = np.minimum(total[:, 0], L).astype(np.int64)
        r, c = np.nonzero(keep)
        dst = kept[r] - 1 - after[r, c]
        rel[r, dst] = (tail.start[r] - ts.starts[r]) + c
        count[done] = kept[done]
        return _Plan(ts.starts, count, L, rel)

    @staticmethod
    def _strict_rows_full(ts: ListColumn, request_ts, L: int, rows: np.ndarray, rel, count) -> None:
        lengths = ts.lengths[rows]
        total = int(lengths.sum())
        first = np.cumsum(lengths) - lengths
        local = np.repeat(np.arange(len(rows)), lengths)
        within = np.arange(total) - np.repeat(first, lengths)  # event number within its row
        t = ts.values[within + np.repeat(ts.starts[rows], lengths)]
        valid = (t > 0) & (t < request_ts[rows][local])
        cum = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(valid, out=cum[1:])
        row_total = cum[first + lengths] - cum[first]
        after = cum[np.repeat(first + lengths, lengths)] - cum[1:]
        keep = valid & (after < L)
        kept = np.minimum(row_total, L)
        pos = kept[local] - 1 - after
        rel[rows[local[keep]], pos[keep]] = within[keep]
        count[rows] = kept

    def _side_plan(self, lists: ListColumn, ts: ListColumn, base: _Plan, L: int) -> _Plan:
        """The plan of a side column: the timestamp column's when laid out alike, else its own."""
        same = lists.offsets is ts.offsets or (
            np.array_equal(lists.offsets, ts.offsets) and np.array_equal(lists.lengths, ts.lengths)
        )
        if same:
            return base
        if not self.strict_time_filter:
            return _tail_plan(lists, L)
        # strict: the same events (by number within the row) as the timestamp column; events past this
        # column's own length read as 0
        limit = None if np.array_equal(lists.lengths, ts.lengths) else lists.lengths
        return base.with_start(lists.starts, limit)

    def _row_order(self, domain, cols, rows: int, row_offset: int):
        """Each row's order for the kernels: None (every row newest last, the stored order) or int8 [rows]
        of 1 (newest last), -1 (newest first, reversed) and 2 (sorted by time: perm_start, perm give each
        such row's events oldest first). Counts the rows per class in stats["list_order_rows"]."""
        counts = self.stats["list_order_rows"][domain.name]
        if self.list_order != "auto":
            counts["given"] += rows
            return (None, None, None) if self.list_order == "newest-last" else (np.full(rows, -1, np.int8), None, None)
        column = domain.ts_feature.column
        cls = classify_rows(list_column(cols[column], column, np.int64))
        per_class = np.bincount(cls, minlength=4)
        for name, n in zip(ORDER_CLASSES, per_class.tolist(), strict=True):
            counts[name] += n
        if per_class[NEWEST_LAST] == rows:
            return None, None, None
        if per_class[NON_MONOTONIC] and self.non_monotonic == "error":
            row = int(np.flatnonzero(cls == NON_MONOTONIC)[0])
            raise non_monotonic_error(column, row_offset + row, int(per_class[NON_MONOTONIC]))
        # rows too short to tell take the batch's majority order (newest last on a tie)
        majority = -1 if per_class[NEWEST_FIRST] > per_class[NEWEST_LAST] else 1
        order = np.choose(cls, [majority, 1, -1, 2]).astype(np.int8)
        perm_start = perm = None
        if per_class[NON_MONOTONIC]:
            ts = list_column(cols[column], column, np.int64)
            sorted_rows = np.flatnonzero(cls == NON_MONOTONIC)
            perm_start = np.zeros(rows, dtype=np.int64)
            perm_start[sorted_rows] = np.cumsum(ts.lengths[sorted_rows]) - ts.lengths[sorted_rows]
            perm = np.concatenate(
                [np.argsort(ts.values[ts.starts[b] : ts.starts[b] + ts.lengths[b]], kind="stable") for b in sorted_rows]
            ).astype(np.int64)
        return order, perm_start, perm

    def _domain_numpy(self, domain, cols, request_ts: np.ndarray, rows: int, out: dict, row_offset: int = 0) -> None:
        """The numpy backend's sequence domain into `out`."""
        L = domain.max_len
        side = domain.side_features
        ts = list_column(cols[domain.ts_feature.column], domain.ts_feature.column, np.int64)
        order, perm_start, perm = self._row_order(domain, cols, rows, row_offset)
        side_lists = [list_column(cols[f.column], f.column, np.int64, like=ts) for f in side]
        if order is not None:
            # every row's events oldest first; strict mode and sorted rows take side events by the
            # timestamp column's event numbers, the others reverse each column's own list
            via_ts = np.full(rows, True) if self.strict_time_filter else order == 2
            canon_ts = _canonical(ts, ts, order, perm_start, perm, via_ts)
            side_lists = [_canonical(x, ts, order, perm_start, perm, via_ts) for x in side_lists]
            ts = canon_ts
        base = self._strict_plan(ts, request_ts, L) if self.strict_time_filter else _tail_plan(ts, L)

        timestamps = out[f"{domain.name}.timestamps"]
        timestamps[...] = _gather(ts.values, base)
        if base.padded:
            timestamps *= base.keep()

        values = out[f"{domain.name}.values"]
        lengths = base.count if (self.strict_time_filter or not side) else np.zeros(rows, dtype=np.int64)
        for f, feat in enumerate(side):
            lists = side_lists[f]
            plan = self._side_plan(lists, ts, base, L)
            if not self.strict_time_filter:
                lengths = np.maximum(lengths, plan.count)
            self._side_values_numpy(domain.name, feat, lists.values, plan, values[:, f, :])
        out[f"{domain.name}.lengths"][...] = lengths

    def _side_values_numpy(self, group: str, feat, source: np.ndarray, plan: _Plan, out: np.ndarray) -> None:
        vocab = feat.vocab_size
        if vocab == 0 or len(source) == 0:
            out[...] = 0
            return
        g = _gather(source, plan)  # int64 [B, L]
        torch.from_numpy(g).clamp_(0, vocab)  # <= 0 -> 0, out of vocab -> vocab (fits int32)
        np.copyto(out, g, casting="unsafe")
        if plan.padded:
            out *= plan.keep()
        oob = out == vocab
        n_oob = int(np.count_nonzero(oob))
        if n_oob:
            if not self.clip_oov:
                b, j = (int(x[0]) for x in np.nonzero(oob))
                raise OutOfVocabError(
                    f"column {feat.column!r}: value {int(source[plan.source(b, j)])} (row {b}) is out of "
                    f"vocabulary (vocab_size {vocab}); {n_oob} such value(s) in this batch (clip_oov=False)"
                )
            self._count_oob(group, feat.column, n_oob)
            out[oob] = 0
