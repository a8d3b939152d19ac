"""Arrow columns as the converter reads them: numpy views of their buffers (zero copy where the layout
allows) for the numpy backend, and raw buffer addresses for the native kernels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pcvr_lib.data.parquet import DataError


def column_array(data: pa.RecordBatch | pa.Table, index: int | str) -> pa.Array:
    """One column (by position or name) as a single Arrow array (table chunks are concatenated)."""
    col = data.column(index)
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return col.chunk(0)
        if col.num_chunks == 0:
            return pa.array([], type=col.type)
        return pa.concat_arrays(col.chunks)
    return col


def primitive_values(array: pa.Array, dtype: np.dtype) -> np.ndarray:
    """The values buffer of a primitive array as numpy (zero copy; null slots hold whatever is there)."""
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + n)[array.offset :]


def null_mask(array: pa.Array) -> np.ndarray | None:
    """Bool mask of null slots, or None when there are none (unpacked from the validity bitmap)."""
    if array.null_count == 0:
        return None
    n, off = len(array), array.offset
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8, count=(off + n + 7) // 8)
    return np.unpackbits(bits, count=off + n, bitorder="little")[off:] == 0


@dataclass
class ListColumn:
    """A list column as numpy: absolute start offsets into `values`, lengths (null rows 0), flat values."""

    offsets: np.ndarray  # the raw offsets [B+1] (to detect columns laid out like another)
    starts: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    values: np.ndarray
    has_nulls: bool


def list_column(array: pa.Array, name: str, dtype: np.dtype, like: ListColumn | None = None) -> ListColumn:
    """The column as numpy; with `like`, a column laid out like it (same offsets, no nulls) shares its
    starts and lengths (the common case of a domain's side columns)."""
    n, off = len(array), array.offset
    width = np.int64 if pa.types.is_large_list(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=width, count=off + n + 1)[off:]
    child = array.values
    null = null_mask(array)
    if (
        like is not None
        and null is None
        and not like.has_nulls
        and child.null_count == 0
        and np.array_equal(offsets, like.offsets)
    ):
        return ListColumn(like.offsets, like.starts, like.lengths, primitive_values(child, dtype), False)
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets).astype(np.int64)
    if null is not None:
        lengths[null] = 0
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
    return ListColumn(offsets, starts, lengths, primitive_values(child, dtype), null is not None)


_EMPTY = np.zeros(1, dtype=np.int64)  # a valid address for columns without values
_LARGE_LIST_ID = pa.large_list(pa.int64()).id


def address_of(array: np.ndarray | None) -> int | None:
    return None if array is None else array.__array_interface__["data"][0]


class RawListColumn:
    """A list column's raw Arrow buffers as addresses for the native kernels: int32 offsets (at the
    array's slice offset), the validity bitmap (0 when no nulls) and its bit offset, the values."""

    def __init__(self, array: pa.Array, name: str, dtype: np.dtype) -> None:
        n, off = len(array), array.offset
        bufs = array.buffers()  # validity, offsets, child validity, child values
        child = array.values
        if bufs[2] is not None and child.null_count:
            list_column(array, name, dtype)  # raises when a row uses a null element
        self._keep = None
        if array.type.id == _LARGE_LIST_ID:
            offsets = np.frombuffer(bufs[1], dtype=np.int64, count=off + n + 1)[off:]
            if len(offsets) and offsets[-1] >= 2**31:
                raise DataError(f"column {name!r}: more than 2**31 list elements in one batch")
            self._keep = offsets.astype(np.int32)
            self.offsets = address_of(self._keep)
        else:
            self.offsets = bufs[1].address + 4 * off
        self.valid = bufs[0].address if array.null_count else 0
        self.bit = off
        values = bufs[3] if len(bufs) > 3 else None
        itemsize = 4 if dtype is np.float32 else 8
        self.values = values.address + itemsize * child.offset if values is not None else address_of(_EMPTY)
