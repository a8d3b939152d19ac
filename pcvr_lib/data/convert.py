"""Arrow RecordBatch / Table -> Batch (data.md section 2).

Two backends with the same results (tested against a per-row reference): "native", C kernels that walk
the RecordBatch's buffers through the Arrow C data interface, one call per batch (compiled on first use,
`convert_native`), and "numpy", vectorised with Arrow offsets, sliding-window views and numpy
(`convert_numpy`). The default "auto" takes native when it builds here. Output arrays of a batch share one
recycled arena (`_ArenaPool`). One converter may be shared by threads (the kernels release the GIL).
This module is the converter's public API (`__all__`); `arrow_lists` reads Arrow columns for both
backends, `list_order` tells each row's list order.

Semantics (see notes/data-convert.md for the decisions and where they differ from the reference):
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
import sys
import threading

import numpy as np
import pyarrow as pa
import torch

from pcvr_lib.data.arrow_lists import address_of, column_array, list_column, null_mask, primitive_values
from pcvr_lib.data.batch import Batch, FeatureBlock, SequenceBlock
from pcvr_lib.data.convert_native import ArrowArrayStruct, NativeUnavailable, native_library
from pcvr_lib.data.convert_numpy import NumpyConversion, OutOfVocabError
from pcvr_lib.data.list_order import (
    LIST_ORDERS,
    NON_MONOTONIC_POLICIES,
    ORDER_CLASSES,
    check_order_options,
    classify_list_order,
    non_monotonic_error,
)
from pcvr_lib.data.parquet import DataError, check_arrow_schema, expected_columns
from pcvr_lib.errors import warn
from pcvr_lib.schema import Schema

# the converter's public API (some defined in the modules it is made of)
__all__ = [
    "BACKENDS",
    "LIST_ORDERS",
    "NON_MONOTONIC_POLICIES",
    "NULL_USER_ID",
    "ORDER_CLASSES",
    "Converter",
    "NativeUnavailable",
    "OutOfVocabError",
    "check_order_options",
    "classify_list_order",
    "labels_from_label_type",
    "native_library",
]

NULL_USER_ID = -1
# "auto": the native kernels when they build here, else numpy (recorded in Converter.backend / stats)
BACKENDS = ("auto", "native", "numpy")

# the output arrays of a side's features and of a domain, in FeatureBlock / SequenceBlock field order
FEATURE_ARRAYS = ("int_values", "int_missing", "dense_values", "dense_missing")
SEQUENCE_ARRAYS = ("values", "timestamps", "lengths")


_fallback_warned: list[str] = []  # the numpy fallback is said once per process


def _warn_numpy_fallback(reason: str) -> None:
    """backend="auto" without the native kernels: say so (once per process), since every conversion is then
    several times slower (a benchmark would time the numpy path)."""
    if not _fallback_warned:
        _fallback_warned.append(reason)
        warn(f"the converter's native C kernels are unavailable ({reason}); converting with the slower numpy path")


def labels_from_label_type(label_type: pa.Array) -> np.ndarray:
    """The label rule: float32 1.0 where the int32 label_type is 2, else 0.0 (null included)."""
    label = (primitive_values(label_type, np.int32) == 2).astype(np.float32)
    null = null_mask(label_type)
    if null is not None:
        label[null] = 0.0
    return label


class _ArenaPool:
    """Output memory for batches, recycled once a batch is gone.

    All big output arrays of one batch are views into one uint8 arena. Fresh memory costs a page fault per
    page on first write (about as much as the conversion itself: the allocator returns freed 20 MB blocks
    to the system), so up to `size` arenas are kept and one is reused when nothing refers to it any more:
    no Batch tensor, view or numpy array made from it is alive (its reference count says so).
    With a `source` (an object whose `take(nbytes, rows)` returns a free uint8 array of at least nbytes,
    or None), the arena comes from it first: the loader's workers convert into their shared-memory ring."""

    def __init__(self, size: int = 3, source=None) -> None:
        self.size = size
        self.source = source
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
        rows = next(iter(shapes.values()))[1][0]
        arena = self.source.take(total, rows) if self.source is not None else None
        if arena is None:
            arena = self._pooled(total)
        views = {name: np.ndarray(shape, dtype=dt, buffer=arena, offset=o) for name, (o, dt, shape) in layout.items()}
        return views, address_of(arena)

    def _pooled(self, total: int) -> np.ndarray:
        """A free pooled arena of `total` bytes (a new one where none is)."""
        for i in range(len(self.arenas)):
            # free when its reference count is back to the count it had with no views (measured the same
            # way: the list's reference and getrefcount's argument)
            if self.arenas[i].size == total and sys.getrefcount(self.arenas[i]) == self.free_refs[i]:
                return self.arenas[i]
        slot = len(self.arenas) if len(self.arenas) < self.size else None
        if slot is None:  # replace a pooled arena of another size (batch sizes change at a file's end)
            slot = next((i for i in range(len(self.arenas)) if self.arenas[i].size != total), None)
        if slot is None:
            return np.empty(total, dtype=np.uint8)  # every pooled arena is in use: not pooled
        if slot == len(self.arenas):
            self.arenas.append(None)
            self.free_refs.append(0)
        self.arenas[slot] = np.empty(total, dtype=np.uint8)
        self.free_refs[slot] = sys.getrefcount(self.arenas[slot])
        return self.arenas[slot]


