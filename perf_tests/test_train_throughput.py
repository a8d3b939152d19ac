"""End to end: the loader feeding the training step, in rows/s, beside the step alone (one batch, again and
again) and the loader alone (the same plan, nothing done with the batches), and which side bounds it.

Ids: `model=<name>,mode=<eager|compile|graph|captured>,workers=<0|2>`. The step is `ModelStep` (the
model-level benchmark's: fused AdamW, sparse Adagrad, clipping; our Triton kernels on a GPU, torch on the
CPU) with each loader batch moved to the device before its step (in mode captured copied into the batch the
graph was captured on: `ModelStep.batch`). `bound` in extra_info: "step" when loader + step
reach 0.9x the step alone; else "loader" when the loader alone is slower than the step alone (its rows/s
and worker count beside it); else "serial" when loader + step reach no more than 1.1x
`serial_rows_per_sec` = 1 / (1/step + 1/loader), the rate with no overlap at all (the loader's work is not
hidden behind the step: more workers, or a read-ahead, would lift it); else "handoff" (the batches' way
from the loader into the step costs the rest). Everything here is wall time on the host, which moves by tens
of percent between runs: the cases are reported, never gated (`gated: false`).

Sizes come from `data_scale` (ci: 600 rows; default: 12x the demo data; full: the reference's 300x).
"""

from __future__ import annotations

import time

import pytest
import torch

from pcvr_lib import sources
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.data.loader import PcvrLoader
from pcvr_lib.kernels import dispatch
from pcvr_lib.models.compiled import MODES, mode_problem
from pcvr_lib.models.step import ModelStep
from pcvr_lib.schema import load_schema
from pcvr_lib.workloads.models import DEMO_SCHEMA, GPU_BATCH, GPU_TABLE_CAP, demo_schema

CUDA = torch.cuda.is_available()
BACKEND = "triton" if CUDA else "torch"
MODELS = ("baseline", "tokenformer")
WORKERS = (0, 2)
MULTIPLIER = {"ci": 1, "default": 12, "full": 300}
CPU_CONFIG = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1}
WARMUP_STEPS = 3  # compiled modes compile here (and plan their table-gradient capture)
BOUND_RATIO = 0.9
SERIAL_RATIO = 1.1
CASES = [pytest.param(m, mode, w, id=f"model={m},mode={mode},workers={w}")
         for m in MODELS for mode in MODES for w in WORKERS]


def _rows_per_second(rows: int, start: float) -> float:
    if CUDA:
        torch.cuda.synchronize()
    return rows / (time.perf_counter() - start)


@pytest.mark.parametrize("name,mode,workers", CASES)
def test_train_throughput(benchmark, name, mode, workers, data_scale, data_cache_dir):
    device = "cuda" if CUDA else "cpu"
    problem = mode_problem(mode, device)
    if problem:
        pytest.skip(problem)
    if not CUDA and (name, mode) != ("baseline", "eager"):
        pytest.skip("on CPU only baseline runs, eagerly (the compiled modes compile for minutes here)")
    if CUDA:
        ok, why = dispatch.backend_status("flash_attention", BACKEND, "cuda")
        if not ok:
            pytest.skip(f"{BACKEND}: {why}")
    schema = load_schema(DEMO_SCHEMA) if CUDA else demo_schema(max_len=6)
    batch_size = GPU_BATCH if CUDA else 32
    path = generate_dataset(DEMO_SCHEMA, rows=1000 if data_scale != "ci" else 600,
                            multiplier=MULTIPLIER[data_scale], row_group_size=1000, cache_dir=data_cache_dir,
                            progress=False)
    # a GPU pass over the data (at most 200 steps); 8 on a CPU, where the step takes tens of milliseconds
    steps = max(4, min(200, (1000 * MULTIPLIER[data_scale]) // batch_size)) if CUDA else 8

    def loader(num_workers=workers):
        return PcvrLoader(path, schema, preset="none", batch_size=batch_size, mode="steps", steps=steps, seed=0,
                          num_workers=num_workers, pin_memory=CUDA)

    first = next(iter(loader(num_workers=0)))  # the step's build batch: no workers started for one batch
    config = {"vocab_cap": GPU_TABLE_CAP} if CUDA else dict(CPU_CONFIG)
    step = ModelStep(name, schema, first, BACKEND, config=config, device=device, mode=mode)
    for _ in range(WARMUP_STEPS):
        step.train_step()

    start = time.perf_counter()
    for _ in range(steps):
        step.train_step()
    step_alone = _rows_per_second(steps * first.batch_size, start)

    plan = loader()
    start = time.perf_counter()
    loader_rows = sum(batch.batch_size for batch in plan)
    loader_alone = _rows_per_second(loader_rows, start)

    def together():
        rows, start = 0, time.perf_counter()
        for batch in loader():
            step.batch = batch.to(device, non_blocking=True)
            step.train_step()
            rows += batch.batch_size
        return rows, _rows_per_second(rows, start)

    rows, end_to_end = benchmark.pedantic(together, rounds=1, iterations=1)
    assert rows == loader_rows == plan.planned_rows, (rows, loader_rows, plan.planned_rows)
    serial = 1 / (1 / step_alone + 1 / loader_alone)  # rows/s if the loader's work hid none of the step's
    if end_to_end >= BOUND_RATIO * step_alone:
        bound = "step"
    elif loader_alone < step_alone:
        bound = "loader"
    elif end_to_end <= SERIAL_RATIO * serial:
        bound = "serial"
    else:
        bound = "handoff"
    benchmark.group = f"train_throughput,model={name}"
    benchmark.extra_info.update(
        gated=False, returns="training steps taken on every loader batch (parameters updated in place)",
        **sources.stamp(f"model:{name}:{BACKEND}"), backend=BACKEND, batch=batch_size, steps=steps, rows=rows,
        rows_per_sec=round(end_to_end, 1), step_alone_rows_per_sec=round(step_alone, 1),
        loader_alone_rows_per_sec=round(loader_alone, 1), serial_rows_per_sec=round(serial, 1),
        ratio_to_step_alone=round(end_to_end / step_alone, 4),
        bound=bound, data_rows=1000 * MULTIPLIER[data_scale] if data_scale != "ci" else 600)
