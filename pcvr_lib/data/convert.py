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

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

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
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + n)[array.offset :]


def _nulls(array: pa.Array) -> np.ndarray | None:
    """Bool mask of null slots, or None when there are none (unpacked from the validity bitmap)."""
    if array.null_count == 0:
        return None
    n, off = len(array), array.offset
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8, count=(off + n + 7) // 8)
    return np.unpackbits(bits, count=off + n, bitorder="little")[off:] == 0


@dataclass
class _Lists:
    """A list column as numpy: absolute start offsets into `values`, lengths (null rows 0), flat values."""

    offsets: np.ndarray  # the raw offsets [B+1] (to detect columns laid out like another)
    starts: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    values: np.ndarray
    has_nulls: bool


def _lists(array: pa.Array, name: str, dtype: np.dtype) -> _Lists:
    n, off = len(array), array.offset
    width = np.int64 if pa.types.is_large_list(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=width, count=off + n + 1)[off:]
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets).astype(np.int64)
    null = _nulls(array)
    if null is not None:
        lengths[null] = 0
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
    return _Lists(offsets, starts, lengths, _buffer(child, dtype), null is not None)


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
# numpy needs ~6 passes over every [B, L] block (gather, clamp, cast, pad mask, OOB compare, fix); this
# C loop does one. It is compiled on first use with the system C compiler into the data cache directory
# (keyed by source, flags and CPU) and loaded with ctypes. backend="numpy" never uses it.

_NATIVE_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Element j < count[b] of row b is src[start[b] + j] (rel == 0) or src[start[b] + rel[b*L + j]]; with
   limit != 0, rel >= limit[b] is padding. Positions >= count[b] are padding (0). */

/* Sequence tokens into out[b*stride + j]: <= 0 -> 0, >= vocab -> 0 and counted; vocab <= 0 zeroes all.
   Returns the number of out-of-vocab tokens. */
int64_t pcvr_tokens(const int64_t *src, const int64_t *start, const int64_t *count, const int64_t *rel,
                    const int64_t *limit, int64_t rows, int64_t L, int64_t vocab, int32_t *out,
                    int64_t stride) {
    int64_t oob = 0;
    for (int64_t b = 0; b < rows; b++) {
        int32_t *o = out + b * stride;
        int64_t k = count[b] < L ? count[b] : L;
        int64_t n = 0;
        const int64_t *x = src + start[b];
        if (vocab <= 0) {
            k = 0;
        } else if (rel) {
            const int64_t *r = rel + b * L;
            const int64_t lim = limit ? limit[b] : INT64_MAX;
            for (int64_t j = 0; j < k; j++) {
                int64_t v = r[j] < lim ? x[r[j]] : 0;
                n += v >= vocab;
                o[j] = (v > 0 && v < vocab) ? (int32_t)v : 0;
            }
        } else {
            for (int64_t j = 0; j < k; j++) {
                int64_t v = x[j];
                n += v >= vocab;
                o[j] = (v > 0 && v < vocab) ? (int32_t)v : 0;
            }
        }
        oob += n;
        if (k < L) memset(o + k, 0, (size_t)(L - k) * sizeof(int32_t));
    }
    return oob;
}

/* Raw copy (timestamps) into out[b*L + j]. */
void pcvr_copy_rows(const int64_t *src, const int64_t *start, const int64_t *count, const int64_t *rel,
                    int64_t rows, int64_t L, int64_t *out) {
    for (int64_t b = 0; b < rows; b++) {
        int64_t *o = out + b * L;
        int64_t k = count[b] < L ? count[b] : L;
        const int64_t *x = src + start[b];
        if (rel) {
            const int64_t *r = rel + b * L;
            for (int64_t j = 0; j < k; j++) o[j] = x[r[j]];
        } else if (k > 0) {
            memcpy(o, x, (size_t)k * sizeof(int64_t));
        }
        if (k < L) memset(o + k, 0, (size_t)(L - k) * sizeof(int64_t));
    }
}

/* Strict filter: per row the last L events with 0 < ts < request[b], oldest first, as event numbers
   within the row (rel[b*L + p]); count[b] of them. Scans back from the newest event only as far as
   needed. */
void pcvr_strict_plan(const int64_t *ts, const int64_t *start, const int64_t *length, const int64_t *request,
                      int64_t rows, int64_t L, int64_t *rel, int64_t *count) {
    for (int64_t b = 0; b < rows; b++) {
        const int64_t *t = ts + start[b];
        const int64_t req = request[b];
        int64_t *r = rel + b * L;
        int64_t j = length[b] - 1, k = 0;
        for (; j >= 0 && k < L; j--) k += (t[j] > 0 && t[j] < req);
        int64_t p = 0;
        for (int64_t i = j + 1; i < length[b]; i++)
            if (t[i] > 0 && t[i] < req) r[p++] = i;
        count[b] = k;
        if (p < L) memset(r + p, 0, (size_t)(L - p) * sizeof(int64_t));
    }
}

