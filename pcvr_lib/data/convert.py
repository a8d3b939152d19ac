"""Arrow RecordBatch / Table -> Batch (data.md section 2).

Two backends with the same results (tested against a per-row reference): "native", C kernels that walk
the RecordBatch's buffers through the Arrow C data interface, one call per batch (compiled on first use,
see `native_library`), and "numpy", vectorised with Arrow offsets, sliding-window views and numpy. The default
"auto" takes native when it builds here. Output arrays of a batch share one recycled arena (`_ArenaPool`).
One converter may be shared by threads (the kernels release the GIL).

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
- List order (`list_order`): "auto" tells each row's order from its event times (times <= 0 ignored):
  never decreasing -> newest last, never increasing -> newest first, both -> not monotonic (sorted by time,
  stable, with `non_monotonic="sort"`, or an error naming the column and row with "error"); fewer than two
  distinct positive times -> too short to tell: the batch's majority order (newest last on a tie).
  "newest-first" / "newest-last" take every row in that order unchecked (data without usable times).
  Rows per class and domain are counted in stats["list_order_rows"].
- Sequences, in each row's chronological order, always the newest events, left-aligned, oldest first.
  Non-strict: every column keeps its own newest min(len, L) elements; length = max over side columns (the
  timestamp column's own when a domain has no side feature). Strict (`strict_time_filter=True`, training
  batches only unless `strict_on_eval=True`): the valid events are those with 0 < ts < request timestamp;
  the newest L valid ones are kept for every column (a side column shorter than the timestamp column gives
  0 at the events it lacks); length = the number kept. A sorted (not monotonic) row takes the newest L
  events like strict mode without the time filter. Side tokens <= 0 -> 0, out-of-vocab counted and
  clipped (or raised), vocab 0 zeroes the feature. Timestamps are copied raw.
- Labels: label_type == 2 -> 1.0, else (null included) 0.0; all zero when not training.
- user_id: a null user_id becomes -1 and is counted in stats["null_user_id"].
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock
from pcvr_lib.data.parquet import DataError, check_arrow_schema, expected_columns
from pcvr_lib.schema import Schema

NULL_USER_ID = -1
# "auto": the native kernels when they build here, else numpy (recorded in Converter.backend / stats)
BACKENDS = ("auto", "native", "numpy")
INT32_MAX = 2**31 - 1
# Strict mode scans the last L + STRICT_SLACK events of a row first (enough unless many are invalid).
STRICT_SLACK = 64
# How a row's sequence lists are ordered in time. "auto" tells it per row from the event timestamps.
LIST_ORDERS = ("auto", "newest-first", "newest-last")
# What "auto" does with a row whose timestamps are neither non-decreasing nor non-increasing.
NON_MONOTONIC_POLICIES = ("sort", "error")
# Row classes of the order detection (pcvr_list_order in convert_native.c and _classify_numpy agree).
TOO_SHORT, NEWEST_LAST, NEWEST_FIRST, NON_MONOTONIC = 0, 1, 2, 3
ORDER_CLASSES = ("too_short", "newest_last", "newest_first", "non_monotonic")


class OutOfVocabError(DataError):
    """An id >= vocab_size met with clip_oov=False."""


def check_order_options(list_order: str, non_monotonic: str) -> None:
    """The list-order options (of a Converter, and of callers that pass them on): ValueError naming the
    option and the allowed values."""
    if list_order not in LIST_ORDERS:
        raise ValueError(f"list_order must be one of {', '.join(LIST_ORDERS)}, got {list_order!r}")
    if non_monotonic not in NON_MONOTONIC_POLICIES:
        raise ValueError(f"non_monotonic must be one of {', '.join(NON_MONOTONIC_POLICIES)}, got {non_monotonic!r}")


def _non_monotonic_error(column: str, row: int, count: int) -> DataError:
    return DataError(
        f"column {column!r}: row {row}: event timestamps are neither non-decreasing nor non-increasing "
        f"({count} such row(s) in this batch); non_monotonic='error' rejects them (non_monotonic='sort' sorts "
        "them by time)"
    )


# the output arrays of a side's features and of a domain, in FeatureBlock / SequenceBlock field order
FEATURE_ARRAYS = ("int_values", "int_missing", "dense_values", "dense_missing")
SEQUENCE_ARRAYS = ("values", "timestamps", "lengths")
_ArrowArrayStruct = ctypes.c_byte * 80  # sizeof(struct ArrowArray) of the Arrow C data interface


def _column(data: pa.RecordBatch | pa.Table, index: int | str) -> pa.Array:
    """One column (by position or name) as a single Arrow array (table chunks are concatenated)."""
    col = data.column(index)
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
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + n)[array.offset :]


def _nulls(array: pa.Array) -> np.ndarray | None:
    """Bool mask of null slots, or None when there are none (unpacked from the validity bitmap)."""
    if array.null_count == 0:
        return None
    n, off = len(array), array.offset
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8, count=(off + n + 7) // 8)
    return np.unpackbits(bits, count=off + n, bitorder="little")[off:] == 0


def labels_from_label_type(label_type: pa.Array) -> np.ndarray:
    """The label rule: float32 1.0 where the int32 label_type is 2, else 0.0 (null included)."""
    label = (_buffer(label_type, np.int32) == 2).astype(np.float32)
    null = _nulls(label_type)
    if null is not None:
        label[null] = 0.0
    return label


@dataclass
class _Lists:
    """A list column as numpy: absolute start offsets into `values`, lengths (null rows 0), flat values."""

    offsets: np.ndarray  # the raw offsets [B+1] (to detect columns laid out like another)
    starts: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    values: np.ndarray
    has_nulls: bool


def _lists(array: pa.Array, name: str, dtype: np.dtype, like: _Lists | None = None) -> _Lists:
    """The column as numpy; with `like`, a column laid out like it (same offsets, no nulls) shares its
    starts and lengths (the common case of a domain's side columns)."""
    n, off = len(array), array.offset
    width = np.int64 if pa.types.is_large_list(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=width, count=off + n + 1)[off:]
    child = array.values
    null = _nulls(array)
    if (
        like is not None
        and null is None
        and not like.has_nulls
        and child.null_count == 0
        and np.array_equal(offsets, like.offsets)
    ):
        return _Lists(like.offsets, like.starts, like.lengths, _buffer(child, dtype), False)
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
    return _Lists(offsets, starts, lengths, _buffer(child, dtype), null is not None)


_EMPTY = np.zeros(1, dtype=np.int64)  # a valid address for columns without values
_LARGE_LIST_ID = pa.large_list(pa.int64()).id


class _RawList:
    """A list column's raw Arrow buffers as addresses for the native kernels: int32 offsets (at the
    array's slice offset), the validity bitmap (0 when no nulls) and its bit offset, the values."""

    def __init__(self, array: pa.Array, name: str, dtype: np.dtype) -> None:
        n, off = len(array), array.offset
        bufs = array.buffers()  # validity, offsets, child validity, child values
        child = array.values
        if bufs[2] is not None and child.null_count:
            _lists(array, name, dtype)  # raises when a row uses a null element
        self._keep = None
        if array.type.id == _LARGE_LIST_ID:
            offsets = np.frombuffer(bufs[1], dtype=np.int64, count=off + n + 1)[off:]
            if len(offsets) and offsets[-1] >= 2**31:
                raise DataError(f"column {name!r}: more than 2**31 list elements in one batch")
            self._keep = offsets.astype(np.int32)
            self.offsets = _ptr(self._keep)
        else:
            self.offsets = bufs[1].address + 4 * off
        self.valid = bufs[0].address if array.null_count else 0
        self.bit = off
        values = bufs[3] if len(bufs) > 3 else None
        itemsize = 4 if dtype is np.float32 else 8
        self.values = values.address + itemsize * child.offset if values is not None else _ptr(_EMPTY)


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


def _classify_numpy(ts: _Lists) -> np.ndarray:
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
        return _classify_numpy(_lists(array, "timestamps", np.int64))
    raw = _RawList(array, "timestamps", np.int64)
    cls = np.empty(rows, dtype=np.uint8)
    lib.pcvr_list_order(rows, raw.offsets, raw.valid, raw.bit, raw.values, _ptr(cls))
    return cls


def _canonical(lists: _Lists, ts: _Lists, order: np.ndarray, perm_start, perm, via_ts: np.ndarray) -> _Lists:
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
    return _Lists(offsets, first.astype(np.int64), new_len.astype(np.int64), values, False)


def _head_plan(lists: _Lists, width: int) -> _Plan:
    """The first `width` elements of each list (width>1 int and dense features)."""
    return _Plan(lists.starts, np.minimum(lists.lengths, width), width)


def _tail_plan(lists: _Lists, width: int) -> _Plan:
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


# ----------------------------------------------------------------------------------------------
# native kernels: one fused pass per sequence column (gather, token rules, int32 store, padding)
# ----------------------------------------------------------------------------------------------
# numpy needs ~6 passes over every [B, L] block (gather, clamp, cast, pad mask, OOB compare, fix) plus
# Python work per column; these C loops do one pass, reading the Arrow buffers directly, one call per
# batch (pcvr_convert_batch: the RecordBatch exported through the Arrow C data interface, no Python per
# column; the list-order check fused into each domain's row loop). The source is convert_native.c beside
# this file; it is compiled on first use with the system C compiler into the data cache directory (keyed
# by source, flags and CPU) and loaded with ctypes. backend="numpy" never uses it.

NATIVE_SOURCE = Path(__file__).with_name("convert_native.c")
_NATIVE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
_native_state: dict = {}


def _cpu_id() -> str:
    """The CPU model and feature flags (part of the build key: -march=native code is CPU specific)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))  # first model name and flags lines, once each
    except OSError:
        return platform.processor()


def native_library():
    """The compiled kernels (ctypes.CDLL), building them on first use; raises NativeUnavailable."""
    if "lib" in _native_state:
        return _native_state["lib"]
    if "error" in _native_state:
        raise NativeUnavailable(_native_state["error"])
    try:
        _native_state["lib"] = _build_native()
    except Exception as exc:  # no compiler, failed build, unloadable library
        _native_state["error"] = f"{type(exc).__name__}: {exc}"
        raise NativeUnavailable(_native_state["error"]) from exc
    return _native_state["lib"]


def _build_native():
    from pcvr_lib.data.generate import default_cache_dir

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc/gcc) on PATH")
    source_text = NATIVE_SOURCE.read_text()
    key = hashlib.sha256(
        "\n".join([source_text, " ".join(_NATIVE_FLAGS), compiler, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    folder = default_cache_dir() / "native"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pcvr_convert_{key}.so"
    if not path.exists():
        source = folder / f"pcvr_convert_{key}.c"
        source.write_text(source_text)  # the exact text hashed, beside the library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *_NATIVE_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120
            )
            if done.returncode:
                raise NativeUnavailable(f"{compiler} failed: {done.stderr.strip()[:500]}")
            os.replace(tmp, path)  # atomic: concurrent builders (DataLoader workers) agree
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pcvr_list_order.argtypes = [i64, p, p, i64, p, p]
    lib.pcvr_list_order.restype = None
    lib.pcvr_convert_batch.argtypes = [p, p, p, p, p, i64, i64, i64, p, p, p, p]
    lib.pcvr_convert_batch.restype = i64
    lib.pcvr_release.argtypes = [p]
    lib.pcvr_release.restype = None
    return lib


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.__array_interface__["data"][0]


class _ArenaPool:
    """Output memory for batches, recycled once a batch is gone.

    All big output arrays of one batch are views into one uint8 arena. Fresh memory costs a page fault per
    page on first write (about as much as the conversion itself: the allocator returns freed 20 MB blocks
    to the system), so up to `size` arenas are kept and one is reused when nothing refers to it any more:
    no Batch tensor, view or numpy array made from it is alive (its reference count says so)."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.arenas: list[np.ndarray] = []
        self.free_refs: list[int] = []
        self.lock = threading.Lock()  # one Converter may serve several loader threads
        self.layouts: dict[tuple, tuple[int, dict[str, tuple[int, np.dtype, tuple[int, ...]]]]] = {}

    def views(self, shapes: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> tuple[dict[str, np.ndarray], int]:
        """The output arrays of one batch, views of one free arena, and the arena's address."""
        with self.lock:  # choosing an arena and making its views must not interleave with another thread
            return self._views(shapes)

    def _views(self, shapes: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> tuple[dict[str, np.ndarray], int]:
        key = tuple((name, shape) for name, (_, shape) in shapes.items())
        if key not in self.layouts:
            offset, layout = 0, {}
            for name, (dt, shape) in shapes.items():
                layout[name] = (offset, np.dtype(dt), shape)
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                offset += -(-nbytes // 64) * 64  # 64-byte aligned
            self.layouts[key] = (max(offset, 64), layout)
        total, layout = self.layouts[key]
        arena = None
        for i in range(len(self.arenas)):
            # free when its reference count is back to the count it had with no views (measured the same
            # way: the list's reference and getrefcount's argument)
            if self.arenas[i].size == total and sys.getrefcount(self.arenas[i]) == self.free_refs[i]:
                arena = self.arenas[i]
                break
        if arena is None:
            slot = len(self.arenas) if len(self.arenas) < self.size else None
            if slot is None:  # replace a pooled arena of another size (batch sizes change at a file's end)
                slot = next((i for i in range(len(self.arenas)) if self.arenas[i].size != total), None)
            if slot is None:
                arena = np.empty(total, dtype=np.uint8)  # every pooled arena is in use: not pooled
            else:
                if slot == len(self.arenas):
                    self.arenas.append(None)
                    self.free_refs.append(0)
                self.arenas[slot] = np.empty(total, dtype=np.uint8)
                self.free_refs[slot] = sys.getrefcount(self.arenas[slot])
                arena = self.arenas[slot]
        views = {name: np.ndarray(shape, dtype=dt, buffer=arena, offset=o) for name, (o, dt, shape) in layout.items()}
        return views, _ptr(arena)


class Converter:
    """Converts Arrow record batches / tables of PCVR data into `Batch`es for one schema.

    `stats` counts rows, batches, out-of-vocab values (total, per group, per column) and null user ids;
    `strict_time_filter`, `training` and `clip_oov` are attributes and are repeated in `stats`.
    """

    def __init__(
        self,
        schema: Schema,
        *,
        training: bool = True,
        strict_time_filter: bool = False,
        clip_oov: bool = True,
        backend: str = "auto",
        list_order: str = "auto",
        non_monotonic: str = "sort",
        strict_on_eval: bool = False,
    ) -> None:
        self.schema = schema
        check_order_options(list_order, non_monotonic)
        self.list_order = list_order
        self.non_monotonic = non_monotonic
        self.training = bool(training)
        # strict filtering belongs to training batches; with training=False only when asked by name
        self.strict_time_filter = bool(strict_time_filter) and (self.training or bool(strict_on_eval))
        self.clip_oov = bool(clip_oov)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.native_unavailable = None  # why "auto" chose numpy, when it did
        self._lib = None
        if backend in ("auto", "native"):
            try:
                self._lib = native_library()
            except NativeUnavailable as exc:
                if backend == "native":
                    raise
                self.native_unavailable = str(exc)
        self.backend = "native" if self._lib is not None else "numpy"
        self.expected = expected_columns(schema)
        self._checked: pa.Schema | None = None
        for feat in schema.user_int + schema.item_int + tuple(f for d in schema.domains for f in d.side_features):
            if feat.vocab_size > INT32_MAX:
                raise ValueError(
                    f"column {feat.column!r}: vocab_size {feat.vocab_size} does not fit the int32 ids of a Batch"
                )
        self._scalars = {side: [f for f in schema.int_group(side) if f.dim == 1] for side in ("user", "item")}
        self._lists_int = {side: [f for f in schema.int_group(side) if f.dim > 1] for side in ("user", "item")}
        self._scalar_vocab = {
            side: np.array([f.vocab_size for f in feats], dtype=np.int64) for side, feats in self._scalars.items()
        }
        self._scalar_offsets = {
            side: np.array([f.offset for f in feats], dtype=np.int64) for side, feats in self._scalars.items()
        }
        self._side_vocab = {d.name: d.side_vocab.astype(np.int64) for d in schema.domains}
        self._pool = _ArenaPool()
        self._shape_cache: dict[int, dict] = {}
        i64 = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        self._list_dims = {side: i64([f.dim for f in fs]) for side, fs in self._lists_int.items()}
        self._list_vocab = {side: i64([f.vocab_size for f in fs]) for side, fs in self._lists_int.items()}
        self._list_pos = {side: i64([f.offset for f in fs]) for side, fs in self._lists_int.items()}
        self._dense_dims = {side: i64([f.dim for f in schema.dense_group(side)]) for side in ("user", "item")}
        self._dense_pos = {side: i64([f.offset for f in schema.dense_group(side)]) for side in ("user", "item")}
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
            "backend": self.backend,
            "list_order": self.list_order,
            "non_monotonic": self.non_monotonic,
            # per domain: rows by detected order ("auto"), or rows taken in the given order ("given")
            "list_order_rows": {
                d.name: dict.fromkeys((*ORDER_CLASSES, "given"), 0) for d in self.schema.domains
            },
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
            self._index = {name: data.schema.get_field_index(name) for name in self.expected}
            if self._lib is not None:
                self._native_spec(data.schema)
        rows = data.num_rows
        native = self._lib is not None and rows > 0
        # the native path reads the other columns in C; the numpy path takes them all here
        names = ("timestamp", "label_type", "user_id") if native else self._index
        cols = {name: _column(data, self._index[name]) for name in names}

        ts_arr = cols["timestamp"]
        if ts_arr.null_count:
            row = int(np.flatnonzero(ts_arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"column 'timestamp': {ts_arr.null_count} null request timestamp(s) (first in row {row}); "
                "every row needs its request timestamp"
            )
        request_ts = _buffer(ts_arr, np.int64).copy()

        if self.training:
            label = labels_from_label_type(cols["label_type"])
        else:
            label = np.zeros(rows, dtype=np.float32)

        uid_arr = cols["user_id"]
        user_id = _buffer(uid_arr, np.int64).copy()
        null = _nulls(uid_arr)
        if null is not None:
            user_id[null] = NULL_USER_ID
            self.stats["null_user_id"] += int(null.sum())

        out, base = self._pool.views(self._shapes(rows))
        if native:
            self._convert_native(data, out, base, request_ts, row_offset)
        else:
            for side in ("user", "item"):
                self._features(side, cols, rows, out)
            for d in self.schema.domains:
                self._domain_numpy(d, cols, request_ts, rows, out, row_offset)
        user, item = (
            FeatureBlock(*(torch.from_numpy(out[f"{side}.{k}"]) for k in FEATURE_ARRAYS)) for side in ("user", "item")
        )
        sequences = {
            d.name: SequenceBlock(*(torch.from_numpy(out[f"{d.name}.{k}"]) for k in SEQUENCE_ARRAYS))
            for d in self.schema.domains
        }

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

    def _shapes(self, rows: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The big output arrays of a batch of `rows` rows (allocated together, see _ArenaPool)."""
        if rows in self._shape_cache:
            return self._shape_cache[rows]
        shapes = {}
        for side in ("user", "item"):
            width, dwidth = self.schema.int_width(side), self.schema.dense_width(side)
            shapes[f"{side}.int_values"] = (np.int32, (rows, width))
            shapes[f"{side}.int_missing"] = (np.bool_, (rows, width))
            shapes[f"{side}.dense_values"] = (np.float32, (rows, dwidth))
            shapes[f"{side}.dense_missing"] = (np.bool_, (rows, dwidth))
        for d in self.schema.domains:
            shapes[f"{d.name}.values"] = (np.int32, (rows, len(d.side_features), d.max_len))
            shapes[f"{d.name}.timestamps"] = (np.int64, (rows, d.max_len))
            shapes[f"{d.name}.lengths"] = (np.int32, (rows,))
        if len(self._shape_cache) > 8:
            self._shape_cache.clear()
        self._shape_cache[rows] = shapes
        return shapes

    # ------------------------------------------------------------------------------------------
    def _native_spec(self, arrow_schema: pa.Schema) -> None:
        """What pcvr_convert_batch reads (column positions in batches of this Arrow schema, vocabularies,
        output positions) as int64 arrays, and the (group, column) of each out-of-vocabulary counter."""
        index, schema = self._index, self.schema
        feat, slots = [], []
        for side in ("user", "item"):
            scalars, lists, dense = self._scalars[side], self._lists_int[side], schema.dense_group(side)
            feat.append(len(scalars))
            for f in scalars:
                feat += [index[f.column], f.vocab_size, f.offset]
            feat.append(len(lists))
            for f in lists:
                feat += [index[f.column], f.dim, f.vocab_size, f.offset]
            feat.append(len(dense))
            for f in dense:
                feat += [index[f.column], f.dim, f.offset]
            feat += [schema.int_width(side), schema.dense_width(side)]
            slots += [(f"{side}_int", f.column) for f in scalars + lists]
        dom = [len(schema.domains)]
        for d in schema.domains:
            dom += [index[d.ts_feature.column], d.max_len, len(d.side_features)]
            for f in d.side_features:
                dom += [index[f.column], f.vocab_size]
            slots += [(d.name, f.column) for f in d.side_features]
        self._spec_feat, self._spec_dom = np.array(feat, dtype=np.int64), np.array(dom, dtype=np.int64)
        self._spec_ptrs = (_ptr(self._spec_feat), _ptr(self._spec_dom))
        self._out_offsets: dict[int, np.ndarray] = {}
        self._oob_slots = slots
        self._out_names = [f"{side}.{k}" for side in ("user", "item") for k in FEATURE_ARRAYS] + [
            f"{d.name}.{k}" for d in schema.domains for k in SEQUENCE_ARRAYS
        ]
        self._dense_columns = {f.column for f in schema.user_dense + schema.item_dense}
        # large_list columns (int64 offsets) are cast to list (int32 offsets), what the kernels read
        self._large_lists = [i for i, field in enumerate(arrow_schema) if pa.types.is_large_list(field.type)]

    def _record_batch(self, data: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
        """The data as one RecordBatch with int32 list offsets (a table's chunks are combined)."""
        if isinstance(data, pa.Table):
            batches = data.to_batches()
            if len(batches) != 1:
                batches = data.combine_chunks().to_batches()
            data = batches[0]
        if self._large_lists:
            arrays = data.columns
            for i in self._large_lists:
                try:
                    arrays[i] = arrays[i].cast(pa.list_(arrays[i].type.value_type))
                except pa.ArrowInvalid as exc:
                    raise DataError(
                        f"column {data.schema.names[i]!r}: more than 2**31 list elements in one batch"
                    ) from exc
            data = pa.RecordBatch.from_arrays(arrays, names=data.schema.names)
        return data

    def _convert_native(self, data, out: dict, base: int, request_ts: np.ndarray, row_offset: int) -> None:
        """Every user / item feature and sequence domain of a batch (rows > 0) in one C call, which walks the
        RecordBatch's buffers through the Arrow C data interface (no Python per column)."""
        rb = self._record_batch(data)
        domains = self.schema.domains
        oob = np.empty(len(self._oob_slots), dtype=np.int64)
        classes = np.zeros((len(domains), 4), dtype=np.int64)
        child_nulls = np.zeros(rb.num_columns, dtype=np.int8)
        bad = np.zeros(3, dtype=np.int64)
        rows = rb.num_rows
        if rows not in self._out_offsets:  # the arena layout is fixed per batch size
            self._out_offsets[rows] = np.array([_ptr(out[name]) - base for name in self._out_names], dtype=np.int64)
        outs = self._out_offsets[rows] + base
        mode = {"auto": 0, "newest-last": 1, "newest-first": -1}[self.list_order]
        exported = _ArrowArrayStruct()
        rb._export_to_c(ctypes.addressof(exported))
        try:
            status = self._lib.pcvr_convert_batch(
                ctypes.addressof(exported), *self._spec_ptrs, _ptr(outs), _ptr(request_ts),
                int(self.strict_time_filter), mode, int(self.non_monotonic == "sort"),
                _ptr(oob), _ptr(classes), _ptr(child_nulls), _ptr(bad),
            )  # fmt: skip
        finally:
            self._lib.pcvr_release(ctypes.addressof(exported))
        if status < 0:
            raise MemoryError("pcvr_convert_batch: out of memory")
        for i in np.flatnonzero(child_nulls).tolist():  # raises when a row uses a null element
            name = rb.schema.names[i]
            _lists(rb.column(i), name, np.float32 if name in self._dense_columns else np.int64)
        for d, counts in zip(domains, classes.tolist(), strict=True):
            stats = self.stats["list_order_rows"][d.name]
            if mode:
                stats["given"] += rb.num_rows
            else:
                for name, n in zip(ORDER_CLASSES, counts, strict=True):
                    stats[name] += n
        if status == 1:
            raise _non_monotonic_error(domains[int(bad[0])].ts_feature.column, row_offset + int(bad[1]), int(bad[2]))
        if oob.any():
            if not self.clip_oov:  # the numpy backend raises naming the column, the value and the row
                self._numpy_twin()(data, row_offset)
                raise AssertionError("native and numpy converters disagree on out-of-vocabulary ids")
            per_group, per_feature = self.stats["oob_per_group"], self.stats["oob_per_feature"]
            for i in np.flatnonzero(oob).tolist():
                group, column = self._oob_slots[i]
                n = int(oob[i])
                per_group[group] += n
                per_feature[column] = per_feature.get(column, 0) + n
            self.stats["oob_total"] += int(oob.sum())

    def _numpy_twin(self) -> Converter:
        """A numpy-backend converter with the same settings (to raise the named out-of-vocabulary error)."""
        return Converter(
            self.schema, training=self.training, strict_time_filter=self.strict_time_filter,
            clip_oov=self.clip_oov, backend="numpy", list_order=self.list_order, non_monotonic=self.non_monotonic,
            strict_on_eval=True,
        )  # fmt: skip

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
            raw[:, i] = _buffer(arr, np.int64)
            null = _nulls(arr)
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
            lists = _lists(cols[feat.column], feat.column, np.int64)
            # the first dim elements: these lists are not time-ordered
            self._int_list_numpy(group, feat, lists, _head_plan(lists, feat.dim), values, missing)
        for feat in schema.dense_group(side):
            lists = _lists(cols[feat.column], feat.column, np.float32)
            plan = _head_plan(lists, feat.dim)
            target = slice(feat.offset, feat.offset + feat.dim)
            v = _gather(lists.values, plan)
            ok = np.isfinite(v)
            if plan.padded:
                ok &= plan.keep()
            dense[:, target] = np.where(ok, v, np.float32(0))
            np.logical_not(ok, out=dmissing[:, target])

    def _int_list_numpy(self, group: str, feat, lists: _Lists, plan: _Plan, values, missing) -> None:
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
    def _strict_plan(self, ts: _Lists, request_ts: np.ndarray, L: int) -> _Plan:
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
    def _strict_rows_full(ts: _Lists, request_ts, L: int, rows: np.ndarray, rel, count) -> None:
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

    def _side_plan(self, lists: _Lists, ts: _Lists, base: _Plan, L: int) -> _Plan:
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
        cls = _classify_numpy(_lists(cols[column], column, np.int64))
        per_class = np.bincount(cls, minlength=4)
        for name, n in zip(ORDER_CLASSES, per_class.tolist(), strict=True):
            counts[name] += n
        if per_class[NEWEST_LAST] == rows:
            return None, None, None
        if per_class[NON_MONOTONIC] and self.non_monotonic == "error":
            row = int(np.flatnonzero(cls == NON_MONOTONIC)[0])
            raise _non_monotonic_error(column, row_offset + row, int(per_class[NON_MONOTONIC]))
        # rows too short to tell take the batch's majority order (newest last on a tie)
        majority = -1 if per_class[NEWEST_FIRST] > per_class[NEWEST_LAST] else 1
        order = np.choose(cls, [majority, 1, -1, 2]).astype(np.int8)
        perm_start = perm = None
        if per_class[NON_MONOTONIC]:
            ts = _lists(cols[column], column, np.int64)
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
        ts = _lists(cols[domain.ts_feature.column], domain.ts_feature.column, np.int64)
        order, perm_start, perm = self._row_order(domain, cols, rows, row_offset)
        side_lists = [_lists(cols[f.column], f.column, np.int64, like=ts) for f in side]
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
