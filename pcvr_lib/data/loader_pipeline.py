"""The loader's pipeline, one per process: read-ahead decoding, conversion, cache, split filter and
augmentation, and with worker processes the shared cache's roles (see pcvr_lib.data.loader)."""

from __future__ import annotations

import bisect
import contextlib
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pcvr_lib.data.augment import Augmenter
from pcvr_lib.data.batch import Batch
from pcvr_lib.data.batch_ring import RingReceiver, RingSender, SlotBatch
from pcvr_lib.data.cache import make_cache
from pcvr_lib.data.convert import Converter
from pcvr_lib.data.loader_plan import BatchKey, CorruptRowGroupError, LoaderError, LoaderPlan
from pcvr_lib.data.parquet import DataError
from pcvr_lib.data.shared_cache import CachePlan, SharedBatchStore
from pcvr_lib.data.split import splitmix64

# Decoded row groups shared by the loaders of one process, only inside reusing_decoded_row_groups(): the smoke's
# runs read one file five times each (training, holdouts, validation, inference), and a row group of the demo
# data (1,000 rows of long event lists, 69 MB decoded) takes 82 ms to decode on the H100 host, 220 ms on a 2-core
# Xeon. Off everywhere else: the loader's benchmarks time decoding, and its own caches are the ones it documents.
_REUSE_LOCK = threading.Lock()
_REUSE: dict | None = None
REUSE_MAX_BYTES = 2 << 30  # decoded tables kept at most; past it a row group is decoded again when asked


@contextlib.contextmanager
def reusing_decoded_row_groups():
    """Within the block, a row group this process has decoded (the same file, unchanged since by size and
    modification time, the same columns) is served again from memory instead of decoded: Arrow tables are
    immutable, so loaders can share one. Nested blocks share the outermost one's tables, freed at its end."""
    global _REUSE
    outermost = _REUSE is None
    if outermost:
        _REUSE = {}
    try:
        yield
    finally:
        if outermost:
            _REUSE = None


def _reuse_key(path, group: int, columns) -> tuple:
    stat = os.stat(path)
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, group, tuple(columns) if columns else None)


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
    sender: RingSender  # this worker's ring: misses converted for another worker are lent through it
    receiver: RingReceiver  # the other workers' rings, for the misses they converted for this one

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


class Pipeline:
    """Produces the batches of a list of (pass, position, key) items; one instance per process."""

    def __init__(self, loader: LoaderPlan, cache_capacity: int, shared: _Shared | None = None):
        self.loader = loader
        self.shared = shared
        self.item_number = 0  # items handed out so far (their plan positions, with `shared`)
        self.shared_hits = self.shared_misses = self.served_by_other_workers = self.shared_writes = 0
        self.kept_in_process = 0  # insertions whose hits are all this worker's own: kept here, never written
        # insertion position -> [batch, this worker's hits still to serve]: the store holds only what another
        # worker reads (writing a ~20 MB batch there costs ~10x its clone)
        self.own_inserts: dict[int, list] = {}
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
            # a worker converts into its ring of shared-memory slots, from which the batch is handed over
            arena_source=shared.sender if shared is not None else None,
        )
        self.cache = make_cache(loader.cache_policy, cache_capacity, seed=loader.seed)
        self.augmenter = Augmenter(loader.augmentations) if loader.augment_active else None
        self.rows = 0
        self.batch_count = 0
        self.late_reads = 0
        self.reused_after_eviction = 0
        self.groups_read = 0
        self.groups_reused = 0  # served by reusing_decoded_row_groups()
        self.current_pass: int | None = None

    def _read_group(self, group: int, late: bool = False) -> pa.Table:
        # Handles are opened lazily (DataLoader workers each get their own), and a late read in the
        # consuming thread uses its own handle: a ParquetFile must not be read from two threads at once.
        reuse = _REUSE
        if reuse is not None:
            key = _reuse_key(self.loader.path, group, self.loader.columns)
            with _REUSE_LOCK:
                table = reuse.get(key)
            if table is not None:
                self.groups_reused += 1
                return table
        name = "late_file" if late else "file"
        if getattr(self, name) is None:
            setattr(self, name, pq.ParquetFile(self.loader.path))
        self.groups_read += 1
        try:
            table = getattr(self, name).read_row_group(group, columns=self.loader.columns, use_threads=True)
        except (OSError, pa.ArrowException) as exc:
            start = int(self.loader.row_group_offsets[group])
            end = int(self.loader.row_group_offsets[group + 1])
            raise CorruptRowGroupError(
                f"{self.loader.path}: row group {group} (file rows {start}..{end - 1}) cannot be decoded: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if reuse is not None:
            with _REUSE_LOCK:
                if sum(t.nbytes for t in reuse.values()) + table.nbytes <= REUSE_MAX_BYTES:
                    reuse[key] = table
        return table

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
        if isinstance(batch, SlotBatch):  # lent by the worker that converted it: passed on untouched if it can be
            if self.augmenter is None and loader.keeps_all_rows(key):
                self.rows += batch.batch_size
                self.batch_count += 1
                self.item_number += 1
                return batch
            batch = self.shared.receiver.receive(batch)
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
        readers = s.plan.readers.get(foreign.position, [])
        # a batch read only by that worker goes through a slot of this worker's ring (one copy, no file); one
        # that later hits will read too is written to the store, which keeps it until its last hit
        handle = s.sender.lend(batch) if not readers else None
        if handle is not None:
            s.store.put_handle(foreign.position, handle)
        else:
            s.store.put(foreign.position, batch, [foreign.position, *readers])
        self.converted_for_other_workers += 1

    def _one_shared(self, key: BatchKey, data) -> Batch:
        s = self.shared
        position = s.first + self.item_number * s.step
        source = s.plan.source[position]
        if source >= 0:
            self.shared_hits += 1
            self.served_by_other_workers += source % s.step != s.first
            own = self.own_inserts.get(source)
            if own is None:
                return s.store.get(source, position, key)
            own[1] -= 1
            if own[1] == 0:
                del self.own_inserts[source]
            return own[0]  # a clone nobody writes to: the hand-off copies it into a ring slot
        self.shared_misses += 1
        if s.producer(position) != s.first:  # converted by the worker that decoded this row group
            self.converted_by_other_workers += 1
            return s.store.get(position, position, key)  # the batch, or a SlotBatch lent by that worker
        batch = self._convert(key, data)
        readers = s.plan.readers.get(position) or []
        foreign = [r for r in readers if r % s.step != s.first]
        if foreign:  # one file serves every hit, this worker's own included
            s.store.put(position, batch, readers)
            self.shared_writes += 1
        elif readers:
            self.own_inserts[position] = [batch.clone(), len(readers)]
            self.kept_in_process += 1
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
                "kept_in_process": self.kept_in_process,
                "converted_for_other_workers": self.converted_for_other_workers,
                "converted_by_other_workers": self.converted_by_other_workers,
            }
        else:
            cache = self.cache.stats()
        return {
            "rows": self.rows,
            "batches": self.batch_count,
            "row_groups_read": self.groups_read,
            "row_groups_reused": self.groups_reused,
            "late_reads": self.late_reads,
            "arrow_threads": pa.cpu_count(),  # the decoder pool this process ran with (workers: their share)
            "reused_after_eviction": self.reused_after_eviction,
            "cache": cache,
            "converter": dict(self.converter.stats),
        }