/* Width>1 int feature: the first dim elements into out/miss[b*stride + j]; <= 0 and padding -> 0 and
   missing; >= vocab -> 0, missing and counted; vocab <= 0 -> all 0 and missing. Returns the OOB count. */
int64_t pcvr_int_head(const int64_t *src, const int64_t *start, const int64_t *count, int64_t rows,
                      int64_t dim, int64_t vocab, int32_t *out, uint8_t *miss, int64_t stride) {
    int64_t oob = 0;
    for (int64_t b = 0; b < rows; b++) {
        int32_t *o = out + b * stride;
        uint8_t *m = miss + b * stride;
        int64_t k = vocab <= 0 ? 0 : (count[b] < dim ? count[b] : dim);
        const int64_t *x = src + start[b];
        for (int64_t j = 0; j < k; j++) {
            int64_t v = x[j];
            int ok = v > 0 && v < vocab;
            oob += v >= vocab;
            o[j] = ok ? (int32_t)v : 0;
            m[j] = !ok;
        }
        for (int64_t j = k; j < dim; j++) { o[j] = 0; m[j] = 1; }
    }
    return oob;
}

/* Dense feature: the first dim floats into out/miss[b*stride + j]; non-finite and padding -> 0, missing. */
void pcvr_dense_head(const float *src, const int64_t *start, const int64_t *count, int64_t rows, int64_t dim,
                     float *out, uint8_t *miss, int64_t stride) {
    for (int64_t b = 0; b < rows; b++) {
        float *o = out + b * stride;
        uint8_t *m = miss + b * stride;
        int64_t k = count[b] < dim ? count[b] : dim;
        const float *x = src + start[b];
        for (int64_t j = 0; j < k; j++) {
            float v = x[j];
            int ok = (v - v) == 0.0f; /* false for NaN and +-inf */
            o[j] = ok ? v : 0.0f;
            m[j] = !ok;
        }
        for (int64_t j = k; j < dim; j++) { o[j] = 0.0f; m[j] = 1; }
    }
}
"""
_NATIVE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
_native_state: dict = {}


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
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
    key = hashlib.sha256(
        "\n".join([_NATIVE_SOURCE, " ".join(_NATIVE_FLAGS), compiler, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    folder = default_cache_dir() / "native"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pcvr_convert_{key}.so"
    if not path.exists():
        source = folder / f"pcvr_convert_{key}.c"
        source.write_text(_NATIVE_SOURCE)
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
    lib.pcvr_tokens.argtypes = [p, p, p, p, p, i64, i64, i64, p, i64]
    lib.pcvr_tokens.restype = i64
    lib.pcvr_copy_rows.argtypes = [p, p, p, p, i64, i64, p]
    lib.pcvr_copy_rows.restype = None
    lib.pcvr_strict_plan.argtypes = [p, p, p, p, i64, i64, p, p]
    lib.pcvr_strict_plan.restype = None
    lib.pcvr_int_head.argtypes = [p, p, p, i64, i64, i64, p, p, i64]
    lib.pcvr_int_head.restype = i64
    lib.pcvr_dense_head.argtypes = [p, p, p, i64, i64, p, p, i64]
    lib.pcvr_dense_head.restype = None
    return lib


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.__array_interface__["data"][0]


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
    ) -> None:
        self.schema = schema
        self.training = bool(training)
        self.strict_time_filter = bool(strict_time_filter)
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

    def _features(self, side: str, cols: dict[str, pa.Array], rows: int) -> FeatureBlock:
        schema = self.schema
        group = f"{side}_int"
        width = schema.int_width(side)
        values = np.empty((rows, width), dtype=np.int32)
        missing = np.empty((rows, width), dtype=bool)
        self._scalar_ints(side, cols, values, missing)

        for feat in self._lists_int[side]:
            lists = _lists(cols[feat.column], feat.column, np.int64)
            plan = _head_plan(lists, feat.dim)  # first dim elements: these lists are not time-ordered
            target = slice(feat.offset, feat.offset + feat.dim)
            if self._lib is not None:
                n_oob = self._lib.pcvr_int_head(
                    _ptr(lists.values), _ptr(plan.start), _ptr(plan.count), rows, feat.dim, feat.vocab_size,
                    _ptr(values[:, target]), _ptr(missing[:, target]), width,
                )  # fmt: skip
                if n_oob and not self.clip_oov:
                    self._int_list_numpy(group, feat, lists, plan, values, missing)  # raises with the value
                self._count_oob(group, feat.column, n_oob)
            else:
                self._int_list_numpy(group, feat, lists, plan, values, missing)

        dwidth = schema.dense_width(side)
        dense = np.empty((rows, dwidth), dtype=np.float32)
        dmissing = np.empty((rows, dwidth), dtype=bool)
        for feat in schema.dense_group(side):
            lists = _lists(cols[feat.column], feat.column, np.float32)
            plan = _head_plan(lists, feat.dim)
            target = slice(feat.offset, feat.offset + feat.dim)
            if self._lib is not None:
                self._lib.pcvr_dense_head(
                    _ptr(lists.values), _ptr(plan.start), _ptr(plan.count), rows, feat.dim,
                    _ptr(dense[:, target]), _ptr(dmissing[:, target]), dwidth,
                )  # fmt: skip
                continue
            v = _gather(lists.values, plan)
            ok = np.isfinite(v)
            if plan.padded:
                ok &= plan.keep()
            dense[:, target] = np.where(ok, v, np.float32(0))
            np.logical_not(ok, out=dmissing[:, target])

        return FeatureBlock(
            int_values=torch.from_numpy(values),
            int_missing=torch.from_numpy(missing),
            dense_values=torch.from_numpy(dense),
            dense_missing=torch.from_numpy(dmissing),
        )

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
        rel = np.empty((rows, L), dtype=np.int64)
        count = np.empty(rows, dtype=np.int64)
        if self._lib is not None:
            self._lib.pcvr_strict_plan(
                _ptr(ts.values), _ptr(ts.starts), _ptr(ts.lengths), _ptr(request_ts), rows, L, _ptr(rel), _ptr(count)
            )
            return _Plan(ts.starts, count, L, rel)
        rel[:] = 0
        count[:] = 0
        if rows == 0 or len(ts.values) == 0:
            return _Plan(ts.starts, count, L, rel)
        # numpy: scan a tail window of each list first (newest events last, so the kept events are near
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

    def _domain(self, domain, cols: dict[str, pa.Array], request_ts: np.ndarray, rows: int) -> SequenceBlock:
        L = domain.max_len
        side = domain.side_features
        ts = _lists(cols[domain.ts_feature.column], domain.ts_feature.column, np.int64)
        base = self._strict_plan(ts, request_ts, L) if self.strict_time_filter else _tail_plan(ts, L)

        if self._lib is not None:
            timestamps = np.empty((rows, L), dtype=np.int64)
            self._lib.pcvr_copy_rows(
                _ptr(ts.values), _ptr(base.start), _ptr(base.count), _ptr(base.rel), rows, L, _ptr(timestamps)
            )
        else:
            timestamps = _gather(ts.values, base)
            if base.padded:
                timestamps *= base.keep()

        values = np.empty((rows, len(side), L), dtype=np.int32)
        lengths = base.count if (self.strict_time_filter or not side) else np.zeros(rows, dtype=np.int64)
        for f, feat in enumerate(side):
            lists = _lists(cols[feat.column], feat.column, np.int64)
            plan = self._side_plan(lists, ts, base, L)
            if not self.strict_time_filter:
                lengths = np.maximum(lengths, plan.count)
            self._side_values(domain.name, feat, lists.values, plan, values[:, f, :])

        return SequenceBlock(
            values=torch.from_numpy(values),
            timestamps=torch.from_numpy(timestamps),
            lengths=torch.from_numpy(lengths.astype(np.int32)),
        )

    def _side_values(self, group: str, feat, source: np.ndarray, plan: _Plan, out: np.ndarray) -> None:
        """out [B, L] int32 (a view into the domain's values) = the feature's tokens: <= 0 and padding
        -> 0, out-of-vocab counted then 0 (or raised), vocab 0 -> all 0."""
        if self._lib is not None:
            rows, L = out.shape
            n_oob = self._lib.pcvr_tokens(
                _ptr(source), _ptr(plan.start), _ptr(plan.count), _ptr(plan.rel), _ptr(plan.limit),
                rows, L, feat.vocab_size, _ptr(out), out.strides[0] // out.itemsize,
            )  # fmt: skip
            if n_oob and not self.clip_oov:
                self._side_values_numpy(group, feat, source, plan, out)  # raises with the value
            self._count_oob(group, feat.column, n_oob)
            return
        self._side_values_numpy(group, feat, source, plan, out)

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
