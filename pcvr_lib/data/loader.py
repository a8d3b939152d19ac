"""The data loader: parquet row groups -> Arrow -> convert -> cache -> split filter -> augment.

Split first, then batch: batches never cross row groups, and within row group g the rows of the chosen
split side are cut into batches b = 0 .. ceil(side rows / batch_size) - 1, keyed (file, g, b); the key is
also the cache key. So every batch holds exactly `batch_size` rows of the side except the last one of each
row group. A batch is converted as the contiguous span of rows from its first to its last side row, then
the rows of the other side are dropped (the converter numbers rows by position). Two modes:

- `sweep`: `passes` scans over the row groups that hold rows of the chosen split side (row-group order
  shuffled per pass by the seed when `shuffle=True`), each batch of a group in order;
- `steps`: `steps` seeded draws of a batch key, with replacement, weighted by the key's rows on the side.

The whole access plan is known before the first batch, so OPT gets the exact future: at the start of every
pass the cache's trace is rebuilt from the rest of the plan (payloads kept, per-sweep counters reset).

Speed: Arrow decoding of the next row groups runs in a read-ahead thread (pyarrow releases the GIL and
decodes columns on its own thread pool) while the calling thread converts, caches and augments, so
conversion hides behind decoding. The reader peeks into the cache (without counting an access) and skips
decoding row groups whose batches are all cached, passing those payloads along by reference; if one is
evicted before its use, the consumer counts the miss but reuses that identical batch instead of decoding
(`stats()["reused_after_eviction"]`). A batch neither decoded ahead nor seen is decoded on the spot in
the consuming thread (`late_reads`; not expected with the peek).
The batch work runs with `torch_threads` intra-op threads (default 1, restored before each batch is
handed out): the copies and masks are memory-bound, and on a small shared machine torch's thread pool
spinning against pyarrow's decoder threads made a 200 KB clone take 13 ms instead of 5 us.
With `num_workers > 0` a torch DataLoader runs the same pipeline in worker processes (batch_size=None,
persistent workers, prefetch 2, pinned memory on CUDA); keys are dealt round-robin, so batches still come
out in plan order. The workers share one cache of the full capacity (`shared_cache.py`): its decisions are
the policy replayed on the whole plan, so they are the single-process loader's, and a batch converted by
one worker is read by another from shared memory without decoding (`stats()["cache"]["per_worker"]`).

Presets (strict_time_filter is explicit here; the reference switched it on whenever any augmentation
was configured, even a no-op one):
    none         no cache
    cache        LRU cache
    opt          OPT (Belady) cache
    augment      LRU + the benchmark augmentations, strict time filter on
    opt-augment  OPT + the benchmark augmentations, strict time filter on
The augment presets keep the strict filter so they measure the same work as the reference's augment
presets (and training never sees events at or after the request time); pass strict_time_filter to change it.
Strict filtering applies to training batches only (training=True and not the valid side); evaluation and
inference batches keep every event unless `strict_on_eval=True` asks for it there too.

List order: `list_order` ("auto": told per row from the event times; or "newest-first" / "newest-last"
for data without usable times) and `non_monotonic` ("sort" / "error") go to the converter; `stats()`
gives the rows per detected order and domain, and the file's order ("list_order_detected").

A row group that cannot be decoded (a corrupt page) raises `CorruptRowGroupError` naming the file and the
row group when the loader first reads it, with the rows already served.
"""

from __future__ import annotations

import bisect
import copy
import queue
import shutil
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pcvr_lib.data.augment import BENCHMARK_AUGMENTATIONS, Augmenter
from pcvr_lib.data.batch import Batch
from pcvr_lib.data.cache import CACHE_POLICIES, make_cache
from pcvr_lib.data.convert import ORDER_CLASSES, Converter, check_order_options
from pcvr_lib.data.parquet import DataError, open_dataset
from pcvr_lib.data.shared_cache import CachePlan, SharedBatchStore
from pcvr_lib.data.split import SIDES, SPLIT_METHODS, SplitPlan, plan_split, splitmix64
from pcvr_lib.schema import Schema, load_schema


