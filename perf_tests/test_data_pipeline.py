"""Data-pipeline benchmarks: preset x mode.

- mode=loader: the full pipeline (parquet row-group scan -> Arrow -> convert -> cache -> augment) through
  `PcvrLoader`, row-group sweeps with a shuffled order per pass so caches matter; floor: plainly reading
  the same columns of the same row groups with pyarrow, read before every loader round and after the last;
  `ratio_to_pyarrow_read` is the median over rounds of the loader's rows/s over the floor read around
  that round (robust to the machine's load changing between rounds); `ratio_best_to_best` also kept.
- mode=convert: Arrow batches preloaded in memory, only the converter timed (the preset decides the
  converter's strict_time_filter); floor: copying one converted batch's bytes once (wall clock, best of 5;
  test_converter_micro's copy_floor_seconds).

Rows per second count source rows (the augment presets' second views are extra output, not extra input).
Sizes come from the `data_scale` fixture: ci (seconds), default (stable numbers in a few minutes on two
cores), full (the reference's 300x). Correctness is checked before anything is recorded: row and batch
counts match the plan, and OPT's hits equal Belady's optimum on the same trace.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pcvr_lib import sources, timing
from pcvr_lib.data.cache import CACHE_POLICIES, belady_hit_count, make_cache
from pcvr_lib.data.convert import Converter
from pcvr_lib.data.generate import generate_dataset, generation_info
from pcvr_lib.data.loader import PRESETS, PcvrLoader, file_list_order
from pcvr_lib.schema import load_schema
from perf_tests.planted import planted
from perf_tests.test_converter_micro import copy_floor_seconds

MODES = ("loader", "convert")
CASES = [pytest.param(p, m, id=f"preset={p},mode={m}") for p in PRESETS for m in MODES]

# rows x multiplier of generated demo data; batches; passes per loader round; preloaded converter batches
SCALES = {
    "ci": dict(rows=600, multiplier=1, row_group_size=200, batch_size=128, passes=2, convert_batches=4, rounds=1),
    "default": dict(
        rows=1000, multiplier=12, row_group_size=1000, batch_size=256, passes=2, convert_batches=24, rounds=3
    ),
    # 300k rows (the seed's 300x, `make bench DATA_SCALE=300`): one shuffled pass per case (the loader cases
    # take minutes each on two cores), cache capped at 128 batches (~2.6 GB of 20 MB batches) to fit a 24 GB
    # machine shared with other jobs
    "full": dict(
        rows=1000,
        multiplier=300,
        row_group_size=1000,
        batch_size=256,
        passes=1,
        convert_batches=64,
        rounds=1,
        cache_max=128,
    ),
}
CACHE_FRACTION = 0.4  # cache capacity as a share of the distinct batches (the reference: 512 of ~1200)


@pytest.fixture(scope="module")
def setup(data_scale, data_cache_dir, repo_root):
    cfg = dict(SCALES[data_scale], scale=data_scale)
    schema = load_schema(repo_root / "fixtures" / "sample_1000_raw.schema.json")
    path = generate_dataset(
        schema,
        rows=cfg["rows"],
        multiplier=cfg["multiplier"],
        row_group_size=cfg["row_group_size"],
        cache_dir=data_cache_dir,
        progress=True,
    )
    cfg["data_file"] = {"path": str(path), "bytes": path.stat().st_size, "generation": generation_info(path)}
    return cfg, schema, path


def _loader(cfg, schema, path, preset, **options) -> PcvrLoader:
    probe = PcvrLoader(path, schema, batch_size=cfg["batch_size"])
    capacity = max(1, min(int(probe.planned_batches * CACHE_FRACTION), cfg.get("cache_max", 1 << 30)))
    return PcvrLoader(
        path,
        schema,
        preset=preset,
        batch_size=cfg["batch_size"],
        passes=cfg["passes"],
        shuffle=True,
        seed=0,
        cache_capacity=capacity,
        **options,
    )


def policy_hit_rates(trace, capacity) -> dict[str, float]:
    """Hit rate of every cache policy replaying the loader's access trace (tiny payloads)."""
    token = torch.zeros(1)
    rates = {}
    for policy in CACHE_POLICIES:
        if policy == "none":
            continue
        cache = make_cache(policy, capacity)
        cache.set_trace(trace)
        for key in trace:
            if cache.get(key) is None:
                cache.put(key, token)
        rates[policy] = cache.stats()["hit_rate"]
    rates["belady"] = belady_hit_count(trace, capacity) / len(trace)
    return rates


