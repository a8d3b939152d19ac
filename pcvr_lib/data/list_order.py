"""How a row's sequence lists are ordered in time: the options, the per-row classes and their detection
from the event timestamps (numpy, or the native kernel when it builds here)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pcvr_lib.data.arrow_lists import ListColumn, RawListColumn, address_of, list_column
from pcvr_lib.data.convert_native import NativeUnavailable, native_library
from pcvr_lib.data.parquet import DataError

# How a row's sequence lists are ordered in time. "auto" tells it per row from the event timestamps.
LIST_ORDERS = ("auto", "newest-first", "newest-last")
# What "auto" does with a row whose timestamps are neither non-decreasing nor non-increasing.
NON_MONOTONIC_POLICIES = ("sort", "error")
# Row classes of the order detection (pcvr_list_order in convert_native.c and classify_rows agree).
TOO_SHORT, NEWEST_LAST, NEWEST_FIRST, NON_MONOTONIC = 0, 1, 2, 3
ORDER_CLASSES = ("too_short", "newest_last", "newest_first", "non_monotonic")


def check_order_options(list_order: str, non_monotonic: str) -> None:
    """The list-order options (of a Converter, and of callers that pass them on): ValueError naming the
    option and the allowed values."""
    if list_order not in LIST_ORDERS:
        raise ValueError(f"list_order must be one of {', '.join(LIST_ORDERS)}, got {list_order!r}")
    if non_monotonic not in NON_MONOTONIC_POLICIES:
        raise ValueError(f"non_monotonic must be one of {', '.join(NON_MONOTONIC_POLICIES)}, got {non_monotonic!r}")


def non_monotonic_error(column: str, row: int, count: int) -> DataError:
    return DataError(
        f"column {column!r}: row {row}: event timestamps are neither non-decreasing nor non-increasing "
        f"({count} such row(s) in this batch); non_monotonic='error' rejects them (non_monotonic='sort' sorts "
        "them by time)"
    )


def classify_rows(ts: ListColumn) -> np.ndarray:
    """Each row's list order class (TOO_SHORT .. NON_MONOTONIC) from its event times, times <= 0 ignored."""
    rows = len(ts.lengths)
    row = np.repeat(np.arange(rows), ts.lengths)
    within = np.arange(len(row)) - np.repeat(np.cumsum(ts.lengths) - ts.lengths, ts.lengths)
    t = ts.values[ts.starts[row] + within] if len(row) else np.zeros(0, dtype=np.int64)
    positive = t > 0
    t, row = t[positive], row[positive]
    step = np.diff(t)
    same = row[1:] == row[:-1]
    up = np.bincount(row[1:][same & (step > 0)], minlength=rows) > 0
    down = np.bincount(row[1:][same & (step < 0)], minlength=rows) > 0
    return (up.astype(np.uint8) | (down.astype(np.uint8) << 1)).astype(np.uint8)


def classify_list_order(array: pa.Array) -> np.ndarray:
    """The list order class of every row of an event-timestamp list column (uint8, see ORDER_CLASSES):
    newest last (never decreasing), newest first (never increasing), not monotonic, or too short to tell
    (fewer than two distinct positive times). Native kernel when it builds here, else numpy."""
    rows = len(array)
    try:
        lib = native_library()
    except NativeUnavailable:
        lib = None
    if lib is None or rows == 0:
        return classify_rows(list_column(array, "timestamps", np.int64))
    raw = RawListColumn(array, "timestamps", np.int64)
    cls = np.empty(rows, dtype=np.uint8)
    lib.pcvr_list_order(rows, raw.offsets, raw.valid, raw.bit, raw.values, address_of(cls))
    return cls
