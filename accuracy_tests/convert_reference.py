"""A slow, obviously-right per-row converter written from data.md section 2 (with the project's list-order
decisions: each row's order is told from its event times, or given; both modes keep the newest events,
oldest first). The tests compare pcvr_lib.data.convert.Converter with it. Plain Python over `to_pylist()`;
no numpy tricks.

List order per row ("auto"): the positive event times, in list order, never decreasing (and not all equal)
-> newest last; never increasing -> newest first; both directions -> not monotonic (sorted by time, stable,
or rejected); fewer than two distinct positive times -> the batch's majority of the rows that tell
(newest last on a tie). Chronological event numbers ("canon", oldest first): the list as stored, reversed,
or the stable sort by time.

Returns a dict of numpy arrays in the Batch layout:
  user/item: int_values, int_missing, dense_values, dense_missing
  seq/<domain>: values [B, F, L], timestamps [B, L], lengths [B]
  request_timestamp, label, user_id, and "oob": {column: count}.
"""

from __future__ import annotations

import math

import numpy as np

from pcvr_lib.schema import Schema


class ReferenceOOB(Exception):
    pass


class ReferenceNonMonotonic(Exception):
    pass


def row_order(ts) -> str:
    """'newest_last', 'newest_first', 'non_monotonic' or 'too_short' from one row's event times."""
    positive = [t for t in ts if t > 0]
    up = any(a < b for a, b in zip(positive, positive[1:], strict=False))
    down = any(a > b for a, b in zip(positive, positive[1:], strict=False))
    if up and down:
        return "non_monotonic"
    return "newest_last" if up else ("newest_first" if down else "too_short")


def _column(data, name):
    return data.column(name).to_pylist()


def reference_convert(
    data, schema: Schema, *, training=True, strict=False, clip_oov=True, list_order="auto", non_monotonic="sort"
) -> dict:
    rows = data.num_rows
    out: dict = {"oob": {}}

    def count_oob(column):
        out["oob"][column] = out["oob"].get(column, 0) + 1
        if not clip_oov:
            raise ReferenceOOB(column)

    request = _column(data, "timestamp")
    out["request_timestamp"] = np.array(request, dtype=np.int64).reshape(rows)
    label_type = _column(data, "label_type")
    out["label"] = np.array([1.0 if (training and lt == 2) else 0.0 for lt in label_type], dtype=np.float32).reshape(
        rows
    )
    out["user_id"] = np.array([-1 if u is None else u for u in _column(data, "user_id")], dtype=np.int64).reshape(rows)

    for side in ("user", "item"):
        width = schema.int_width(side)
        values = np.zeros((rows, width), dtype=np.int64)
        missing = np.zeros((rows, width), dtype=bool)
        for feat in schema.int_group(side):
            col = _column(data, feat.column)
            for r in range(rows):
                cell = col[r]
                if feat.dim == 1:
                    slots = [cell]
                else:
                    cell = cell or []
                    slots = [cell[j] if j < len(cell) else None for j in range(feat.dim)]
                for j, x in enumerate(slots):
                    if x is None or x <= 0:
                        v, m = 0, True
                    elif feat.vocab_size == 0:
                        v, m = 0, True
                    elif x >= feat.vocab_size:
                        count_oob(feat.column)
                        v, m = 0, True
                    else:
                        v, m = x, False
                    values[r, feat.offset + j] = v
                    missing[r, feat.offset + j] = m
        dwidth = schema.dense_width(side)
        dense = np.zeros((rows, dwidth), dtype=np.float32)
        dmissing = np.zeros((rows, dwidth), dtype=bool)
        for feat in schema.dense_group(side):
            col = _column(data, feat.column)
            for r in range(rows):
                cell = col[r] or []
                for j in range(feat.dim):
                    if j < len(cell) and math.isfinite(cell[j]):
                        dense[r, feat.offset + j] = cell[j]
                    else:
                        dense[r, feat.offset + j] = 0.0
                        dmissing[r, feat.offset + j] = True
        out[side] = {"int_values": values, "int_missing": missing, "dense_values": dense, "dense_missing": dmissing}

    out["seq"] = {}
    for domain in schema.domains:
        L = domain.max_len
        side_feats = domain.side_features
        ts_col = _column(data, domain.ts_feature.column)
        side_cols = [_column(data, f.column) for f in side_feats]
        values = np.zeros((rows, len(side_feats), L), dtype=np.int64)
        timestamps = np.zeros((rows, L), dtype=np.int64)
        lengths = np.zeros(rows, dtype=np.int64)
        if list_order == "auto":
            kinds = [row_order(ts_col[r] or []) for r in range(rows)]
            first = kinds.count("newest_first") > kinds.count("newest_last")
            fallback = "newest_first" if first else "newest_last"
            kinds = [fallback if k == "too_short" else k for k in kinds]
        else:
            kinds = [list_order.replace("-", "_")] * rows
        for r in range(rows):
            ts = ts_col[r] or []
            kind = kinds[r]
            if kind == "non_monotonic" and non_monotonic == "error":
                raise ReferenceNonMonotonic(domain.ts_feature.column)
            if kind == "newest_last":
                canon = list(range(len(ts)))
            elif kind == "newest_first":
                canon = list(reversed(range(len(ts))))
            else:
                canon = sorted(range(len(ts)), key=lambda j: ts[j])  # stable: ties keep list order
            if strict or kind == "non_monotonic":
                # the newest L (valid) events by time; every side column takes the same event numbers
                chosen = [j for j in canon if not strict or 0 < ts[j] < request[r]][-L:]
                lengths[r] = len(chosen)
                for p, j in enumerate(chosen):
                    timestamps[r, p] = ts[j]
                per_feature = []
                for col in side_cols:
                    cell = col[r] or []
                    per_feature.append([cell[j] if j < len(cell) else 0 for j in chosen])
            else:
                # each column its own newest L elements, oldest first
                def newest(cell, L=L, kind=kind):
                    return cell[-L:] if kind == "newest_last" else list(reversed(cell[:L]))

                kept_ts = newest(ts)
                for p, t in enumerate(kept_ts):
                    timestamps[r, p] = t
                per_feature = [newest(col[r] or []) for col in side_cols]
                lengths[r] = max((len(x) for x in per_feature), default=len(kept_ts))  # no side feature: the ts list
            for f, feat in enumerate(side_feats):
                for p, x in enumerate(per_feature[f]):
                    if x <= 0 or feat.vocab_size == 0:
                        v = 0
                    elif x >= feat.vocab_size:
                        count_oob(feat.column)
                        v = 0
                    else:
                        v = x
                    values[r, f, p] = v
        out["seq"][domain.name] = {"values": values, "timestamps": timestamps, "lengths": lengths}
    return out
