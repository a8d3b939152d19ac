"""A slow, obviously-right per-row converter written from data.md section 2 (with the project's list-order
decision: lists are chronological, newest last; both modes keep the newest events). The tests compare
pcvr_lib.data.convert.Converter with it. Plain Python over `to_pylist()`; no numpy tricks.

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


def _column(data, name):
    return data.column(name).to_pylist()


def reference_convert(data, schema: Schema, *, training=True, strict=False, clip_oov=True) -> dict:
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
        for r in range(rows):
            ts = ts_col[r] or []
            if strict:
                valid = [j for j, t in enumerate(ts) if 0 < t < request[r]]
                chosen = valid[-L:]  # the last L valid events
                lengths[r] = len(chosen)
                for p, j in enumerate(chosen):
                    timestamps[r, p] = ts[j]
                per_feature = []
                for col in side_cols:
                    cell = col[r] or []
                    per_feature.append([cell[j] if j < len(cell) else 0 for j in chosen])
            else:
                kept_ts = ts[-L:]  # the newest L events
                for p, t in enumerate(kept_ts):
                    timestamps[r, p] = t
                per_feature = []
                for col in side_cols:
                    cell = col[r] or []
                    per_feature.append(cell[-L:])
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