def worker_arrow_threads(workers: int) -> int:
    """Arrow decoder threads for each of `workers` worker processes: the cores this process may run on,
    shared out (at least 1). Each worker inherits a pool of one thread per core, so W workers would run W
    pools of that size at once on the same cores; on 2 cores with 2 workers that oversubscription cost
    10-20% of rows/s against 1 thread each (notes/data-pipeline.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


class WorkerDataset(torch.utils.data.IterableDataset):
    """DataLoader side: worker w produces the plan items at positions w, w + W, ... (in plan order), and
    hands each batch over through its ring of shared-memory slots (`batch_ring`)."""

    def __init__(self, loader: LoaderPlan, stats_queue, store_dir: str | None):
        super().__init__()
        self.loader = loader
        self.stats_queue = stats_queue
        self.store_dir = store_dir
        self.epoch = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:  # in a worker process: its share of the cores for Arrow's decoder pool
            pa.set_cpu_count(worker_arrow_threads(workers))
        # a fresh pipeline (counters, and the shared cache's decisions from the plan's start) per
        # iteration, as in the single-process path: one iteration is the whole plan
        shared = sender = None
        epoch = self.epoch
        if self.store_dir is not None:  # (always, from PcvrLoader; None only when used outside it)
            directory = Path(self.store_dir) / f"epoch-{self.epoch}"  # every worker counts the same epochs
            directory.mkdir(exist_ok=True)
            sender, receiver = RingSender(directory, worker, self.loader.batch_size), RingReceiver()
            receiver.start(directory)
            plan_items = self.loader.plan_items()
            runs, start = [], 0
            for i in range(1, len(plan_items) + 1):
                if i == len(plan_items) or plan_items[i][2][1] != plan_items[start][2][1]:
                    runs.append((start, i))
                    start = i
            shared = _Shared(
                self.loader.shared_cache_plan(), SharedBatchStore(directory), worker, workers, plan_items, runs,
                sender, receiver,
            )
        self.epoch += 1
        pipeline = Pipeline(self.loader, self.loader.cache_capacity, shared)
        items = self.loader.plan_items()[worker::workers]
        for batch in pipeline.batches(items, self.loader.pass_traces(items)):
            yield sender.send(batch) if sender is not None else batch
        handoff = sender.stats() if sender is not None else None
        self.stats_queue.put((epoch, worker, dict(pipeline.stats(), handoff=handoff)))

