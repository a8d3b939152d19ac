"""Model-level benchmarks: one training step and one inference pass of every model on every operator backend.

Ids: `model=<name>,backend=<torch|triton|tilelang>,phase=<train_step|infer>`. A backend sets all three
operator switches of the model config (attention, RMSNorm/LayerNorm, embedding-bag mean); what stays on
torch whatever the switch is listed in notes/models.md (queryformer's per-column LayerNorm).

GPU: batch 256 at the reference's sequence lengths (the demo schema's 256/256/512/512), reference widths
and depths, tables capped at `GPU_TABLE_CAP` rows per feature (a step touches only the batch's rows; the
reference's 2.2B-parameter queryformer tables would take minutes to build per case). The batch is a
seeded random one (`smoke_tests.model_checks.random_batch`). CPU: a tiny config, torch only (the Triton
interpreter cannot run the fp32 models' bf16 attention; smoke_tests/test_model_backends.py checks the
norms and the embedding in the models, and every attention call site in fp16), run once under
--benchmark-disable in CI.

Checked first: the backend's logits at initialisation and its loss after one training step against the
torch backend's (same seed, same dropout draws), bf16 tolerance (fp32 models; flash_attention computes
fp32 inputs in bf16). Timed with `timing.bench_gpu(graph=False)`: a training step cannot be captured in
a CUDA graph (the optimizers' host reads), so device time is the profiler's kernel sum per call; host and
per-call time in extra_info, with `speedup_vs_torch` (per-call, same session) once the torch case ran.
"""

from __future__ import annotations

import pytest
import torch

from pcvr_lib import timing
from pcvr_lib.kernels import registry
from pcvr_lib.kernels.tolerance import assert_close, tolerance
from pcvr_lib.models import model_names
from pcvr_lib.models.step import ModelStep
from pcvr_lib.schema import load_schema
from smoke_tests.model_checks import DEMO_SCHEMA, demo_schema, random_batch

CUDA = torch.cuda.is_available()
BACKENDS = ("torch", "triton", "tilelang")
PHASES = ("train_step", "infer")
GPU_BATCH = 256
GPU_TABLE_CAP = 8192
CPU_CONFIG = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1}
SEED = 0

_PER_CALL_US: dict[tuple[str, str], float] = {}  # (model, phase) -> the torch backend's per-call us


def _schema():
    return load_schema(DEMO_SCHEMA) if CUDA else demo_schema(max_len=6)  # the file's lengths: the reference's


def _inputs():
    schema = _schema()
    return schema, random_batch(schema, batch=GPU_BATCH if CUDA else 4, seed=3)


def _step(name: str, backend: str, schema, batch) -> ModelStep:
    config = {"vocab_cap": GPU_TABLE_CAP} if CUDA else dict(CPU_CONFIG)
    return ModelStep(name, schema, batch, backend, config=config, seed=SEED,
                     device="cuda" if CUDA else "cpu")


def _check(name: str, backend: str, schema, batch) -> tuple[ModelStep, dict]:
    """The backend against torch: logits at init, then the loss after one step. Returns the backend's
    ModelStep (one step on: the timed calls continue from it) and the losses."""
    ref, ours = _step(name, "torch", schema, batch), _step(name, backend, schema, batch)
    assert_close(ours.infer(), ref.infer(), torch.bfloat16, what=f"{name} {backend} logits at init")
    losses = []
    for s in (ref, ours):
        torch.manual_seed(1)  # the same dropout draws
        s.train_step()
        losses.append(s.eval_loss())
    tol = tolerance(torch.bfloat16)
    expected, actual = losses
    assert abs(actual - expected) <= (tol.atol + tol.rtol) * abs(expected), (
        f"{name} {backend}: loss after one step {actual!r}, torch backend {expected!r}")
    return ours, {"loss_after_step": actual, "torch_loss_after_step": expected}


CASES = [pytest.param(m, b, p, id=f"model={m},backend={b},phase={p}")
         for m in model_names() for b in BACKENDS for p in PHASES]


@pytest.mark.parametrize("name,backend,phase", CASES)
def test_model(benchmark, name, backend, phase):
    if backend != "torch":
        if not CUDA:
            pytest.skip(f"{backend}: no CUDA device (the CPU checks on Triton's interpreter are in "
                        "smoke_tests/test_model_backends.py)")
        ok, why = registry.backend_status("flash_attention", backend, "cuda")
        if not ok:
            pytest.skip(f"{backend}: {why}")
    benchmark.group = f"model={name},phase={phase}"
    schema, batch = _inputs()
    info = {"batch": batch.batch_size}
    if backend != "torch":
        step, losses = _check(name, backend, schema, batch)
        info.update(losses)
    else:
        step = _step(name, backend, schema, batch)
    call = step.train_step if phase == "train_step" else step.infer
    info["parameters"] = step.model.parameter_counts()
    benchmark.extra_info.update(info)
    if not CUDA:
        timing.bench_cpu(benchmark, call, rounds=3)
        return
    # milliseconds per call: one call per profiled round, few host samples (the case must stay ~1-2 s)
    result = timing.bench_gpu(benchmark, call, graph=False, rounds=5, warmup_rounds=1, calls=1, l2="warm",
                              host_samples=5)
    per_call = result.get("per_call_us")
    if per_call:
        if backend == "torch":
            _PER_CALL_US[(name, phase)] = per_call
        elif (name, phase) in _PER_CALL_US:
            benchmark.extra_info["speedup_vs_torch"] = round(_PER_CALL_US[(name, phase)] / per_call, 4)