RETURNS = {"loader": "every planned batch of the file, converted (pcvr_lib.data.batch.Batch)",
           "convert": "the converted batches (pcvr_lib.data.batch.Batch)"}


def run_loader_case(benchmark, cfg, schema, path, preset, round_line):
    info = benchmark.extra_info
    info.update(returns=RETURNS["loader"], **sources.stamp("data:loader"))
    timings: list[float] = []
    holder: dict = {}

    floor_timings: list[float] = []
    pf = pq.ParquetFile(path)
    columns = schema.converter_columns

    def read_floor():
        start = time.perf_counter()
        n = sum(pf.read_row_group(g, columns=columns).num_rows for g in range(pf.metadata.num_row_groups))
        floor_timings.append(time.perf_counter() - start)
        assert n == pf.metadata.num_rows

    def make():
        # the pyarrow floor is read before every loader round (and once after the last), so each round
        # can be compared with the floor measured around it, under the same machine load
        read_floor()
        holder["loader"] = _loader(cfg, schema, path, preset)
        return (), {}

    def run():
        loader = holder["loader"]
        start = time.perf_counter()
        rows = batches = 0
        nbytes = 0
        for batch in loader:
            rows += batch.batch_size
            batches += 1
            nbytes = max(nbytes, batch.nbytes)
        timings.append(time.perf_counter() - start)
        round_line(f"round {len(timings)}/{cfg['rounds']}: {rows:,} rows in {timings[-1]:.1f} s wall "
                   f"({rows / timings[-1]:,.0f} rows/s)")
        return rows, batches, nbytes

    # gated on process CPU time (the loader's reader thread included), not on wall time
    rows, batches, nbytes = timing.bench_cpu(benchmark, planted(run, time.process_time), setup=make,
                                             rounds=cfg["rounds"], warmup_rounds=0)
    read_floor()
    loader = holder["loader"]
    stats = loader.stats()
    views = 2 if PRESETS[preset].augmentations else 1
    # correctness before numbers: everything planned came out, once
    assert batches == loader.planned_batches == stats["batches"]
    assert rows == loader.planned_rows * views == stats["rows"]
    cache = stats["cache"]
    assert cache["hits"] + cache["misses"] == batches
    trace = [key for _, _, key in loader.plan_items()]
    rates = policy_hit_rates(trace, loader.cache_capacity)
    if loader.cache_policy == "opt":
        assert cache["hits"] == belady_hit_count(trace, loader.cache_capacity)
    if loader.cache_policy == "none":
        assert cache["hits"] == 0

    best = min(timings)
    source_rows = loader.planned_rows
    file_rows = pf.metadata.num_rows
    floor = file_rows / min(floor_timings)
    # per round: loader rows/s over the floor's rows/s averaged from the reads just before and after it
    round_ratios = [
        (source_rows / t) / (file_rows / ((before + after) / 2))
        for t, before, after in zip(timings, floor_timings[:-1], floor_timings[1:], strict=False)
    ]
    rows_per_sec = source_rows / best
    info.update(
        scale=cfg["scale"],
        data_file=cfg["data_file"],
        mode="loader",
        preset=preset,
        rows_per_sec=rows_per_sec,
        batches_per_sec=batches / best,
        measured_rows=source_rows,
        output_rows=rows,
        measured_batches=batches,
        elapsed_sec=best,
        batch_size=loader.batch_size,
        passes=loader.passes,
        num_workers=loader.num_workers,
        cache_impl=loader.cache_policy,
        cache_capacity=loader.cache_capacity if loader.cache_policy != "none" else 0,
        cache_hit_rate=cache["hit_rate"],
        cache_stats=cache,
        hit_rates_same_trace=rates,
        strict_time_filter=loader.strict_time_filter,
        augmentations=stats["augmentations"],
        bytes_per_batch=nbytes,
        row_groups_read=stats["row_groups_read"],
        late_reads=stats["late_reads"],
        reused_after_eviction=stats["reused_after_eviction"],
        list_order_detected=stats["list_order_detected"],
        list_order_rows=stats["list_order_rows"],
        pyarrow_read_rows_per_sec=floor,
        ratio_to_pyarrow_read=float(np.median(round_ratios)),
        ratio_to_pyarrow_read_per_round=round_ratios,
        ratio_best_to_best=rows_per_sec / floor,
    )


