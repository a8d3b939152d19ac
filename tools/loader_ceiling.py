"""How many rows/s the cores this process may use can give the loader at all, against what the loader gives with
0 and 2 workers: the ceiling behind the loader's worker-scaling target (notes/data-pipeline.md).

The ceiling is P = cores independent processes, each with a 1-thread Arrow pool, each doing its whole job with
no hand-off and no coordination: `decode` reads every row group of the benchmark's file (the converter's
columns, what the loader decodes), `loader` runs the benchmark's 0-worker loader (preset none: decode, convert,
two shuffled passes). Their rows/s summed over the processes bound what any split of the same work over the same
cores can reach; the loader with 0 and 2 workers is timed in the same rounds, in turn, so a drift of the host's
speed falls on every figure alike.

    taskset -c 0-3 python3 tools/loader_ceiling.py --rounds 3 --json results/loader_ceiling_4cores.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pcvr_lib.data.generate import default_cache_dir, generate_dataset  # noqa: E402
from pcvr_lib.data.loader import PcvrLoader  # noqa: E402
from pcvr_lib.schema import load_schema  # noqa: E402

# make bench's default data scale and loader options (perf_tests/test_data_pipeline.py, SCALES["default"])
ROWS, MULTIPLIER, ROW_GROUP_SIZE, BATCH_SIZE, PASSES = 1000, 12, 1000, 256, 2


def loader(path: Path, schema, workers: int) -> PcvrLoader:
    return PcvrLoader(path, schema, preset="none", batch_size=BATCH_SIZE, passes=PASSES, shuffle=True, seed=0,
                      num_workers=workers, pin_memory=False)


def loader_rows(path: Path, schema, workers: int) -> int:
    with loader(path, schema, workers) as it:
        return sum(batch.batch_size for batch in it)


def decode_rows(path: Path, columns: list[str]) -> int:
    """Every row group read once per pass, as the loader's passes decode them (preset none: no cache)."""
    pf = pq.ParquetFile(path)
    groups = pf.metadata.num_row_groups
    return sum(pf.read_row_group(g, columns=columns, use_threads=False).num_rows
               for _ in range(PASSES) for g in range(groups))


def _child(job: str, path: str, schema_path: str, start, queue) -> None:
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    schema = load_schema(schema_path)
    start.wait()
    t0 = time.perf_counter()
    rows = (loader_rows(Path(path), schema, 0) if job == "loader"
            else decode_rows(Path(path), schema.converter_columns))
    queue.put((rows, t0, time.perf_counter()))


def independent(job: str, path: Path, schema_path: Path, processes: int) -> float:
    """rows/s of `processes` 1-thread processes each doing the whole `job` at once (first start to last end)."""
    ctx = mp.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(job, str(path), str(schema_path), start, queue))
             for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # every child imported and waiting
    start.set()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"loader_ceiling: a {job} process exited with {p.exitcode}")
    rows = sum(r for r, _, _ in results)
    return rows / (max(e for _, _, e in results) - min(s for _, s, _ in results))


def timed_loader(path: Path, schema, workers: int) -> float:
    start = time.perf_counter()
    rows = loader_rows(path, schema, workers)
    return rows / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-cache-dir", help="where the generated file is cached (default: the benchmark's)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    schema_path = ROOT / "fixtures" / "sample_1000_raw.schema.json"
    schema = load_schema(schema_path)
    path = generate_dataset(schema, rows=ROWS, multiplier=MULTIPLIER, row_group_size=ROW_GROUP_SIZE,
                            cache_dir=Path(args.data_cache_dir or default_cache_dir()), progress=False)
    loader_rows(path, schema, 0)  # warm: the page cache and the converter's first call
    figures: dict[str, list[float]] = {k: [] for k in ("loader_0_workers", "loader_2_workers",
                                                       "ceiling_loader", "ceiling_decode")}
    for r in range(args.rounds):
        figures["loader_0_workers"].append(timed_loader(path, schema, 0))
        figures["loader_2_workers"].append(timed_loader(path, schema, 2))
        figures["ceiling_loader"].append(independent("loader", path, schema_path, cores))
        figures["ceiling_decode"].append(independent("decode", path, schema_path, cores))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in figures.items()), flush=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    out = {"cores": cores, "arrow_threads_0_workers": pa.cpu_count(), "rows_per_sec_median": med,
           "rows_per_sec_per_round": figures, "workers_2_over_0": med["loader_2_workers"] / med["loader_0_workers"],
           "target_1_6x_rows_per_sec": 1.6 * med["loader_0_workers"],
           "ceiling_over_0_workers": {k: med[k] / med["loader_0_workers"]
                                      for k in ("ceiling_loader", "ceiling_decode")}}
    print(f"{cores} cores (Arrow pool of the 0-worker loader: {pa.cpu_count()}), median of {args.rounds} rounds, "
          "rows/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in med.items()))
    print(f"2 workers / 0: {out['workers_2_over_0']:.2f}x; ceiling / 0 workers: loader "
          f"{out['ceiling_over_0_workers']['ceiling_loader']:.2f}x, decode alone "
          f"{out['ceiling_over_0_workers']['ceiling_decode']:.2f}x (the target: 1.60x)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