@dataclass(frozen=True)
class Preset:
    cache_policy: str
    augmentations: tuple
    strict_time_filter: bool


PRESETS: dict[str, Preset] = {
    "none": Preset("none", (), False),
    "cache": Preset("lru", (), False),
    "opt": Preset("opt", (), False),
    "augment": Preset("lru", BENCHMARK_AUGMENTATIONS, True),
    "opt-augment": Preset("opt", BENCHMARK_AUGMENTATIONS, True),
}
MODES = ("sweep", "steps")

BatchKey = tuple[str, int, int]  # (file, row_group, batch_index)


class LoaderError(ValueError):
    """A loader option is invalid (the message names the option and the allowed values), or the converter
    rejected a batch of the file (the message names the file, the row group and the rows served before it;
    the converter's DataError is the cause)."""


class CorruptRowGroupError(DataError):
    """A row group of the file cannot be decoded (a corrupt page); names the file and the row group."""


def file_list_order(counts: dict[str, int]) -> str:
    """A file's order from its rows per class: "newest-first" / "newest-last" when every monotonic row
    that tells agrees, "mixed" when both occur, "unknown" when none tells, "given" when not checked.
    Not-monotonic rows are counted apart (list_order_rows), they do not make a file mixed."""
    if counts.get("given"):
        return "given"
    first, last = counts["newest_first"], counts["newest_last"]
    if first and last:
        return "mixed"
    return "newest-first" if first else ("newest-last" if last else "unknown")