class Converter(NumpyConversion):
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
        arena_source=None,
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
                _warn_numpy_fallback(self.native_unavailable)
        self.backend = "native" if self._lib is not None else "numpy"
        self.expected = expected_columns(schema)
        self._checked: pa.Schema | None = None
        self._scalars = {side: [f for f in schema.int_group(side) if f.dim == 1] for side in ("user", "item")}
        self._lists_int = {side: [f for f in schema.int_group(side) if f.dim > 1] for side in ("user", "item")}
        self._scalar_vocab = {
            side: np.array([f.vocab_size for f in feats], dtype=np.int64) for side, feats in self._scalars.items()
        }
        self._scalar_offsets = {
            side: np.array([f.offset for f in feats], dtype=np.int64) for side, feats in self._scalars.items()
        }
        self._side_vocab = {d.name: d.side_vocab.astype(np.int64) for d in schema.domains}
        self._pool = _ArenaPool(source=arena_source)  # arena_source: see _ArenaPool (the loader's workers)
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
        cols = {name: column_array(data, self._index[name]) for name in names}

        ts_arr = cols["timestamp"]
        if ts_arr.null_count:
            row = int(np.flatnonzero(ts_arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"column 'timestamp': {ts_arr.null_count} null request timestamp(s) (first in row {row}); "
                "every row needs its request timestamp"
            )
        request_ts = primitive_values(ts_arr, np.int64).copy()

        if self.training:
            label = labels_from_label_type(cols["label_type"])
        else:
            label = np.zeros(rows, dtype=np.float32)

        uid_arr = cols["user_id"]
        user_id = primitive_values(uid_arr, np.int64).copy()
        null = null_mask(uid_arr)
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
        self._spec_ptrs = (address_of(self._spec_feat), address_of(self._spec_dom))
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
            self._out_offsets[rows] = np.array(
                [address_of(out[name]) - base for name in self._out_names], dtype=np.int64
            )
        outs = self._out_offsets[rows] + base
        mode = {"auto": 0, "newest-last": 1, "newest-first": -1}[self.list_order]
        exported = ArrowArrayStruct()
        rb._export_to_c(ctypes.addressof(exported))
        try:
            status = self._lib.pcvr_convert_batch(
                ctypes.addressof(exported), *self._spec_ptrs, address_of(outs), address_of(request_ts),
                int(self.strict_time_filter), mode, int(self.non_monotonic == "sort"),
                address_of(oob), address_of(classes), address_of(child_nulls), address_of(bad),
            )  # fmt: skip
        finally:
            self._lib.pcvr_release(ctypes.addressof(exported))
        if status < 0:
            raise MemoryError("pcvr_convert_batch: out of memory")
        for i in np.flatnonzero(child_nulls).tolist():  # raises when a row uses a null element
            name = rb.schema.names[i]
            list_column(rb.column(i), name, np.float32 if name in self._dense_columns else np.int64)
        for d, counts in zip(domains, classes.tolist(), strict=True):
            stats = self.stats["list_order_rows"][d.name]
            if mode:
                stats["given"] += rb.num_rows
            else:
                for name, n in zip(ORDER_CLASSES, counts, strict=True):
                    stats[name] += n
        if status == 1:
            raise non_monotonic_error(domains[int(bad[0])].ts_feature.column, row_offset + int(bad[1]), int(bad[2]))
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
