"""One batch cache shared by the loader's worker processes.

With `num_workers > 0` every worker produces the plan items at positions w, w + W, ... . A cache per worker
would see only its own items (a batch converted by worker 0 could never serve worker 1), so the workers
share one cache of the full capacity instead, in two parts:

- The decisions. The whole access plan is known before the first batch, so which positions hit, which
  misses are inserted and which insertion serves which hit is fixed by the policy replayed on the plan in
  plan order (`CachePlan.replay`, the same cache classes with a position token as payload). Every worker
  replays it (keys only, microseconds per access), so the workers agree without talking to each other, and
  the hits are exactly those of the single-process loader on the same plan (tested).
- The payloads. A converted batch that another worker will hit later is written once into a file in a
  directory on shared memory (/dev/shm where it exists), laid out like a ring slot
  (`batch_ring.write_batch_file`), and mapped back (`read_batch_file`) by whichever worker owns the hit, with
  no Arrow decoding and no conversion (and copied once more, into that worker's ring slot). One that only its
  own worker hits stays in that worker's memory (a clone). The writer publishes one hard link per future
  hit (`<insert position>-<hit position>.batch`, created after the file is complete, so a reader never sees
  a partial file), and each reader unlinks its own link after loading: the memory is released when the last
  hit has been served, which is at or before the policy's eviction.

A reader whose link is not there yet waits for it: the insertion is at an earlier plan position, and
every worker works through its positions in order, so the writer gets there without waiting on the reader.
That holds while the consumer keeps asking for batches; when it stops an iteration early, the writer may
never be asked for the item that gets it there, so the loader removes that iteration's folder before the
next one starts, and a reader waiting in it gives up (`IterationAbandoned`) instead of waiting out the timeout.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pcvr_lib.data.batch_ring import read_batch_file, write_batch_file
from pcvr_lib.data.cache import make_cache


@dataclass(frozen=True)
class _Token:
    """The replay's payload: the plan position whose batch is cached (cloning it is free)."""

    position: int

    def clone(self) -> _Token:
        return self


@dataclass
class CachePlan:
    """The shared cache's decisions over a plan: per position a hit (with the position whose insertion
    serves it) or a miss, and for each insertion the hit positions it serves."""

    source: list[int]  # source[i] = insertion position serving hit i, or -1 for a miss
    readers: dict[int, list[int]] = field(default_factory=dict)  # insertion position -> its hit positions
    stats: dict = field(default_factory=dict)  # the replayed cache's stats (global)

    @classmethod
    def replay(cls, policy: str, capacity: int, seed: int, keys: list, traces: dict[int, list], passes: list[int]):
        """Replay `policy` on the plan's keys in plan order; `passes[i]` is position i's pass (OPT's trace
        is rebuilt at each pass start from `traces[pass]`, as the single-process loader does)."""
        cache = make_cache(policy, capacity, seed=seed)
        source = [-1] * len(keys)
        readers: dict[int, list[int]] = {}
        current = None
        for i, (key, pass_index) in enumerate(zip(keys, passes, strict=True)):
            if pass_index != current:
                current = pass_index
                cache.set_trace(traces[pass_index])
            token = cache.get(key)
            if token is not None:
                source[i] = token.position
                readers.setdefault(token.position, []).append(i)
            else:
                cache.put(key, _Token(i))
        return cls(source, readers, cache.stats())


def remove_tree(directory: str | Path, attempts: int = 200) -> None:
    """Remove `directory`, retried while a worker still creates files in it: one rmtree then fails on the
    directory that is not empty any more, and a worker waiting in it for a batch would wait out its timeout
    (the signal that an iteration was stopped is the directory's absence)."""
    directory = Path(directory)
    for _ in range(attempts):
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            return
        time.sleep(0.005)


class IterationAbandoned(RuntimeError):
    """The consumer stopped this iteration (its folder is gone): the batch waited for will not come."""


class SharedBatchStore:
    """Converted batches on shared memory, one file per insertion, one hard link per future hit."""

    def __init__(self, directory: str | Path, wait_timeout_s: float = 600.0):
        self.directory = Path(directory)
        self.wait_timeout_s = wait_timeout_s

    @classmethod
    def create(cls) -> SharedBatchStore:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        return cls(tempfile.mkdtemp(prefix="pcvr-batch-cache-", dir=base))

    def close(self) -> None:
        """Remove the directory and whatever was never read (an iteration stopped early)."""
        remove_tree(self.directory)

    def _link(self, position: int, reader: int) -> Path:
        return self.directory / f"{position}-{reader}.batch"

    def put(self, position: int, batch, readers: list[int]) -> None:
        tmp = self.directory / f"{position}.tmp"
        write_batch_file(tmp, batch)  # a copy: the converter's outputs are views of recycled buffers
        for reader in readers:
            os.link(tmp, self._link(position, reader))
        tmp.unlink()

    def put_handle(self, position: int, handle) -> None:
        """Publish, for the one reader of a miss at `position`, a small picklable handle instead of the batch
        (a batch_ring.SlotBatch: where the producing worker's ring holds it)."""
        tmp = self.directory / f"{position}.handle.tmp"
        tmp.write_bytes(pickle.dumps(handle))
        os.replace(tmp, self._handle(position))

    def _handle(self, position: int) -> Path:
        return self.directory / f"{position}.handle"

    def get(self, position: int, reader: int, key):
        """The batch inserted at `position`, for the reader at plan position `reader` (the miss itself when
        reader == position); for a miss it may be the handle `put_handle` published instead."""
        path = self._link(position, reader)
        handle = self._handle(position) if position == reader else None
        deadline = time.monotonic() + self.wait_timeout_s
        delay = 0.0005
        while not path.exists():
            if not self.directory.is_dir():
                raise IterationAbandoned(f"shared batch cache {self.directory}: the iteration was stopped")
            if handle is not None and handle.exists():
                value = pickle.loads(handle.read_bytes())
                handle.unlink()
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shared batch cache {self.directory}: batch {key} inserted at plan position {position} "
                    f"was not published within {self.wait_timeout_s:.0f} s (a worker failed?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        batch = read_batch_file(path)
        path.unlink()  # the mapping stays valid; the memory goes when the last reader is done
        return batch  # over the (private) mapping: the worker copies it into a ring slot, then lets it go
