"""Caches of converted batches: none, lru, fifo, lfu, rr and opt (Belady over the planned access trace).

What is cached: whole converted batches, before split filtering and augmentation, under the key
(file, row_group, batch_index). Payloads are cloned on put and on get, so a caller that changes what it got
(or what it put) can never corrupt the cache. Capacity counts batches.

`get(key)` is one access: it counts a hit or a miss. After a miss the caller converts the batch and offers
it with `put(key, batch)`; the policy decides whether it goes in and what leaves.

OPT evicts the cached key whose next use in the trace is farthest away, and bypasses (does not insert)
the incoming key when its own next use is no sooner than that victim's: this is Belady's algorithm with
bypass, which gives the optimal hit count for the trace. The trace is the planned access order
(`set_trace`; `cyclic=True` for scans that repeat it). Accesses are expected in trace order; an access
that is not the trace's next occurrence of that key jumps to its next occurrence (counted in
`trace_mismatches`), one that is not in the trace at all counts as never used again. Calling `set_trace`
again (e.g. once per sweep) keeps the cached payloads, re-derives their next uses from the new trace and
resets the trace position and the per-sweep counters. Without a trace OPT behaves as LRU and says so in
`effective_policy`.

Every operation is O(1) (ordered dicts, swap-remove lists, frequency buckets) or O(log n) (OPT's heap
with lazy invalidation and its per-key position lists searched by bisection).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

CACHE_POLICIES = ("none", "lru", "fifo", "lfu", "rr", "opt")
NEVER = float("inf")  # next use of a key with no future access


def _clone(payload: Any) -> Any:
    return payload.clone()


class BatchCache:
    """Base class: the payload store, counters and the get/put protocol; subclasses choose victims."""

    policy = "base"

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"cache capacity must be an integer >= 1 (batches), got {capacity!r}")
        self.capacity = capacity
        self._data: dict[Hashable, Any] = {}
        self.hits = self.misses = self.bypasses = self.evictions = 0
        self.sweep_hits = self.sweep_misses = 0
        self.trace_length = 0

    # -- policy hooks -------------------------------------------------------------------------------
    def _on_access(self, key: Hashable) -> None:
        """Called for every get, before the lookup."""

    def _on_hit(self, key: Hashable) -> None:
        pass

    def _on_insert(self, key: Hashable) -> None:
        pass

    def _admit(self, key: Hashable) -> bool:
        """Whether a new key may replace a victim when the cache is full."""
        return True

    def _pop_victim(self) -> Hashable:
        raise NotImplementedError

    @property
    def effective_policy(self) -> str:
        return self.policy

    # -- protocol ------------------------------------------------------------------------------------
    def contains(self, key: Hashable) -> bool:
        """Membership without counting an access or touching recency (for read-ahead decisions)."""
        return key in self._data

    def peek(self, key: Hashable) -> Any | None:
        """The stored payload itself (no clone, no access counted), for read-ahead only: the caller must
        not modify it. Payloads are never modified in the cache, so a peeked one stays valid after eviction."""
        return self._data.get(key)

    def get(self, key: Hashable) -> Any | None:
        self._on_access(key)
        payload = self._data.get(key)
        if payload is None:
            self.misses += 1
            self.sweep_misses += 1
            return None
        self.hits += 1
        self.sweep_hits += 1
        self._on_hit(key)
        return _clone(payload)

    def put(self, key: Hashable, payload: Any) -> bool:
        """Offer a payload; returns whether it is now cached."""
        if key in self._data:
            self._data[key] = _clone(payload)
            return True
        if len(self._data) >= self.capacity:
            if not self._admit(key):
                self.bypasses += 1
                return False
            victim = self._pop_victim()
            del self._data[victim]
            self.evictions += 1
        self._data[key] = _clone(payload)
        self._on_insert(key)
        return True

    def set_trace(self, trace: Iterable[Hashable], cyclic: bool = False) -> None:
        """The planned access order; only OPT uses it. Resets the per-sweep counters, keeps payloads."""
        self.trace_length = len(trace) if isinstance(trace, Sequence) else sum(1 for _ in trace)
        self.sweep_hits = self.sweep_misses = 0

    def keys(self) -> list[Hashable]:
        return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict:
        accesses = self.hits + self.misses
        sweep = self.sweep_hits + self.sweep_misses
        return {
            "enabled": True,
            "policy": self.policy,
            "effective_policy": self.effective_policy,
            "capacity": self.capacity,
            "items": len(self._data),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / accesses if accesses else 0.0,
            "bypasses": self.bypasses,
            "evictions": self.evictions,
            "sweep_hits": self.sweep_hits,
            "sweep_misses": self.sweep_misses,
            "sweep_hit_rate": self.sweep_hits / sweep if sweep else 0.0,
            "opt_active": False,
            "trace_length": self.trace_length,
        }


class NoCache(BatchCache):
    """Caching off: every get is a miss, put stores nothing."""

    policy = "none"

    def __init__(self, capacity: int = 1):
        super().__init__(max(1, capacity) if isinstance(capacity, int) else 1)

    def put(self, key: Hashable, payload: Any) -> bool:
        return False

    def stats(self) -> dict:
        out = super().stats()
        out.update(enabled=False, capacity=0)
        return out


class FIFOCache(BatchCache):
    """Evicts in insertion order; hits do not refresh."""

    policy = "fifo"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._data = OrderedDict()  # its front stays cheap to reach after many evictions, unlike a dict's

    def _pop_victim(self):
        return next(iter(self._data))


class LRUCache(FIFOCache):
    """FIFO whose hits move the key to the back, so the front is the least recently used."""

    policy = "lru"

    def _on_hit(self, key):
        self._data.move_to_end(key)


class LFUCache(BatchCache):
    """Evicts the least frequently used key (accesses while cached); ties go to the least recently used."""

    policy = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._freq: dict[Hashable, int] = {}
        self._buckets: dict[int, OrderedDict] = {}
        self._min_freq = 0

    def _on_hit(self, key):
        f = self._freq[key]
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]
            if self._min_freq == f:
                self._min_freq = f + 1
        self._freq[key] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[key] = None

    def _on_insert(self, key):
        self._freq[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None
        self._min_freq = 1

    def _pop_victim(self):
        bucket = self._buckets[self._min_freq]
        key, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._min_freq]
        del self._freq[key]
        return key


class RandomCache(BatchCache):
    """Random replacement, seeded."""

    policy = "rr"

    def __init__(self, capacity: int, seed: int = 0):
        super().__init__(capacity)
        self._rng = random.Random(seed)
        self._keys: list[Hashable] = []
        self._index: dict[Hashable, int] = {}

    def _on_insert(self, key):
        self._index[key] = len(self._keys)
        self._keys.append(key)

    def _pop_victim(self):
        i = self._rng.randrange(len(self._keys))
        key = self._keys[i]
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._index[last] = i
        del self._index[key]
        return key


class OptCache(BatchCache):
    """Belady's OPT with bypass over the planned trace; LRU when no trace is set."""

    policy = "opt"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._data = OrderedDict()  # LRU order, used only without a trace
        self._positions: dict[Hashable, list[int]] | None = None
        self._cyclic = False
        self._clock = 0  # absolute position of the next expected access
        self._next: dict[Hashable, float] = {}  # cached key -> absolute next use
        self._version: dict[Hashable, int] = {}
        self._heap: list[tuple[float, int, Hashable]] = []  # (-next_use, version, key), lazily invalidated
        self._incoming: tuple[Hashable, float] | None = None  # next use of the key just accessed
        self.trace_mismatches = 0

    @property
    def opt_active(self) -> bool:
        return self._positions is not None

    @property
    def effective_policy(self) -> str:
        return "opt" if self.opt_active else "lru"

    def set_trace(self, trace: Iterable[Hashable], cyclic: bool = False) -> None:
        trace = list(trace)
        super().set_trace(trace, cyclic)
        positions: dict[Hashable, list[int]] = {}
        for i, key in enumerate(trace):
            positions.setdefault(key, []).append(i)
        self._positions = positions
        self._cyclic = bool(cyclic) and bool(trace)
        self._clock = 0
        self._incoming = None
        self._heap = []
        for key in self._data:
            self._set_next(key, self._occurrence(key, 0))

    def _occurrence(self, key: Hashable, t: int) -> float:
        """Absolute position of the first access of key at or after t (NEVER if none)."""
        pos = self._positions.get(key)
        if not pos:
            return NEVER
        length = self.trace_length
        cycle, offset = divmod(t, length) if self._cyclic else (0, t)
        i = bisect.bisect_left(pos, offset)
        if i < len(pos):
            return cycle * length + pos[i]
        return (cycle + 1) * length + pos[0] if self._cyclic else NEVER

    def _set_next(self, key: Hashable, next_use: float) -> None:
        version = self._version.get(key, 0) + 1
        self._version[key] = version
        self._next[key] = next_use
        heapq.heappush(self._heap, (-next_use, version, key))

    def _on_access(self, key):
        if not self.opt_active:
            self._incoming = None
            return
        at = self._occurrence(key, self._clock)
        if at == NEVER:
            self.trace_mismatches += 1
            next_use = NEVER
        else:
            if at != self._clock:
                self.trace_mismatches += 1
            self._clock = int(at) + 1
            next_use = self._occurrence(key, self._clock)
        self._incoming = (key, next_use)
        if key in self._data:
            self._set_next(key, next_use)

    def _on_hit(self, key):
        if not self.opt_active:
            self._data.move_to_end(key)

    def _incoming_next(self, key) -> float:
        if self._incoming is not None and self._incoming[0] == key:
            return self._incoming[1]
        return self._occurrence(key, self._clock)  # a put without a preceding get

    def _top(self) -> tuple[float, Hashable]:
        """The cached key with the farthest next use (dropping stale heap entries)."""
        while True:
            neg_next, version, key = self._heap[0]
            if key in self._data and self._version.get(key) == version:
                return -neg_next, key
            heapq.heappop(self._heap)

    def _admit(self, key) -> bool:
        if not self.opt_active:
            return True
        farthest, _ = self._top()
        return self._incoming_next(key) < farthest

    def _pop_victim(self):
        if not self.opt_active:
            return next(iter(self._data))
        _, key = self._top()
        heapq.heappop(self._heap)
        del self._next[key]
        self._version.pop(key, None)
        return key

    def _on_insert(self, key):
        if self.opt_active:
            self._set_next(key, self._incoming_next(key))
        # keep the heap from growing without bound through stale entries
        if len(self._heap) > 4 * max(len(self._data), 16):
            self._heap = [(-self._next[k], self._version[k], k) for k in self._data if k in self._next]
            heapq.heapify(self._heap)

    def stats(self) -> dict:
        out = super().stats()
        out.update(opt_active=self.opt_active, trace_mismatches=self.trace_mismatches)
        return out


