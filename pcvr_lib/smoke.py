"""`pcvr smoke` (`make smoke`): every model x seed, train + val + infer on the generated demo data, then the
diagnostics, a summary table and smoke_summary.json.

    python -m pcvr_lib smoke --models all --seeds 17,42,97 --steps 20 --device cpu --out smoke_runs

Data: 1000 rows generated from fixtures/sample_1000_raw.schema.json (seeded, cached by content hash; the
generator plants a learnable signal). Split timestamp_auto, valid_ratio 0.2. Every model keeps its
reference defaults (widths, depths, heads, embedding dim, thresholds) except two smoke reductions, named in
the smoke's output and summary: the sequences are cut to `--max-lens` (default 32 newest events per domain)
and no embedding table keeps more than `--table-cap` rows (default 8192, hashed), so that the seven models
fit a 2-core machine (queryformer alone has 2.17B table parameters at the reference settings).
Precision: bf16 autocast by default on a CPU with bf16 matmul instructions (AVX512-BF16 or AMX: the 2-core
smoke 573 -> 433 s, every model's AUC the same within seed noise, notes/models.md), fp32 elsewhere and on
CUDA; `--amp` / `--no-amp` choose. Training batches come through the loader's OPT cache
(`SMOKE_LOADER_PRESET`): the same batches as uncached, each decoded and converted once instead of once per draw;
and the row groups a process has decoded are reused by its later loaders (`reusing_decoded_row_groups`: the
runs read the one file five times each).

Runs go to OUT/<model>_seed<seed>/ and are spread over `--jobs` worker processes (default: 2 on a CPU
with 2+ cores, 1 on CUDA; a fresh process per run so that each run's peak memory is its own), each with
`--threads` torch threads (default 1): on a small shared CPU two
single-threaded processes beat one process with two threads, whose OpenMP workers stall whenever another
process takes a core. Timings of concurrent runs include that sharing; use --jobs 1 for isolated numbers. With one
job (the default on CUDA) the runs share one process, and a model's later seeds replay the CUDA graph its first
seed captured (`pcvr_lib.train.keeping_captured_steps`: each run still starts from its own seed's weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pcvr_lib.metrics import auc_text
from pcvr_lib.train.config import QUICK_MAX_LEN, QUICK_TABLE_CAP

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCHEMA = ROOT / "fixtures" / "sample_1000_raw.schema.json"
DEFAULT_MAX_LEN = QUICK_MAX_LEN  # the smoke's reductions are `pcvr train --quick`'s
# At the defaults the 20 steps draw the 800 training rows 2.5 times over, from 7 batches: through the loader's
# OPT cache each batch is decoded and converted once (at most 7 of the 20 draws convert), the batches unchanged
SMOKE_LOADER_PRESET = "opt"
DEFAULT_TABLE_CAP = QUICK_TABLE_CAP
SMOKE_MODEL_CONFIG = {"vocab_cap": DEFAULT_TABLE_CAP}  # the smoke's one model reduction (`pcvr models`)


class SmokeError(ValueError):
    """A bad smoke option; exit code 2."""


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SmokeError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise SmokeError("--seeds is empty")
    return seeds


def _parse_models(text: str) -> list[str]:
    from pcvr_lib.models import model_names

    names = model_names()
    if text == "all":
        return names
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in names]
    if unknown or not chosen:
        raise SmokeError(f"unknown model(s) {unknown or text!r}; registered: {', '.join(names)} (or all)")
    return chosen


def run_one(job: dict[str, Any], steps_done=None) -> dict[str, Any]:
    """Train, validate and infer one (model, seed); runs in a worker process. Returns the numbers.
    `steps_done(1)` is called after each training step (a queue's put in a worker process): the smoke's
    own progress bar counts them, so the run's own bars are silenced."""
    import torch

    from pcvr_lib.data.loader_pipeline import reusing_decoded_row_groups
    from pcvr_lib.progress import QUIET_ENV

    threads_before = torch.get_num_threads()
    quiet_before = os.environ.get(QUIET_ENV)
    torch.set_num_threads(job["threads"])
    os.environ[QUIET_ENV] = "1"
    try:
        # training, both holdouts, validation and inference read the same row groups: each decoded once
        with reusing_decoded_row_groups():
            return _run_one(job, steps_done)
    finally:  # matters when the run happens in the caller's process (--jobs 1)
        torch.set_num_threads(threads_before)
        if quiet_before is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = quiet_before


def _run_one(job: dict[str, Any], steps_done=None) -> dict[str, Any]:
    from pcvr_lib.train import TrainConfig, infer, train, validate

    run_dir = Path(job["run_dir"])
    t0 = time.perf_counter()
    summary = train(TrainConfig(
        model=job["model"], data=job["data"], run_dir=str(run_dir), max_lens=job["max_lens"],
        label=run_dir.name, seed=job["seed"], steps=job["steps"], batch_size=job["batch_size"],
        device=job["device"], amp=job["amp"], model_config=job["model_config"], eval_at_init=True,
        loader_preset=SMOKE_LOADER_PRESET,
    ), progress=(lambda *_: steps_done(1)) if steps_done is not None else None,
        overwrite=True)  # OUT/<model>_seed<seed> belongs to the smoke: a new smoke replaces its runs
    t_train = time.perf_counter()
    evaluation = validate(run_dir, device=job["device"])
    t_val = time.perf_counter()
    inference = infer(run_dir, device=job["device"])
    t_infer = time.perf_counter()
    tel = summary["telemetry"]
    ev = evaluation["telemetry"]
    return {
        "model": job["model"],
        "seed": job["seed"],
        "run_dir": str(run_dir),
        "auc": summary["validation_metrics"]["auc"],
        "init_auc": summary["init_validation_metrics"]["auc"],
        "logloss": summary["validation_metrics"]["logloss"],
        "valid_rows": summary["validation_metrics"]["sample_count"],
        "skipped_steps": summary["skipped_steps"],
        "train_sec": tel["elapsed_sec"],
        "train_rows_per_sec": tel["rows_per_sec"],
        "train_peak_rss_mb": tel["cpu_peak_rss_mb"],
        "train_cuda_peak_mb": tel["cuda_peak_allocated_mb"],
        "eval_sec": ev["elapsed_sec"],
        "eval_rows_per_sec": ev["rows_per_sec"],
        "infer_sec": inference["elapsed_sec"],
        "infer_rows_per_sec": inference["rows_per_sec"],
        "infer_peak_rss_mb": inference["cpu_peak_rss_mb"],
        "parameters": tel["model_parameters"],
        "mode": tel["metadata"].get("compile_mode"),
        "mode_fallback_reason": tel["metadata"].get("compile_fallback_reason"),
        # the three calls whole: what the steps, passes and scoring above leave out is setup (building the
        # model, reading data, checkpoints, the first calls' kernel compiles)
        "train_call_sec": t_train - t0,
        "val_call_sec": t_val - t_train,
        "infer_call_sec": t_infer - t_val,
        "wall_sec": time.perf_counter() - t0,
    }


def _table(results: list[dict], models: list[str]) -> str:
    cuda = any(r.get("train_cuda_peak_mb") is not None for r in results)
    head = (f"{'model':<12} {'AUC at step 0 -> last, per seed':<40} {'AUC mean ± sd':>16} {'LogLoss':>8} "
            f"{'train s':>8} "
            f"{'eval s':>7} {'infer s':>8} {'train r/s':>9} {'infer r/s':>9} {'peak MiB':>9} {'params':>8}"
            + (f" {'GPU MiB':>8}" if cuda else ""))
    lines = [head, "-" * len(head)]
    # peak MiB: CPU peak RSS, the larger of the train and infer phases, max over seeds; GPU MiB: peak
    # allocated while training (CUDA runs only)
    for model in models:
        rs = sorted((r for r in results if r["model"] == model), key=lambda r: r["seed"])
        if not rs:
            continue
        aucs = np.array([r["auc"] for r in rs if r["auc"] is not None])  # None: one class only, no AUC
        sd = f"{aucs.std(ddof=1):.4f}" if len(aucs) > 1 else "n/a"
        per_seed = " ".join(f"{auc_text(r['init_auc'], 3)}->{auc_text(r['auc'], 3)}" for r in rs)

        def mean(key, rs=rs):
            vals = [r[key] for r in rs if r[key] is not None]
            return float(np.mean(vals)) if vals else float("nan")

        peak = max(max(r["train_peak_rss_mb"] or 0, r["infer_peak_rss_mb"] or 0) for r in rs)
        lines.append(
            f"{model:<12} {per_seed:<40} {auc_text(aucs.mean() if len(aucs) else None):>8} ± {sd:<6} "
            f"{mean('logloss'):>8.4f} "
            f"{mean('train_sec'):>8.1f} {mean('eval_sec'):>7.2f} {mean('infer_sec'):>8.2f} "
            f"{mean('train_rows_per_sec'):>9.0f} {mean('infer_rows_per_sec'):>9.0f} {peak:>9.0f} "
            f"{rs[0]['parameters']['total'] / 1e6:>7.2f}M"
            + (f" {max(r.get('train_cuda_peak_mb') or 0 for r in rs):>8.0f}" if cuda else "")
        )
    return "\n".join(lines)


def smoke(
    models: list[str],
    seeds: list[int],
    *,
    steps: int = 20,
    device: str = "cpu",
    out: str | Path = "smoke_runs",
    batch_size: int = 128,
    max_lens: str | None = None,
    jobs: int | None = None,
    threads: int = 1,
    amp: bool | None = None,
    model_config: dict | None = None,
    table_cap: int | None = DEFAULT_TABLE_CAP,
    diagnostics: bool = True,
    data_rows: int = 1000,
    stream=sys.stdout,
) -> dict[str, Any]:
    from pcvr_lib.data.generate import generate_dataset
    from pcvr_lib.errors import check_writable
    from pcvr_lib.models import model_class
    from pcvr_lib.train import resolve_device
    from pcvr_lib.train.config import cpu_computes_bf16_natively

    dev = resolve_device(device)
    if amp is None:
        amp = dev.type == "cpu" and cpu_computes_bf16_natively()
    schema = load_smoke_schema()
    if max_lens is None:
        max_lens = ",".join(f"{d.name}:{DEFAULT_MAX_LEN}" for d in schema.domains)
    if jobs is None:
        jobs = 1 if dev.type == "cuda" else max(1, min(2, os.cpu_count() or 1))
    out = Path(out)
    check_writable(out, "--out")  # before generating data or training anything
    model_config = dict(model_config or {})
    if table_cap is not None:
        model_config.setdefault("vocab_cap", table_cap)
    t_start = time.perf_counter()
    print(f"smoke: {len(models)} model(s) x {len(seeds)} seed(s) x {steps} steps on {device} "
          f"({jobs} job(s) x {threads} thread(s)), batch {batch_size}, "
          f"{'bf16 autocast' if amp else 'fp32 (no autocast)'}", file=stream)
    print(f"smoke reductions (models otherwise at the reference defaults): sequences cut to {max_lens}; "
          f"tables capped at {model_config.get('vocab_cap') or 'none'} rows per feature; model overrides "
          f"{model_config or 'none'}", file=stream)
    data = generate_dataset(DEFAULT_SCHEMA, rows=data_rows, seed=0, progress=False)
    print(f"data: {data}", file=stream)
    work = [
        {"model": m, "seed": s, "run_dir": str(out / f"{m}_seed{s}"), "data": str(data), "max_lens": max_lens,
         "steps": steps, "batch_size": batch_size, "device": device, "amp": amp, "threads": threads,
         "model_config": model_config}
        for m in models for s in seeds
    ]
    # longest runs first, so that the workers finish together (results are re-sorted below)
    costs = {m: getattr(model_class(m), "cost_hint", 1.0) for m in models}
    work.sort(key=lambda job: -costs[job["model"]])
    results = _execute(work, jobs, stream)
    results.sort(key=lambda r: (models.index(r["model"]), r["seed"]))
    runs_sec = time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "models": models, "seeds": seeds, "steps": steps, "device": device, "batch_size": batch_size,
        "max_lens": max_lens, "model_config": model_config, "loader_preset": SMOKE_LOADER_PRESET,
        "jobs": jobs, "threads": threads, "amp": amp, "data": str(data),
        "runs": results,
        "runs_wall_sec": runs_sec,
    }
    if diagnostics:
        from pcvr_lib.diagnostics import plot_diagnostics, report

        t0 = time.perf_counter()
        specs = [f"{Path(r['run_dir']).name}={r['run_dir']}" for r in results]
        diag = plot_diagnostics(specs, out / "diagnostics", group_by="label-prefix")
        summary["diagnostics_dir"] = str(out / "diagnostics")
        summary["diagnostics_sec"] = time.perf_counter() - t0
        print("\n" + report(diag), file=stream)
    summary["total_wall_sec"] = time.perf_counter() - t_start
    print("\n" + _table(results, models), file=stream)
    print(f"\nsmoke finished in {summary['total_wall_sec']:.1f}s; runs in {out}/, figures in "
          f"{summary.get('diagnostics_dir', '(skipped)')}", file=stream)
    (out / "smoke_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_smoke_schema():
    from pcvr_lib.schema import load_schema

    return load_schema(DEFAULT_SCHEMA)


def _execute(work: list[dict], jobs: int, stream) -> list[dict]:
    """Run the jobs (in worker processes when jobs > 1). On a terminal, a bar counts the training steps of
    every job (with jobs done so far); a line per finished run is printed either way."""
    from pcvr_lib.progress import bar

    total = len(work)
    results = []
    t0 = time.perf_counter()
    steps_bar = bar(sum(job["steps"] for job in work), "smoke", unit="step")

    def show(r):
        done = len(results)
        line = (f"{done}/{total} {r['model']} seed {r['seed']}: AUC {auc_text(r['auc'])}, train {r['train_sec']:.1f}s "
                f"({r['mode']}{', fell back: ' + r['mode_fallback_reason'] if r['mode_fallback_reason'] else ''}; "
                f"{r['train_call_sec']:.1f}s with setup and checkpoints), val {r['eval_sec']:.1f}s, "
                f"infer {r['infer_sec']:.1f}s, run {r['wall_sec']:.1f}s (elapsed {time.perf_counter() - t0:.0f}s)")
        if steps_bar.disable:
            print(line, file=stream, flush=True)
        else:
            steps_bar.write(line, file=stream)
            steps_bar.set_postfix_str(f"{done}/{total} jobs done")

    try:
        if jobs <= 1:
            from pcvr_lib.data.loader_pipeline import reusing_decoded_row_groups
            from pcvr_lib.train import keeping_captured_steps

            with keeping_captured_steps(), reusing_decoded_row_groups():
                # the seeds of a model after its first replay its captured step; every run reads the one file
                for job in work:
                    results.append(run_one(job, steps_bar.update))
                    show(results[-1])
            return results
        return _execute_pool(work, jobs, steps_bar, results, show)
    finally:
        steps_bar.close()


def _execute_pool(work, jobs, steps_bar, results, show) -> list[dict]:
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        steps_done = manager.Queue()
        # a fresh process per run: each run's peak RSS is its own, not the high-water mark of earlier runs
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
            pending = {pool.submit(run_one, job, steps_done.put) for job in work}
            while pending:
                with contextlib.suppress(queue.Empty):
                    while True:  # the steps finished so far, without waiting
                        steps_bar.update(steps_done.get_nowait())
                finished = [f for f in pending if f.done()]
                for fut in finished:
                    pending.discard(fut)
                    results.append(fut.result())
                    show(results[-1])
                if not finished:
                    time.sleep(0.1)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="all", help="comma-separated model names, or all (default)")
    parser.add_argument("--seeds", default="17,42,97", help="comma-separated seeds, one run each (default 17,42,97)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--out", default="smoke_runs",
                        help="output directory; a new smoke replaces the runs it holds (default smoke_runs)")
    parser.add_argument("--batch-size", type=int, default=128, help="training rows per step (default 128)")
    parser.add_argument("--max-lens", help=f"sequence lengths (default: {DEFAULT_MAX_LEN} per domain)")
    parser.add_argument("--table-cap", type=int, default=DEFAULT_TABLE_CAP,
                        help=f"most rows per embedding table (default {DEFAULT_TABLE_CAP}; 0: the reference's tables)")
    parser.add_argument("--jobs", type=int, help="worker processes (default 2 on CPU, 1 on CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast (default: on for a CPU with bf16 matmul instructions, AVX512-BF16 or AMX, "
                             "where it trains the smoke about 1.3x faster with the same AUCs; off on CUDA, where "
                             "the smoke is host-bound and autocast's casts made it slower)")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the five figures and their summary")
    from pcvr_lib.train import add_backend_arguments

    add_backend_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pcvr_lib.train import backend_overrides

    for name in ("steps", "batch_size", "threads", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SmokeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.table_cap < 0:
        raise SmokeError(f"--table-cap must be >= 0 (0: the reference's tables), got {args.table_cap}")
    smoke(_parse_models(args.models), _parse_seeds(args.seeds), steps=args.steps, device=args.device,
          out=args.out, batch_size=args.batch_size, max_lens=args.max_lens, jobs=args.jobs,
          threads=args.threads, amp=args.amp, table_cap=args.table_cap or None,
          model_config=backend_overrides(args, {}),
          diagnostics=not args.no_diagnostics)
    return 0