def run_convert_case(benchmark, cfg, schema, path, preset):
    info = benchmark.extra_info
    info.update(returns=RETURNS["convert"], **sources.stamp("data:convert"))
    strict = PRESETS[preset].strict_time_filter
    pf = pq.ParquetFile(path)
    size = cfg["batch_size"]
    batches = []
    for g in range(pf.metadata.num_row_groups):  # preload Arrow batches (row-group aligned, like the loader)
        table = pf.read_row_group(g, columns=schema.converter_columns)
        for start in range(0, table.num_rows, size):
            batches.append(table.slice(start, size))
        if len(batches) >= cfg["convert_batches"]:
            break
    batches = batches[: cfg["convert_batches"]]
    converter = Converter(schema, training=True, strict_time_filter=strict)
    timings: list[float] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the converter is one process, one thread

    def run():
        start = time.perf_counter()
        rows = 0
        out = None
        for data in batches:
            out = converter(data)
            rows += out.batch_size
        timings.append(time.perf_counter() - start)
        return rows, out

    try:
        # 3x the loader's rounds: a round is ~0.15 s of CPU here, and the gate reads the least disturbed one
        rows, last = timing.bench_cpu(benchmark, planted(run), rounds=3 * cfg["rounds"], warmup_rounds=0,
                                      clock=time.thread_time)
        first = converter(batches[0])
        copy_sec, _ = copy_floor_seconds([first], repeats=5)  # wall clock; one batch, so a cache-warm source
    finally:
        torch.set_num_threads(previous)
    assert rows == sum(b.num_rows for b in batches)
    best = min(timings)
    rows_per_sec = rows / best
    copy_rows_per_sec = first.batch_size / copy_sec
    info.update(
        scale=cfg["scale"],
        data_file=cfg["data_file"],
        mode="convert",
        preset=preset,
        rows_per_sec=rows_per_sec,
        batches_per_sec=len(batches) / best,
        measured_rows=rows,
        measured_batches=len(batches),
        preloaded_batches=len(batches),
        elapsed_sec=best,
        batch_size=size,
        cache_impl=PRESETS[preset].cache_policy,
        cache_stats=None,  # convert mode times the converter only; no cache is involved
        cache_hit_rate=None,
        strict_time_filter=strict,
        bytes_per_batch=first.nbytes,
        copy_floor_sec_per_batch=copy_sec,
        copy_floor_rows_per_sec=copy_rows_per_sec,
        ratio_to_copy_floor=rows_per_sec / copy_rows_per_sec,
        oob_total=converter.stats["oob_total"],
        list_order_detected={d: file_list_order(c) for d, c in converter.stats["list_order_rows"].items()},
        list_order_rows=converter.stats["list_order_rows"],
    )


@pytest.mark.benchmark(group="data-pipeline")
@pytest.mark.parametrize("preset, mode", CASES)
def test_data_pipeline(benchmark, setup, preset, mode, round_line):
    cfg, schema, path = setup
    if mode == "loader":
        run_loader_case(benchmark, cfg, schema, path, preset, round_line)
    else:
        run_convert_case(benchmark, cfg, schema, path, preset)


def _threaded_read_seconds(path, columns, groups: int, threads: int) -> float:
    """Wall seconds to read every row group's columns with `threads` reader threads (a file handle each,
    pyarrow's own pool off), the floor for a loader with as many worker processes."""
    from concurrent.futures import ThreadPoolExecutor

    def read(part: int) -> int:
        pf = pq.ParquetFile(path)
        mine = range(part, groups, threads)
        return sum(pf.read_row_group(g, columns=columns, use_threads=False).num_rows for g in mine)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        rows = sum(pool.map(read, range(threads)))
    seconds = time.perf_counter() - start
    assert rows == pq.ParquetFile(path).metadata.num_rows
    return seconds