def make_cache(policy: str, capacity: int = 512, *, seed: int = 0) -> BatchCache:
    """A cache by policy name (one of CACHE_POLICIES); capacity in batches."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; allowed: {', '.join(CACHE_POLICIES)}")
    if policy == "none":
        return NoCache()
    if policy == "rr":
        return RandomCache(capacity, seed=seed)
    return {"lru": LRUCache, "fifo": FIFOCache, "lfu": LFUCache, "opt": OptCache}[policy](capacity)


def belady_hit_count(trace: Sequence[Hashable], capacity: int) -> int:
    """Hits of Belady's optimal policy (with bypass) on a trace, computed offline from next-use arrays.

    Written independently of OptCache (next-use array by a backward pass, a max-heap of next uses) so the
    benchmark can check the cache against it.
    """
    n = len(trace)
    next_use = [0] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(trace[i], n)  # n means never again
        last[trace[i]] = i
    cached: dict[Hashable, int] = {}  # key -> its next use
    heap: list[tuple[int, Hashable]] = []
    hits = 0
    for i, key in enumerate(trace):
        if key in cached:
            hits += 1
            cached[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
            continue
        if len(cached) < capacity:
            cached[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
            continue
        while -heap[0][0] != cached.get(heap[0][1]):
            heapq.heappop(heap)
        farthest, victim = -heap[0][0], heap[0][1]
        if next_use[i] < farthest:
            heapq.heappop(heap)
            del cached[victim]
            cached[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
    return hits
