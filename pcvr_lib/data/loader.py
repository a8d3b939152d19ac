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
spinning against pyarrow's decoder threads slows a small copy by orders of magnitude (notes/data-pipeline.md).
With `num_workers > 0` a torch DataLoader runs the same pipeline in worker processes (batch_size=None,
persistent workers, prefetch 2); keys are dealt round-robin, so batches still come out in plan order.
The workers live until `close()` (or the end of a `with PcvrLoader(...) as loader:` block, or garbage
collection), so that a second pass starts without forking again.
Each worker decodes with its share of the cores (`worker_arrow_threads`: cores // workers Arrow threads,
at least 1; `stats()["arrow_threads"]`), so that the workers' decoder pools do not oversubscribe the machine.
Each worker hands its batches over through a ring of shared-memory slots (`batch_ring.py`: one copy into
the slot, a small descriptor through the queue, the consumer's tensors over the slot), a batch staying
valid for as long as anything refers to it (`stats()["handoff"]`); on CUDA they are copied into pinned
memory as they come out (`pin_memory`). The workers share one cache of the full capacity
(`shared_cache.py`): its decisions are the policy replayed on the whole plan, so they are the
single-process loader's, and a batch converted by one worker is read by another from shared memory
without decoding (`stats()["cache"]["per_worker"]`). A worker that dies raises a LoaderError saying so.

Presets (strict_time_filter is explicit here; the reference switches it on whenever any augmentation
is configured, even a no-op one):
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

This module is the loader's public API (`__all__`): `loader_plan` holds the options, presets and access
plan, `loader_pipeline` the per-process pipeline and the DataLoader workers' side.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import torch
import torch.multiprocessing as mp

from pcvr_lib.data.augment import Augmenter
from pcvr_lib.data.batch import Batch
from pcvr_lib.data.batch_ring import RingReceiver
from pcvr_lib.data.convert import ORDER_CLASSES
from pcvr_lib.data.loader_pipeline import Pipeline, WorkerDataset
from pcvr_lib.data.loader_plan import (
    MODES,
    PRESETS,
    BatchKey,
    CorruptRowGroupError,
    LoaderError,
    LoaderPlan,
    Preset,
    file_list_order,
)
from pcvr_lib.data.shared_cache import SharedBatchStore, remove_tree
from pcvr_lib.heap import release_free_heap

# the loader's public API (some defined in the modules it is made of)
__all__ = [
    "MODES",
    "PRESETS",
    "BatchKey",
    "CorruptRowGroupError",
    "LoaderError",
    "PcvrLoader",
    "Preset",
    "file_list_order",
]


class PcvrLoader(LoaderPlan):
    """Iterate converted (and, for training, augmented) batches of one parquet file; see the module doc."""

    def __getstate__(self):  # DataLoader workers get the configuration, not the main process's handles
        state = dict(self.__dict__)
        for name in ("_dataloader", "_stats_queue", "_receiver"):
            state.pop(name, None)
        return state

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            yield from self._iter_local()
        else:
            yield from self._iter_workers()

    def _iter_local(self) -> Iterator[Batch]:
        pipeline = Pipeline(self, self.cache_capacity)
        items = self.plan_items()
        try:
            yield from pipeline.batches(items, self.pass_traces(items))
        finally:
            self._stats = {"workers": [pipeline.stats()]}

    def _iter_workers(self) -> Iterator[Batch]:
        if not hasattr(self, "_dataloader"):
            self._stats_queue = mp.get_context().Queue()
            store = SharedBatchStore.create()
            weakref.finalize(self, store.close)
            self._store_dir, self._epochs = str(store.directory), 0
            self._receiver = RingReceiver()
            # The workers are forked at the first iteration and share this process's memory until either
            # writes into it: pages Arrow's allocator keeps free here (after any decoding in this process,
            # e.g. a benchmark's pyarrow read) would be copied one by one as a worker's decoder reuses
            # them (a worker's first decodes took 0.5-1.3 s instead of 0.13-0.2 s). Handed back first,
            # they come to the workers as fresh pages (49k page faults on a worker's first decode -> 4k).
            # The same holds for the C heap's free pages (torch's CPU tensors of an earlier in-process
            # iteration, say): glibc's malloc_trim hands them back too (opt preset, 1 worker, after the
            # benchmark's other cases in one process: 5,029 -> 7,727 rows/s on 2 cores).
            pa.default_memory_pool().release_unused()
            release_free_heap()
            self._dataloader = torch.utils.data.DataLoader(
                # a copy without the DataLoader itself: a worker must not own (and finalise) its parent's loader
                WorkerDataset(copy.copy(self), self._stats_queue, self._store_dir),
                batch_size=None,
                num_workers=self.num_workers,
                persistent_workers=True,
                prefetch_factor=2,
                pin_memory=False,  # the workers send slot descriptors; batches are pinned as they come out
            )
        if self._epochs:  # what the last iteration left (unread, if it was stopped early) can go; a worker waiting
            # in it for a batch that will not come now gives up, so that the next line's drain can finish
            remove_tree(Path(self._store_dir) / f"epoch-{self._epochs - 1}")
        batches = iter(self._dataloader)  # persistent workers: this drains a stopped earlier iteration
        self._receiver.start(Path(self._store_dir) / f"epoch-{self._epochs}")
        self._epochs += 1
        try:
            for item in batches:
                batch = self._receiver.receive(item)
                yield batch.pin_memory() if self.pin_memory else batch
            self._receiver.finish()
        except RuntimeError as exc:
            if "DataLoader worker (pid" not in str(exc):  # torch's words for a worker that exited or was killed
                raise
            raise LoaderError(f"{self.path}: a loader worker process died ({exc}); with num_workers=0 the same "
                              "batches are made in this process, where the cause shows") from exc
        self._stats = {"workers": self._worker_stats(self._epochs - 1)}

    def close(self) -> None:
        """Stop the worker processes and free their shared memory now (the workers persist between
        iterations; without this they go when the loader is garbage-collected). Stats stay readable; a later
        iteration starts new workers."""
        dataloader = self.__dict__.pop("_dataloader", None)
        if dataloader is None:
            return
        iterator = getattr(dataloader, "_iterator", None)
        if iterator is not None:  # torch's own shutdown of its worker processes (joins them, closes queues)
            iterator._shutdown_workers()
        remove_tree(self._store_dir)
        for name in ("_stats_queue", "_receiver", "_store_dir"):
            self.__dict__.pop(name, None)

    def __enter__(self) -> PcvrLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker_stats(self, epoch: int) -> list[dict]:
        """Each worker's pipeline stats of iteration `epoch`, in worker order; a stopped earlier iteration's
        (sent by a worker that got to its end after the stop) are skipped."""
        found: dict[int, dict] = {}
        while len(found) < self.num_workers:
            sent_epoch, worker, stats = self._stats_queue.get()
            if sent_epoch == epoch:
                found[worker] = stats
        return [found[w] for w in sorted(found)]

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
            "arrow_threads": [w["arrow_threads"] for w in workers],  # per process that decoded (worker order)
            "split": self.split.summary() if self.split is not None else None,
            "side": self.side,
            "rows": sum(w["rows"] for w in workers),
            "batches": sum(w["batches"] for w in workers),
            "row_groups_read": sum(w["row_groups_read"] for w in workers),
            "row_groups_reused": sum(w["row_groups_reused"] for w in workers),
            "late_reads": sum(w["late_reads"] for w in workers),
            "reused_after_eviction": sum(w["reused_after_eviction"] for w in workers),
            "handoff": _handoff([w.get("handoff") for w in workers]),
        }
        if workers:
            caches = [w["cache"] for w in workers]
            if caches[0].get("shared"):
                # one cache for all workers: its state (items, evictions, ...) is the replay's; the hits
                # are the ones the workers counted, per worker and overall
                cache = dict(self.shared_cache_plan().stats, shared_across_workers=True, per_worker=caches)
                for field in ("hits", "misses", "served_by_other_workers", "writes", "kept_in_process",
                              "converted_for_other_workers"):
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


def _handoff(per_worker: list[dict | None]) -> dict | None:
    """How the workers' batches reached this process: through ring slots (`shared`) or pickled (when every
    slot was still held), and the slots lent between workers (`lent`); None without workers."""
    if not per_worker or any(w is None for w in per_worker):
        return None
    total = {k: sum(w[k] for w in per_worker) for k in ("shared", "copied", "pickled", "lent", "rings")}
    return dict(total, slots_per_worker=per_worker[0]["slots"], slot_bytes=max(w["slot_bytes"] for w in per_worker),
                ring_unavailable=[w["unavailable"] for w in per_worker if w["unavailable"]])
