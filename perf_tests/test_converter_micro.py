"""Converter micro-benchmark: rows/s of Converter on preloaded Arrow batches, one thread, and the same-run
copy floor (copying one converted batch's bytes once into preallocated tensors).

As a pytest-benchmark case (small data under CI):
    pytest perf_tests/test_converter_micro.py --benchmark-only
Standalone, the numbers in notes/data-convert.md (--multiplier defaults to 30):
    python perf_tests/test_converter_micro.py --batches 40 --passes 5 [--strict] [--backend numpy]
        [--data-order newest-first] [--list-order newest-first]
    python perf_tests/test_converter_micro.py --ab-list-order [--data-order newest-first] [--strict]
the last one the cost of telling the order per row: list_order="auto" against the order given, interleaved
in one process (which converter reads a batch first alternates, so neither always gets a warm source).
    python perf_tests/test_converter_micro.py --ab-rev REV [--data-order newest-first] [--strict] [--json X]
the converter of git revision REV (its pcvr_lib/data modules and C source, imported for the A side) against the
checkout's, same batches, one process, interleaved A-B-B-A, thread CPU time, with the copy floor and the
bytes each side must move measured in the same run, and the outputs checked bit-identical.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pcvr_lib import sources, timing  # noqa: E402
from pcvr_lib.data.convert import Converter  # noqa: E402
from pcvr_lib.data.generate import generate_dataset  # noqa: E402
from pcvr_lib.schema import load_schema  # noqa: E402
from perf_tests.planted import planted  # noqa: E402

SCHEMA = ROOT / "fixtures" / "sample_1000_raw.schema.json"


def single_thread() -> None:
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def preload(path: Path, n_batches: int, batch_size: int) -> list[pa.RecordBatch]:
    """n_batches record batches of batch_size rows, taken from row groups spread over the whole file."""
    parquet = pq.ParquetFile(path)
    groups = parquet.metadata.num_row_groups
    per_group = max(1, parquet.metadata.row_group(0).num_rows // batch_size)
    wanted = min(groups, -(-n_batches // per_group))
    step = max(1, groups // wanted)
    out: list[pa.RecordBatch] = []
    for g in range(0, groups, step):
        for rb in parquet.iter_batches(batch_size=batch_size, row_groups=[g]):
            if rb.num_rows == batch_size:
                out.append(rb)
        if len(out) >= n_batches:
            break
    return out[:n_batches]


def _clocks() -> tuple[float, float]:
    # wall time and this thread's CPU time: the shared 2-core machine is often busy, and CPU time is
    # what one converter thread costs regardless of what else runs
    return time.perf_counter(), time.thread_time()


def copy_floor_seconds(batches, repeats: int = 3) -> tuple[float, float]:
    """(wall, cpu) seconds to copy one converted batch's tensors once into preallocated tensors, averaged
    over distinct batches (so the source is not hot in cache), best of `repeats`."""
    srcs = [b.tensors() for b in batches]
    dst = [torch.empty_like(t) for t in srcs[0]]
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        w0, c0 = _clocks()
        for src in srcs:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        w1, c1 = _clocks()
        best = (min(best[0], (w1 - w0) / len(srcs)), min(best[1], (c1 - c0) / len(srcs)))
    return best


def source_bytes(schema, rb: pa.RecordBatch) -> int:
    """Bytes of Arrow source a non-strict conversion of `rb` must read (lower bound): per sequence column
    the int64 of its kept window min(len, L) per row, every event time once (the per-row order check), the
    first `dim` elements of each int / dense list, the width-1 ints and the request timestamps."""
    import pyarrow.compute as pc

    total = 8 * rb.num_rows * (3 + sum(1 for f in schema.user_int + schema.item_int if f.dim == 1))
    for feat in schema.user_int + schema.item_int + schema.user_dense + schema.item_dense:
        if feat.dim > 1 or feat in schema.user_dense + schema.item_dense:
            size = 4 if feat in schema.user_dense + schema.item_dense else 8
            lengths = pc.fill_null(pc.list_value_length(rb.column(feat.column)), 0).to_numpy()
            total += size * int(np.minimum(lengths, feat.dim).sum())
    for domain in schema.domains:
        for feat in domain.features:
            lengths = pc.fill_null(pc.list_value_length(rb.column(feat.column)), 0).to_numpy()
            total += 8 * int(np.minimum(lengths, domain.max_len).sum())
            if feat.fid == domain.ts_fid:
                total += 8 * int(lengths.sum())
    return total


def measure(converter: Converter, batches: list[pa.RecordBatch], passes: int = 3) -> dict:
    """Convert every batch `passes` times. Per batch the fastest pass counts (the 2-core machine is shared,
    and the minimum is the least disturbed); thread CPU time, with wall time alongside."""
    converter(batches[0])  # warm-up
    cpu = np.full((passes, len(batches)), np.inf)
    wall = np.full((passes, len(batches)), np.inf)
    kept = []
    for p in range(passes):
        for i, rb in enumerate(batches):
            w0, c0 = _clocks()
            batch = converter(rb, row_offset=i * rb.num_rows)
            w1, c1 = _clocks()
            cpu[p, i], wall[p, i] = c1 - c0, w1 - w0
            if p == 0 and len(kept) < 8:
                kept.append(batch)
            del batch
    rows = sum(rb.num_rows for rb in batches)
    best_cpu, best_wall = cpu.min(axis=0).sum(), wall.min(axis=0).sum()
    floor_wall, floor_cpu = copy_floor_seconds(kept)
    per_batch = best_cpu / len(batches)
    source = sum(source_bytes(converter.schema, rb) for rb in batches) / len(batches)
    return {
        # what bounds the ratio to the copy floor: the floor reads and writes the output once (2 x
        # bytes_per_batch); the converter reads int64 source (the kept windows, and with list_order="auto"
        # every event time once) and writes the int32 output
        "source_bytes_per_batch": source,
        "bytes_moved_ratio_floor_to_converter": 2 * kept[0].nbytes / (source + kept[0].nbytes),
        "rows_per_sec": rows / best_cpu,
        "rows_per_sec_wall": rows / best_wall,
        "rows_per_sec_median_pass": rows / float(np.median(cpu.sum(axis=1))),
        "batches_per_sec": len(batches) / best_cpu,
        "ms_per_batch": per_batch * 1e3,
        "bytes_per_batch": kept[0].nbytes,
        "copy_floor_ms": floor_cpu * 1e3,
        "copy_floor_ms_wall": floor_wall * 1e3,
        "copy_floor_rows_per_sec": batches[0].num_rows / floor_cpu,
        "ratio_to_copy_floor": floor_cpu / per_batch,
        "strict_time_filter": converter.strict_time_filter,
        "backend": converter.backend,
        "measured_rows": rows,
    }


@pytest.fixture(scope="module")
def micro_batches(data_cache_dir, data_scale):
    multiplier, n_batches = {"ci": (1, 2), "default": (30, 32), "full": (30, 117)}[data_scale]
    path = generate_dataset(SCHEMA, rows=1000, multiplier=multiplier, cache_dir=data_cache_dir, progress=True)
    return preload(path, n_batches, 256)


@pytest.mark.benchmark(group="data-converter")
@pytest.mark.parametrize("strict", [False, True], ids=["strict=0", "strict=1"])
def test_converter_micro(benchmark, micro_batches, strict):
    single_thread()
    schema = load_schema(SCHEMA)
    converter = Converter(schema, strict_time_filter=strict)

    def run():
        for rb in micro_batches:
            converter(rb)

    timing.bench_cpu(benchmark, planted(run), rounds=9, warmup_rounds=1, clock=time.thread_time)  # one thread
    # after the timed rounds, so the per-batch figures see the same warm state (the first pass over freshly
    # generated data pays page faults that made one cold pass read 3x slow)
    benchmark.extra_info.update(measure(converter, micro_batches, passes=3))
    benchmark.extra_info.update(returns="the converted batches (pcvr_lib.data.batch.Batch)",
                                **sources.stamp("data:convert"))


def ab_list_order(schema, batches, data_order: str, strict: bool, passes: int) -> dict[str, float]:
    """ms per batch (thread CPU time, per batch the fastest pass, averaged) of "auto" and the given order."""
    given = "newest-first" if data_order == "newest-first" else "newest-last"
    convs = {"auto": Converter(schema, strict_time_filter=strict), given: Converter(schema, strict_time_filter=strict,
             list_order=given)}  # fmt: skip
    best = {name: np.full(len(batches), np.inf) for name in convs}
    for p in range(passes):
        items = list(convs.items())[:: 1 if p % 2 else -1]
        for i, rb in enumerate(batches):
            for name, conv in items[:: 1 if i % 2 else -1]:
                c0 = time.thread_time()
                batch = conv(rb)
                best[name][i] = min(best[name][i], time.thread_time() - c0)
                del batch
    return {name: float(v.mean() * 1e3) for name, v in best.items()}


def converter_at(rev: str):
    """The Converter class of git revision `rev`: that revision's pcvr_lib/data (the converter's modules and
    their C source) imported in place of the checkout's while the converter is imported, then the checkout's
    modules put back (the revision's stay reachable only through the class returned)."""
    folder = Path(tempfile.mkdtemp(prefix="pcvr-convert-"))
    archive = subprocess.run(["git", "archive", rev, "pcvr_lib/data"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    package = sys.modules["pcvr_lib.data"]
    saved_path = package.__path__
    saved = {name: module for name, module in sys.modules.items() if name.startswith("pcvr_lib.data.")}
    saved_attrs = {name.rsplit(".", 1)[1]: getattr(package, name.rsplit(".", 1)[1], None) for name in saved}
    try:
        for name in saved:
            del sys.modules[name]
        package.__path__ = [str(folder / "pcvr_lib" / "data")]
        return importlib.import_module("pcvr_lib.data.convert").Converter
    finally:
        for name in [name for name in sys.modules if name.startswith("pcvr_lib.data.")]:
            del sys.modules[name]
        sys.modules.update(saved)
        package.__path__ = saved_path
        for attr, module in saved_attrs.items():
            setattr(package, attr, module)


def ab_revisions(schema, batches, rev: str, strict: bool, passes: int) -> dict:
    """Converter at `rev` (A) against the checkout's (B) on the same batches: per pass and batch A-B or B-A
    alternately (A-B-B-A), thread CPU time, per batch the fastest pass; the copy floor before and after the
    A/B; outputs compared bit for bit on the first pass."""
    old = converter_at(rev)
    convs = {"A": old(schema, strict_time_filter=strict), "B": Converter(schema, strict_time_filter=strict)}
    for conv in convs.values():
        conv(batches[0])  # warm-up (builds the libraries)
    kept = [convs["B"](rb) for rb in batches[:8]]
    floor_before = copy_floor_seconds(kept)[1]
    best = {name: np.full(len(batches), np.inf) for name in convs}
    for p in range(passes):
        for i, rb in enumerate(batches):
            outputs = {}
            for name in ("A", "B") if (p + i) % 2 == 0 else ("B", "A"):
                c0 = time.thread_time()
                batch = convs[name](rb)
                best[name][i] = min(best[name][i], time.thread_time() - c0)
                if p == 0:
                    outputs[name] = [t.clone() for t in batch.tensors()]
                del batch
            if p == 0:
                for a, b in zip(outputs["A"], outputs["B"], strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), f"batch {i}: outputs differ"
    floor_after = copy_floor_seconds(kept)[1]
    floor = (floor_before + floor_after) / 2
    rows = batches[0].num_rows
    out_bytes = kept[0].nbytes
    source = sum(source_bytes(schema, rb) for rb in batches) / len(batches)
    result = {
        "rev_a": rev,
        "strict_time_filter": strict,
        "batches": len(batches),
        "rows_per_batch": rows,
        "passes": passes,
        "copy_floor_ms": floor * 1e3,
        "copy_floor_ms_before_after": [floor_before * 1e3, floor_after * 1e3],
        "output_bytes_per_batch": out_bytes,
        "source_bytes_per_batch": source,
        # the floor reads and writes the output once; a conversion reads its int64 source, writes the output
        "bytes_moved_floor": 2 * out_bytes,
        "bytes_moved_converter": source + out_bytes,
        "outputs_identical": True,
    }
    for name in convs:
        ms = float(best[name].mean() * 1e3)
        result[name] = {
            "ms_per_batch": ms,
            "rows_per_sec": rows / ms * 1e3,
            "x_reference_6400": rows / ms * 1e3 / 6400,
            "ratio_to_copy_floor": floor * 1e3 / ms,
            "converter_GB_per_s": (source + out_bytes) / ms / 1e6,
        }
    result["speedup_b_over_a"] = result["A"]["ms_per_batch"] / result["B"]["ms_per_batch"]
    result["floor_GB_per_s"] = 2 * out_bytes / floor / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--multiplier", type=int, default=30)
    parser.add_argument("--batches", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "numpy"])
    parser.add_argument("--profile", action="store_true", help="cProfile one pass")
    parser.add_argument("--data-order", default="newest-last", help="generated list order (newest-first, mixed)")
    parser.add_argument("--list-order", default="auto", help="the converter's list_order (auto: told per row)")
    parser.add_argument("--ab-list-order", action="store_true", help="auto against the given order, interleaved")
    parser.add_argument("--ab-rev", help="git revision whose converter is A against this checkout's (B)")
    parser.add_argument("--json", help="write the --ab-rev result here")
    args = parser.parse_args()
    single_thread()
    # the default (PCVR_CACHE_DIR) cache
    path = generate_dataset(SCHEMA, rows=1000, multiplier=args.multiplier, list_order=args.data_order)
    batches = preload(path, args.batches, args.batch_size)
    if args.ab_rev:
        result = ab_revisions(load_schema(SCHEMA), batches, args.ab_rev, args.strict, args.passes)
        result.update(data=str(path), data_order=args.data_order, load_average=list(os.getloadavg()))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"data {path} ({len(batches)} batches x {args.batch_size} rows), strict={args.strict}, "
              f"load {result['load_average'][0]:.1f}")
        moved = result["bytes_moved_floor"] / 1e6, result["bytes_moved_converter"] / 1e6
        print(f"  copy floor {result['copy_floor_ms']:.3f} ms/batch ({result['floor_GB_per_s']:.1f} GB/s); "
              f"bytes moved: floor {moved[0]:.1f} MB, converter {moved[1]:.1f} MB")
        for name, label in (("A", f"rev {args.ab_rev}"), ("B", "checkout")):
            r = result[name]
            print(f"  {label:16s} {r['ms_per_batch']:.3f} ms/batch  {r['rows_per_sec']:,.0f} rows/s  "
                  f"{r['x_reference_6400']:.2f}x ref  {r['ratio_to_copy_floor']:.3f} of floor")
        print(f"  B over A: {result['speedup_b_over_a']:.3f}x; outputs identical")
        return
    if args.ab_list_order:
        ms = ab_list_order(load_schema(SCHEMA), batches, args.data_order, args.strict, args.passes)
        print(f"data {path} ({len(batches)} batches x {args.batch_size} rows), strict={args.strict}")
        for name, value in ms.items():
            print(f"  list_order={name:13s} {value:.3f} ms/batch  {args.batch_size / value * 1e3:,.0f} rows/s")
        return
    converter = Converter(
        load_schema(SCHEMA), strict_time_filter=args.strict, backend=args.backend, list_order=args.list_order
    )
    if args.profile:
        import cProfile
        import pstats

        converter(batches[0])
        with cProfile.Profile() as prof:
            for rb in batches:
                converter(rb)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    stats = measure(converter, batches, passes=args.passes)
    print(f"data {path} ({len(batches)} batches x {args.batch_size} rows)")
    for key, value in stats.items():
        print(f"  {key:24s} {value:,.3f}" if isinstance(value, float) else f"  {key:24s} {value}")


if __name__ == "__main__":
    main()