def _check_int(name: str, value, low: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise LoaderError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _batch_seed(seed: int, pass_index: int, position: int) -> int:
    """A per-batch augmentation seed that does not depend on which process produced the batch."""
    key = np.array([(seed * 1_000_003 + pass_index) * 10_000_019 + position], dtype=np.int64)
    return int(splitmix64(key)[0] >> np.uint64(1))


@dataclass(frozen=True)
class _Converted:
    """A cached payload seen by the read-ahead thread (by reference; never modified)."""

    batch: Batch


def _put(out: queue.Queue, obj, stop: threading.Event) -> None:
    """Put unless the consumer has stopped (so a reader never blocks forever on a full queue)."""
    while not stop.is_set():
        try:
            out.put(obj, timeout=0.1)
            return
        except queue.Full:
            continue


@dataclass
class _Shared:
    """A worker's view of the work shared by all workers: plan position of its k-th item = first + k * step.
    `runs` are the plan's runs of consecutive items of one row group, [start, stop): run r is decoded by
    worker r % workers only, which converts the run's misses of the other workers too and publishes them
    on the store (round-robin dealing would otherwise make every worker decode every row group). The
    owner gets to run r at the latest when asked for its first item at or after the run's start, at most
    workers - 1 positions later, inside the DataLoader's prefetch window (2 x workers), so no worker waits
    on one that waits for it."""

    plan: CachePlan
    store: SharedBatchStore
    first: int
    step: int
    items: list
    runs: list[tuple[int, int]]

    def producer(self, position: int) -> int:
        """The worker that converts the (missed) batch at `position`: the owner of its run."""
        return (bisect.bisect_right(self.run_starts, position) - 1) % self.step

    def __post_init__(self):
        self.run_starts = [start for start, _ in self.runs]


@dataclass(frozen=True)
class _Foreign:
    """A miss of another worker in a run this worker decoded: convert it and publish it for that worker."""

    position: int
    key: BatchKey
    data: pa.Table


class _Pipeline:
    """Produces the batches of a list of (pass, position, key) items; one instance per process."""

    def __init__(self, loader: PcvrLoader, cache_capacity: int, shared: _Shared | None = None):
        self.loader = loader
        self.shared = shared
        self.item_number = 0  # items handed out so far (their plan positions, with `shared`)
        self.shared_hits = self.shared_misses = self.served_by_other_workers = self.shared_writes = 0
        self.converted_for_other_workers = self.converted_by_other_workers = 0
        self.file: pq.ParquetFile | None = None
        self.late_file: pq.ParquetFile | None = None
        self.converter = Converter(
            loader.schema,
            training=loader.training,
            strict_time_filter=loader.strict_time_filter,
            strict_on_eval=True,  # the loader has decided already (training batches only, unless asked)
            list_order=loader.list_order,
            non_monotonic=loader.non_monotonic,
        )
        self.cache = make_cache(loader.cache_policy, cache_capacity, seed=loader.seed)
        self.augmenter = Augmenter(loader.augmentations) if loader.augment_active else None
        self.rows = 0
        self.batch_count = 0
        self.late_reads = 0
        self.reused_after_eviction = 0
        self.groups_read = 0
        self.current_pass: int | None = None

    def _read_group(self, group: int, late: bool = False) -> pa.Table:
        # Handles are opened lazily (DataLoader workers each get their own), and a late read in the
        # consuming thread uses its own handle: a ParquetFile must not be read from two threads at once.
        name = "late_file" if late else "file"
        if getattr(self, name) is None:
            setattr(self, name, pq.ParquetFile(self.loader.path))
        self.groups_read += 1
        try:
            return getattr(self, name).read_row_group(group, columns=self.loader.columns, use_threads=True)
        except (OSError, pa.ArrowException) as exc:
            start = int(self.loader.row_group_offsets[group])
            end = int(self.loader.row_group_offsets[group + 1])
            raise CorruptRowGroupError(
                f"{self.loader.path}: row group {group} (file rows {start}..{end - 1}) cannot be decoded: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _slice(self, table: pa.Table, key: BatchKey) -> pa.Table:
        start, stop = self.loader.spans[key]
        return table.slice(start - int(self.loader.row_group_offsets[key[1]]), stop - start)

    def _reader(self, items: Sequence[tuple[int, int, BatchKey]], out: queue.Queue, stop: threading.Event):
        """Read-ahead thread: for each run of items in the same row group, decode it unless all cached."""
        try:
            if self.shared is not None:
                for entry in self._shared_entries():
                    if stop.is_set():
                        return
                    _put(out, entry, stop)
                _put(out, None, stop)
                return
            i = 0
            while i < len(items) and not stop.is_set():
                group = items[i][2][1]
                j = i
                while j < len(items) and items[j][2][1] == group:
                    j += 1
                run = items[i:j]
                # Cached payloads are passed along by reference: if one is evicted before the consumer
                # asks for it, the consumer still counts a miss but reuses this (identical) batch
                # instead of decoding the row group again in its own thread.
                cached = [self.cache.peek(key) for _, _, key in run]
                table = None if all(c is not None for c in cached) else self._read_group(group)
                for item, payload in zip(run, cached, strict=True):
                    data = self._slice(table, item[2]) if table is not None else _Converted(payload)
                    _put(out, (item, data), stop)
                i = j
            _put(out, None, stop)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            _put(out, exc, stop)

    def _shared_entries(self):
        """The shared mode's reader: for each run of the plan this worker owns and that holds a miss,
        decode the row group once; the other workers' misses go first (as _Foreign, converted and
        published on arrival), then this worker's items of the run, with their slices if they are misses."""
        s = self.shared
        for r, (start, stop) in enumerate(s.runs):
            mine = [p for p in range(start, stop) if p % s.step == s.first]
            misses = [p for p in range(start, stop) if s.plan.source[p] < 0]
            table = None
            if r % s.step == s.first and misses:
                table = self._read_group(s.items[start][2][1])
                for p in misses:
                    if p % s.step != s.first:
                        yield _Foreign(p, s.items[p][2], self._slice(table, s.items[p][2]))
            for p in mine:
                data = self._slice(table, s.items[p][2]) if table is not None and s.plan.source[p] < 0 else None
                yield s.items[p], data

    def _arrow_items(self, items):
        """(item, Arrow slice or None) in order, decoded ahead in a thread when read_ahead > 0."""
        if self.loader.read_ahead == 0:
            if self.shared is not None:
                yield from self._shared_entries()
                return
            for item in items:
                yield item, None
            return
        out: queue.Queue = queue.Queue(maxsize=self.loader.read_ahead * max(1, self.loader.batches_per_group))
        stop = threading.Event()
        thread = threading.Thread(target=self._reader, args=(items, out, stop), daemon=True)
        thread.start()
        try:
            while True:
                got = out.get()
                if got is None:
                    return
                if isinstance(got, CorruptRowGroupError):
                    raise CorruptRowGroupError(f"{got}; {self.rows} rows served before it") from got
                if isinstance(got, BaseException):
                    raise got
                yield got
        finally:
            stop.set()
            thread.join()

    def batches(self, items: Sequence[tuple[int, int, BatchKey]], traces: dict[int, list[BatchKey]]):
        threads = self.loader.torch_threads
        for item in self._arrow_items(items):
            if isinstance(item, _Foreign):
                self._produce(item)
                continue
            previous = torch.get_num_threads()
            if threads is not None and threads != previous:
                torch.set_num_threads(threads)
            try:
                batch = self._one(item, traces)
            finally:
                if threads is not None and threads != previous:
                    torch.set_num_threads(previous)
            yield batch

    def _one(self, item, traces: dict[int, list[BatchKey]]) -> Batch:
        loader = self.loader
        (pass_index, position, key), data = item
        if self.shared is not None:
            batch = self._one_shared(key, data)
        else:
            batch = self._one_local(pass_index, key, data, traces)
        batch = loader.filter_rows(batch, key)
        if self.augmenter is not None:
            gen = torch.Generator().manual_seed(_batch_seed(loader.seed, pass_index, position))
            batch = self.augmenter(batch, gen)
        self.rows += batch.batch_size
        self.batch_count += 1
        self.item_number += 1
        return batch

    def _convert(self, key: BatchKey, data) -> Batch:
        """Convert a decoded slice, or decode the batch's row group here first (no read-ahead)."""
        if data is None:
            self.late_reads += self.loader.read_ahead > 0
            try:
                table = self._read_group(key[1], late=self.loader.read_ahead > 0)
            except CorruptRowGroupError as exc:
                raise CorruptRowGroupError(f"{exc}; {self.rows} rows served before it") from exc
            data = self._slice(table, key)
        return self._converted(key, data)

    def _converted(self, key: BatchKey, data: pa.Table) -> Batch:
        """The converter's batch; bad data it finds (a rejected row, a null element, an out-of-vocabulary id
        with clip_oov=False) becomes a LoaderError naming the file, the row group and the rows served."""
        try:
            return self.converter(data, row_offset=self.loader.batch_start(key))
        except DataError as exc:
            group = key[1]
            start, end = int(self.loader.row_group_offsets[group]), int(self.loader.row_group_offsets[group + 1])
            raise LoaderError(
                f"{self.loader.path}: row group {group} (file rows {start}..{end - 1}), batch {key[2]}: {exc}; "
                f"{self.rows} rows served before it"
            ) from exc

    def _produce(self, foreign: _Foreign) -> None:
        """Convert another worker's miss from a row group decoded here; publish it for that worker and
        for the cache hits it will serve."""
        s = self.shared
        batch = self._converted(foreign.key, foreign.data)
        s.store.put(foreign.position, batch, [foreign.position, *s.plan.readers.get(foreign.position, [])])
        self.converted_for_other_workers += 1

    def _one_shared(self, key: BatchKey, data) -> Batch:
        s = self.shared
        position = s.first + self.item_number * s.step
        source = s.plan.source[position]
        if source >= 0:
            self.shared_hits += 1
            self.served_by_other_workers += source % s.step != s.first
            return s.store.get(source, position, key)
        self.shared_misses += 1
        if s.producer(position) != s.first:  # converted by the worker that decoded this row group
            self.converted_by_other_workers += 1
            return s.store.get(position, position, key)
        batch = self._convert(key, data)
        readers = s.plan.readers.get(position)
        if readers:
            s.store.put(position, batch, readers)
            self.shared_writes += 1
        return batch

    def _one_local(self, pass_index: int, key: BatchKey, data, traces: dict[int, list[BatchKey]]) -> Batch:
        if pass_index != self.current_pass:
            self.current_pass = pass_index
            self.cache.set_trace(traces[pass_index])  # per-sweep rebuild: the rest of the plan
        batch = self.cache.get(key)
        if batch is None:
            if isinstance(data, _Converted):  # evicted after the read-ahead saw it: reuse, do not decode
                self.reused_after_eviction += 1
                batch = data.batch.clone()
            else:
                batch = self._convert(key, data)
            self.cache.put(key, batch)
        return batch

    def stats(self) -> dict:
        if self.shared is not None:
            accesses = self.shared_hits + self.shared_misses
            cache = {
                "shared": True,
                "hits": self.shared_hits,
                "misses": self.shared_misses,
                "hit_rate": self.shared_hits / accesses if accesses else 0.0,
                "served_by_other_workers": self.served_by_other_workers,
                "writes": self.shared_writes,
                "converted_for_other_workers": self.converted_for_other_workers,
                "converted_by_other_workers": self.converted_by_other_workers,
            }
        else:
            cache = self.cache.stats()
        return {
            "rows": self.rows,
            "batches": self.batch_count,
            "row_groups_read": self.groups_read,
            "late_reads": self.late_reads,
            "reused_after_eviction": self.reused_after_eviction,
            "cache": cache,
            "converter": dict(self.converter.stats),
        }


class _WorkerDataset(torch.utils.data.IterableDataset):
    """DataLoader side: worker w produces the plan items at positions w, w + W, ... (in plan order)."""

    def __init__(self, loader: PcvrLoader, stats_queue, store_dir: str | None):
        super().__init__()
        self.loader = loader
        self.stats_queue = stats_queue
        self.store_dir = store_dir
        self.epoch = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # a fresh pipeline (counters, and the shared cache's decisions from the plan's start) per
        # iteration, as in the single-process path: one iteration is the whole plan
        shared = None
        if self.store_dir is not None:  # (always, from PcvrLoader; None only when used outside it)
            directory = Path(self.store_dir) / f"epoch-{self.epoch}"  # every worker counts the same epochs
            directory.mkdir(exist_ok=True)
            plan_items = self.loader.plan_items()
            runs, start = [], 0
            for i in range(1, len(plan_items) + 1):
                if i == len(plan_items) or plan_items[i][2][1] != plan_items[start][2][1]:
                    runs.append((start, i))
                    start = i
            shared = _Shared(
                self.loader.shared_cache_plan(), SharedBatchStore(directory), worker, workers, plan_items, runs
            )
        self.epoch += 1
        pipeline = _Pipeline(self.loader, self.loader.cache_capacity, shared)
        items = self.loader.plan_items()[worker::workers]
        yield from pipeline.batches(items, self.loader.pass_traces(items))
        self.stats_queue.put((worker, pipeline.stats()))


class PcvrLoader:
    """Iterate converted (and, for training, augmented) batches of one parquet file; see the module doc."""

    def __init__(
        self,
        path: str | Path,
        schema: Schema | str | Path | dict,
        *,
        preset: str = "none",
        batch_size: int = 256,
        mode: str = "sweep",
        passes: int = 1,
        steps: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        split: str | SplitPlan | None = None,
        side: str = "all",
        valid_ratio: float = 0.2,
        train_ratio: float = 1.0,
        split_salt: int = 0,
        cache_policy: str | None = None,
        cache_capacity: int = 512,
        augmentations: Sequence | None = None,
        strict_time_filter: bool | None = None,
        strict_on_eval: bool = False,
        list_order: str = "auto",
        non_monotonic: str = "sort",
        training: bool = True,
        num_workers: int = 0,
        read_ahead: int = 2,
        pin_memory: bool | None = None,
        torch_threads: int | None = 1,
    ):
        if preset not in PRESETS:
            raise LoaderError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
        if mode not in MODES:
            raise LoaderError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if side not in SIDES:
            raise LoaderError(f"side must be one of {', '.join(SIDES)}, got {side!r}")
        if cache_policy is not None and cache_policy not in CACHE_POLICIES:
            raise LoaderError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {cache_policy!r}")
        if split is not None and not isinstance(split, SplitPlan) and split not in SPLIT_METHODS:
            raise LoaderError(f"split must be None, a SplitPlan or one of {', '.join(SPLIT_METHODS)}, got {split!r}")
        try:  # the converter's rules, checked here so a bad option fails before the first batch
            check_order_options(list_order, non_monotonic)
        except ValueError as exc:
            raise LoaderError(str(exc)) from exc
        self.list_order = list_order
        self.non_monotonic = non_monotonic
        if split is None and side != "all":
            raise LoaderError(f"side={side!r} needs a split (one of {', '.join(SPLIT_METHODS)})")
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.passes = _check_int("passes", passes, 1)
        if mode == "steps":
            if steps is None:
                raise LoaderError("mode='steps' needs steps (an integer >= 1)")
            self.steps = _check_int("steps", steps, 1)
        else:
            self.steps = None
        self.cache_capacity = _check_int("cache_capacity", cache_capacity, 1)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.read_ahead = _check_int("read_ahead", read_ahead, 0)
        self.seed = _check_int("seed", seed, 0)
        self.torch_threads = None if torch_threads is None else _check_int("torch_threads", torch_threads, 1)

        self.schema = schema if isinstance(schema, Schema) else load_schema(schema)
        self.path = Path(path)
        parquet = open_dataset(self.path, self.schema)  # clear errors for missing/truncated/empty/bad columns
        self.file_key = str(self.path.resolve())
        self.columns = self.schema.converter_columns
        self.preset = preset
        self.mode = mode
        self.shuffle = bool(shuffle)
        self.side = side
        self.training = bool(training)
        chosen = PRESETS[preset]
        self.cache_policy = cache_policy if cache_policy is not None else chosen.cache_policy
        self.augmentations = tuple(augmentations) if augmentations is not None else chosen.augmentations
        # Augmentations are for training batches only: never for inference or the validation side.
        self.augment_active = bool(self.augmentations) and self.training and side != "valid"
        strict = chosen.strict_time_filter if strict_time_filter is None else strict_time_filter
        # strict filtering belongs to training batches (data.md); evaluation only when asked by name
        self.strict_time_filter_requested = bool(strict)
        self.strict_on_eval = bool(strict_on_eval)
        training_batches = self.training and side != "valid"
        self.strict_time_filter = bool(strict) and (training_batches or self.strict_on_eval)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        Augmenter(self.augmentations)  # validates the configs now rather than in a worker

        meta = parquet.metadata
        self.row_group_rows = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
        self.row_group_offsets = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        if isinstance(split, SplitPlan):
            if split.num_rows != int(meta.num_rows):
                raise LoaderError(f"split plan covers {split.num_rows} rows, the file has {meta.num_rows}")
            self.split = split
        elif split is not None:
            self.split = plan_split(parquet, split, valid_ratio=valid_ratio, train_ratio=train_ratio, salt=split_salt)
        else:
            self.split = None
        self._mask = self.split.mask(side) if self.split is not None else None
        self._keys, self._key_rows, self.spans = self._eligible_keys()
        self.batches_per_group = max(key[2] for key in self._keys) + 1 if self._keys else 1
        if not self._keys:
            raise LoaderError(f"no rows on the {side!r} side of {self.path}")
        self._plan: list[tuple[int, int, BatchKey]] | None = None
        self._stats: dict = {}

    def __getstate__(self):  # DataLoader workers get the configuration, not the main process's handles
        state = dict(self.__dict__)
        for name in ("_dataloader", "_stats_queue"):
            state.pop(name, None)
        return state

    # -- planning ----------------------------------------------------------------------------------
    def batch_start(self, key: BatchKey) -> int:
        return self.spans[key][0]

    def _eligible_keys(self) -> tuple[list[BatchKey], np.ndarray, dict[BatchKey, tuple[int, int]]]:
        """Batch keys, their row counts, and the span [start, stop) of file rows each one is cut from."""
        keys, rows, spans = [], [], {}
        for group, n in enumerate(self.row_group_rows.tolist()):
            base = int(self.row_group_offsets[group])
            side_rows = np.arange(n) if self._mask is None else np.flatnonzero(self._mask[base : base + n])
            for b, first in enumerate(range(0, len(side_rows), self.batch_size)):
                chunk = side_rows[first : first + self.batch_size]
                key = (self.file_key, group, b)
                keys.append(key)
                rows.append(len(chunk))
                spans[key] = (base + int(chunk[0]), base + int(chunk[-1]) + 1)
        return keys, np.array(rows, dtype=np.int64), spans

    def plan_items(self) -> list[tuple[int, int, BatchKey]]:
        """The whole access plan: (pass, position in pass, key), deterministic by seed."""
        if self._plan is not None:
            return self._plan
        plan: list[tuple[int, int, BatchKey]] = []
        if self.mode == "steps":
            rng = np.random.default_rng(self.seed)
            draws = rng.choice(len(self._keys), size=self.steps, p=self._key_rows / self._key_rows.sum())
            plan = [(0, i, self._keys[k]) for i, k in enumerate(draws.tolist())]
        else:
            groups = sorted({key[1] for key in self._keys})
            by_group: dict[int, list[BatchKey]] = {}
            for key in self._keys:
                by_group.setdefault(key[1], []).append(key)
            for p in range(self.passes):
                order = groups
                if self.shuffle:
                    order = [groups[i] for i in np.random.default_rng([self.seed, p]).permutation(len(groups))]
                keys = [key for g in order for key in by_group[g]]
                plan.extend((p, i, key) for i, key in enumerate(keys))
        self._plan = plan
        return plan

    def skip(self, count: int) -> None:
        """Drop the first `count` items of the plan: a resumed training run continues where it stopped."""
        self._plan = self.plan_items()[_check_int("count", count, 0):]

    def filter_rows(self, batch: Batch, key: BatchKey) -> Batch:
        """Keep the rows of the loader's split side (a no-op without a split or for a batch fully inside)."""
        if self._mask is None:
            return batch
        start, stop = self.spans[key]
        local = self._mask[start:stop]
        if local.all():
            return batch
        return batch.select(torch.from_numpy(np.flatnonzero(local)))

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            yield from self._iter_local()
        else:
            yield from self._iter_workers()

    def _iter_local(self) -> Iterator[Batch]:
        pipeline = _Pipeline(self, self.cache_capacity)
        items = self.plan_items()
        try:
            yield from pipeline.batches(items, self.pass_traces(items))
        finally:
            self._stats = {"workers": [pipeline.stats()]}

    def pass_traces(self, items) -> dict[int, list[BatchKey]]:
        """For each pass, the keys of that pass and every later one (OPT's future at the pass start)."""
        traces: dict[int, list[BatchKey]] = {}
        starts: dict[int, int] = {}
        for i, (p, _, _) in enumerate(items):
            starts.setdefault(p, i)
        keys = [key for _, _, key in items]
        for p, start in starts.items():
            traces[p] = keys[start:]
        return traces

    def _iter_workers(self) -> Iterator[Batch]:
        import torch.multiprocessing as mp

        if not hasattr(self, "_dataloader"):
            self._stats_queue = mp.get_context().Queue()
            store = SharedBatchStore.create()
            weakref.finalize(self, store.close)
            self._store_dir, self._epochs = str(store.directory), 0
            self._dataloader = torch.utils.data.DataLoader(
                # a copy without the DataLoader itself: a worker must not own (and finalise) its parent's loader
                _WorkerDataset(copy.copy(self), self._stats_queue, self._store_dir),
                batch_size=None,
                num_workers=self.num_workers,
                persistent_workers=True,
                prefetch_factor=2,
                pin_memory=self.pin_memory,
            )
        batches = iter(self._dataloader)  # persistent workers: this drains a stopped earlier iteration
        if self._epochs:  # so what that iteration left unread can go
            shutil.rmtree(Path(self._store_dir) / f"epoch-{self._epochs - 1}", ignore_errors=True)
        self._epochs += 1
        yield from batches
        self._stats = {"workers": [s for _, s in sorted(self._stats_queue.get() for _ in range(self.num_workers))]}

    def shared_cache_plan(self) -> CachePlan:
        """The decisions of the cache the workers share: the policy replayed on the whole plan."""
        items = self.plan_items()
        return CachePlan.replay(
            self.cache_policy, self.cache_capacity, self.seed, [key for _, _, key in items],
            self.pass_traces(items), [p for p, _, _ in items],
        )

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def planned_batches(self) -> int:
        return len(self.plan_items())

    @property
    def planned_rows(self) -> int:
        """Rows the plan yields before augmentation (views multiply them afterwards)."""
        rows = dict(zip(self._keys, self._key_rows.tolist(), strict=True))
        return sum(rows[key] for _, _, key in self.plan_items())

    def stats_per_worker(self) -> list[dict]:
        """The last complete iteration's pipeline stats of each worker (one entry without workers)."""
        return list(self._stats.get("workers", []))

    def stats(self) -> dict:
        """Rows, batches, cache and converter stats of the last complete iteration (summed over workers)."""
        workers = self._stats.get("workers", [])
        out = {
            "preset": self.preset,
            "mode": self.mode,
            "cache_impl": self.cache_policy,
            "strict_time_filter": self.strict_time_filter,
            "strict_time_filter_requested": self.strict_time_filter_requested,
            "strict_on_eval": self.strict_on_eval,
            "list_order": self.list_order,
            "non_monotonic": self.non_monotonic,
            "augmentations": Augmenter(self.augmentations).describe() if self.augment_active else [],
            "num_workers": self.num_workers,
            "split": self.split.summary() if self.split is not None else None,
            "side": self.side,
            "rows": sum(w["rows"] for w in workers),
            "batches": sum(w["batches"] for w in workers),
            "row_groups_read": sum(w["row_groups_read"] for w in workers),
            "late_reads": sum(w["late_reads"] for w in workers),
            "reused_after_eviction": sum(w["reused_after_eviction"] for w in workers),
        }
        if workers:
            caches = [w["cache"] for w in workers]
            if caches[0].get("shared"):
                # one cache for all workers: its state (items, evictions, ...) is the replay's; the hits
                # are the ones the workers counted, per worker and overall
                cache = dict(self.shared_cache_plan().stats, shared_across_workers=True, per_worker=caches)
                for field in ("hits", "misses", "served_by_other_workers", "writes", "converted_for_other_workers"):
                    cache[field] = sum(c[field] for c in caches)
            else:
                cache = dict(caches[0], shared_across_workers=False)
                for field in ("items", "hits", "misses", "bypasses", "evictions", "sweep_hits", "sweep_misses"):
                    cache[field] = sum(c[field] for c in caches)
            accesses = cache["hits"] + cache["misses"]
            cache["hit_rate"] = cache["hits"] / accesses if accesses else 0.0
            out["cache"] = cache
            out["converter_oob_total"] = sum(w["converter"]["oob_total"] for w in workers)
            kinds = (*ORDER_CLASSES, "given")
            rows = {
                d.name: {k: sum(w["converter"]["list_order_rows"][d.name][k] for w in workers) for k in kinds}
                for d in self.schema.domains
            }
            out["list_order_rows"] = rows
            out["list_order_detected"] = {name: file_list_order(c) for name, c in rows.items()}
        return out