@pytest.mark.benchmark(group="data-loader-workers")
@pytest.mark.parametrize(
    "preset, workers",
    [pytest.param(p, w, id=f"preset={p},workers={w}") for p in ("none", "opt") for w in (0, 1, 2)],
)
def test_loader_workers(benchmark, setup, preset, workers, round_line):
    """The loader (the pipeline cases' passes, shuffle and cache capacity) with 0, 1, 2 worker processes
    against a pyarrow read of the same columns with as many reader threads (1 for 0 workers: the loader's
    own read-ahead thread), read before and after the loader round; ratio = loader rows/s over the mean of
    the two reads' rows/s. With workers the cache is one cache shared by them (its hits per worker and
    overall are stored, and must equal the single-process loader's on the same plan). The workers hand their
    batches over through shared-memory slots (pcvr_lib/data/batch_ring.py; `handoff` in extra_info)."""
    cfg, schema, path = setup
    columns = schema.converter_columns
    groups = pq.ParquetFile(path).metadata.num_row_groups
    threads = max(1, workers)
    floors: list[float] = []
    holder: dict = {}

    def make():  # per round: a fresh loader (its workers forked anew), the previous one's workers stopped first
        if "loader" in holder:
            holder["loader"].close()
        floors.append(_threaded_read_seconds(path, columns, groups, threads))
        holder["loader"] = _loader(cfg, schema, path, preset, num_workers=workers, pin_memory=False)
        return (), {}

    round_seconds: list[float] = []

    def run():
        start = time.perf_counter()
        rows = sum(batch.batch_size for batch in holder["loader"])
        round_seconds.append(time.perf_counter() - start)
        round_line(f"round {len(round_seconds)}/{cfg['rounds']}: {rows:,} rows in {round_seconds[-1]:.1f} s "
                   f"({rows / round_seconds[-1]:,.0f} rows/s)")
        return rows

    # the pipeline cases' rounds (3 at the default scale): one ~3 s round moves by +-10% on a small machine,
    # too much to tell 2 workers from 0 (notes/data-pipeline.md); the median of the rounds is the figure
    rows = benchmark.pedantic(run, setup=make, rounds=cfg["rounds"], iterations=1)
    seconds = float(np.median(round_seconds))
    floors.append(_threaded_read_seconds(path, columns, groups, threads))
    loader = holder["loader"]
    assert rows == loader.planned_rows == loader.stats()["rows"]  # everything planned came out, once
    file_rows = pq.ParquetFile(path).metadata.num_rows
    floor_rows_per_sec = file_rows / (sum(floors) / len(floors))
    stats = loader.stats()
    cache = stats["cache"]
    assert cache["hits"] + cache["misses"] == loader.planned_batches
    if preset != "none":  # one cache whatever the worker count: the single-process policy's hits
        plan = loader.shared_cache_plan()
        assert cache["hits"] == plan.stats["hits"] == sum(s >= 0 for s in plan.source)
        if preset == "opt":
            assert cache["hits"] == belady_hit_count([key for _, _, key in loader.plan_items()], loader.cache_capacity)
    per_worker = cache.get("per_worker") or [cache]
    benchmark.extra_info.update(
        returns=RETURNS["loader"],
        **sources.stamp("data:loader"),
        preset=preset,
        cache_capacity=loader.cache_capacity if preset != "none" else 0,
        cache_hit_rate=cache["hit_rate"],
        cache_hit_rate_per_worker=[w["hit_rate"] for w in per_worker],
        cache_hits_per_worker=[w["hits"] for w in per_worker],
        cache_served_by_other_workers=cache.get("served_by_other_workers", 0),
        cache_shared_across_workers=cache.get("shared_across_workers", False),
        row_groups_read=stats["row_groups_read"],
        row_groups_read_per_worker=[w["row_groups_read"] for w in loader.stats_per_worker()],
        scale=cfg["scale"],
        num_workers=workers,
        pyarrow_threads=threads,
        rows_per_sec=rows / seconds,  # of the median round
        rows_per_sec_per_round=[rows / t for t in round_seconds],
        measured_rows=rows,
        elapsed_sec=seconds,
        pyarrow_read_rows_per_sec=floor_rows_per_sec,
        pyarrow_read_sec=floors,
        ratio_to_pyarrow_read=(rows / seconds) / floor_rows_per_sec,
        per_worker_rows=[w["rows"] for w in loader.stats_per_worker()],
        # how batches reached this process: slots of the workers' shared-memory rings (copied: made after
        # conversion, e.g. cache hits), pickled when every slot was held; None without workers
        handoff=stats["handoff"],
        loader_arrow_threads=stats["arrow_threads"],  # each decoding process's Arrow pool (workers: their share)
    )
    loader.close()  # its worker processes and shared memory go now, not while the next case is timed
