"""Batch caches: eviction order per policy, OPT against a brute-force Belady, clone isolation, stats."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pcvr_lib.data.cache import CACHE_POLICIES, OptCache, belady_hit_count, make_cache


def payload(i) -> torch.Tensor:
    return torch.tensor([hash(i) % 1000])


def run(cache, trace) -> list[bool]:
    """Access the trace: get, and put on a miss. Returns the hit flags."""
    flags = []
    for key in trace:
        got = cache.get(key)
        flags.append(got is not None)
        if got is None:
            cache.put(key, payload(key))
        else:
            assert torch.equal(got, payload(key))  # a hit returns what was put under that key
    return flags


def brute_force_belady(trace, capacity) -> int:
    """Belady with bypass, written the obvious way: on a miss with a full cache, among the cached keys
    and the incoming one, drop the one used farthest in the future (scanning the rest of the trace)."""

    def next_use(key, i):
        for j in range(i + 1, len(trace)):
            if trace[j] == key:
                return j
        return len(trace) + 1  # never

    cached: set = set()
    hits = 0
    for i, key in enumerate(trace):
        if key in cached:
            hits += 1
            continue
        if len(cached) < capacity:
            cached.add(key)
            continue
        candidates = sorted(cached | {key}, key=lambda k: (next_use(k, i), k != key))
        farthest = candidates[-1]
        if farthest != key:
            cached.discard(farthest)
            cached.add(key)
    return hits


def test_lru_evicts_least_recently_used():
    cache = make_cache("lru", 2)
    run(cache, ["a", "b", "a", "c"])  # b is least recently used
    assert sorted(cache.keys()) == ["a", "c"]


def test_fifo_evicts_oldest_insert_even_after_hits():
    cache = make_cache("fifo", 2)
    run(cache, ["a", "b", "a", "c"])  # a was inserted first; its hit does not refresh it
    assert sorted(cache.keys()) == ["b", "c"]


def test_lfu_evicts_least_frequent_then_least_recent():
    cache = make_cache("lfu", 2)
    run(cache, ["a", "a", "b", "c"])  # b has 1 use, a has 2
    assert sorted(cache.keys()) == ["a", "c"]
    cache = make_cache("lfu", 3)
    run(cache, ["x", "y", "z", "y", "z", "w"])  # x is the only key used once
    assert sorted(cache.keys()) == ["w", "y", "z"]
    run(cache, ["v"])  # w and v are both used once; w is older
    assert sorted(cache.keys()) == ["v", "y", "z"]


def test_rr_is_seeded_and_keeps_capacity():
    trace = [i % 7 for i in range(200)]
    a, b = make_cache("rr", 3, seed=5), make_cache("rr", 3, seed=5)
    assert run(a, trace) == run(b, trace)
    assert len(a) == 3 and sorted(a.keys()) == sorted(b.keys())
    assert a.stats()["evictions"] == a.stats()["misses"] - 3


def test_opt_evicts_the_farthest_key():
    cache = OptCache(2)
    trace = ["a", "b", "c", "a", "c", "b"]
    cache.set_trace(trace)
    hits = run(cache, trace[:3])  # at c: a is next used at 3, c at 4, b at 5 -> b is evicted
    assert hits == [False, False, False]
    assert sorted(cache.keys()) == ["a", "c"]
    assert run(cache, trace[3:]) == [True, True, False]
    assert cache.stats()["evictions"] == 1


def test_opt_bypasses_a_key_with_no_future():
    cache = OptCache(2)
    trace = ["a", "b", "c", "a", "b"]  # c is never used again: it must not displace a or b
    cache.set_trace(trace)
    assert run(cache, trace) == [False, False, False, True, True]
    stats = cache.stats()
    assert stats["bypasses"] == 1 and stats["evictions"] == 0 and stats["hits"] == 2


def test_opt_without_trace_is_lru_and_says_so():
    cache = OptCache(2)
    assert cache.stats()["effective_policy"] == "lru" and not cache.stats()["opt_active"]
    run(cache, ["a", "b", "a", "c"])
    assert sorted(cache.keys()) == ["a", "c"]
    cache.set_trace(["c", "a"])
    assert cache.stats()["effective_policy"] == "opt" and cache.stats()["opt_active"]


def test_opt_cyclic_trace_and_per_sweep_rebuild_keep_payloads():
    sweep = [f"k{i}" for i in range(6)]
    cache = OptCache(3)
    cache.set_trace(sweep, cyclic=True)
    run(cache, sweep)
    # the cyclic trace says k0.. come back next sweep: the cache holds keys of the next sweep's head
    assert len(cache) == 3
    second = list(reversed(sweep))
    cache.set_trace(second)  # a rebuilt (different) order keeps the payloads, resets sweep counters
    assert cache.stats()["sweep_hits"] == 0 and cache.stats()["trace_length"] == 6
    flags = run(cache, second)
    assert sum(flags) == cache.stats()["sweep_hits"] >= 3  # the 3 kept keys all hit in the new order
    assert cache.stats()["hits"] == sum(flags)


@settings(max_examples=150, deadline=None)
@given(
    trace=st.lists(st.integers(0, 9), min_size=1, max_size=60),
    capacity=st.integers(1, 6),
)
def test_opt_equals_brute_force_belady(trace, capacity):
    expected = brute_force_belady(trace, capacity)
    cache = OptCache(capacity)
    cache.set_trace(trace)
    assert sum(run(cache, trace)) == expected
    assert cache.stats()["trace_mismatches"] == 0
    assert belady_hit_count(trace, capacity) == expected
    # no online policy beats the optimum
    for policy in ("lru", "fifo", "lfu", "rr"):
        assert sum(run(make_cache(policy, capacity), trace)) <= expected


@pytest.mark.parametrize("policy", [p for p in CACHE_POLICIES if p != "none"])
def test_clone_isolation(policy):
    cache = make_cache(policy, 4)
    cache.set_trace(["k", "k", "k"])
    original = torch.arange(5)
    assert cache.get("k") is None
    cache.put("k", original)
    original.zero_()  # changing what was put does not reach the cache
    got = cache.get("k")
    assert torch.equal(got, torch.arange(5))
    got.fill_(-1)  # changing what was got does not either
    assert torch.equal(cache.get("k"), torch.arange(5))


def test_peek_and_contains_count_nothing():
    cache = make_cache("lru", 2)
    run(cache, ["a", "b"])
    before = cache.stats()
    assert cache.contains("a") and cache.peek("a") is cache.peek("a") and cache.peek("z") is None
    assert cache.stats() == before
    run(cache, ["c"])  # peeking did not refresh a: it is still the LRU victim
    assert sorted(cache.keys()) == ["b", "c"]


def test_none_cache_counts_misses_and_stores_nothing():
    cache = make_cache("none", 8)
    assert run(cache, ["a", "a", "a"]) == [False, False, False]
    stats = cache.stats()
    assert stats["enabled"] is False and stats["items"] == 0 and stats["misses"] == 3 and stats["hit_rate"] == 0.0


def test_stats_fields_and_counts():
    cache = make_cache("lru", 2)
    run(cache, ["a", "b", "a", "c", "b"])
    stats = cache.stats()
    for field in (
        "enabled",
        "policy",
        "effective_policy",
        "items",
        "hits",
        "misses",
        "hit_rate",
        "bypasses",
        "evictions",
        "opt_active",
        "trace_length",
    ):
        assert field in stats
    assert (stats["hits"], stats["misses"], stats["evictions"], stats["items"]) == (1, 4, 2, 2)
    assert stats["hit_rate"] == pytest.approx(0.2)


def test_bad_policy_and_capacity():
    with pytest.raises(ValueError, match="unknown cache policy 'mru'.*lru"):
        make_cache("mru", 4)
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        make_cache("lru", 0)


def test_opt_operations_scale():
    # 20k accesses over 2k keys with a 500-batch cache: quadratic scans would take far longer than this test
    import random

    rng = random.Random(0)
    trace = [rng.randrange(2000) for _ in range(20_000)]
    cache = OptCache(500)
    cache.set_trace(trace)
    hits = sum(run(cache, trace))
    assert hits == belady_hit_count(trace, 500)
    assert len(cache._heap) <= 4 * 500 + 1
