"""Optimizer benchmarks: optimizer x device x workload, `optimizer.step` alone and the whole train step.

Workloads (pcvr_lib.workloads.optim): the reference's synthetic MLP (batch 512, features 2x128, hidden 512,
depth 4) and `pcvr_dense`, the dense parameter shapes of a representative PCVR model. With data scale "ci"
(env CI set) both are shrunk so that every case runs once quickly; the ids stay the same.

Variants beside the registry's defaults: `*_eager` (no CUDA graph around the stacked Newton-Schulz math,
CUDA only: on CPU it is the default path), `muon_quintic` (the common Muon coefficients) and
`orthogonal_adamw_bf16` (the transform's matmuls in bf16 instead of the reference's fp32; CUDA only).

In the `optim.step` group the gradient is fixed, so `final_loss` there is the loss after many steps on one
stale gradient (it may grow); the train-step group's `final_loss` is the meaningful one.

CUDA cases use `pcvr_lib.timing.bench_gpu`: the statistic is device time (the profiler's kernel sum),
host and per-call time (the optimizers are launch-bound: the time a user sees) in extra_info. CPU cases:
process CPU time (`timing.bench_cpu`), wall time in extra_info.
extra_info: parameters, optimizer state bytes, optimizer step time alone, final loss after the measured
steps, the ratio to fused AdamW in the same run, and Newton-Schulz orthogonality for Muon.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from pcvr_lib import sources, timing
from pcvr_lib.optim import OptimizerSet, build_optimizer, orthogonality_error, orthogonalize, train_step
from pcvr_lib.optim.newton_schulz import resolve_coefficients
from pcvr_lib.workloads.optim import make_task, pcvr_dense_shapes

# id -> (registry name, options, lr, devices it is a distinct variant on)
VARIANTS = {
    "fused_adamw": ("fused_adamw", {}, 1e-3, ("cpu", "cuda")),
    "adamw": ("adamw", {}, 1e-3, ("cpu", "cuda")),
    "orthogonal_adamw": ("orthogonal_adamw", {}, 1e-3, ("cpu", "cuda")),
    "orthogonal_adamw_eager": ("orthogonal_adamw", {"cuda_graph": False}, 1e-3, ("cuda",)),
    "orthogonal_adamw_bf16": ("orthogonal_adamw", {"ns_dtype": torch.bfloat16}, 1e-3, ("cuda",)),
    "muon": ("muon", {}, 0.02, ("cpu", "cuda")),
    "muon_eager": ("muon", {"cuda_graph": False}, 0.02, ("cuda",)),
    "muon_quintic": ("muon", {"ns_coefficients": "quintic"}, 0.02, ("cpu", "cuda")),
}
DEVICES = ("cpu", "cuda")
WORKLOADS = ("mlp", "pcvr_dense")
CI_SIZES = {"mlp": dict(batch=64, features=16, hidden=64, depth=4),
            "pcvr_dense": dict(shapes=pcvr_dense_shapes(d=16))}
CPU_ROUNDS = 5

RETURNS = {"step": "the parameters updated in place by optimizer.step (one fixed gradient)",
           "train_step": "the loss; parameters updated in place (forward, backward, grad-norm clipping, step)"}
# median seconds per call, by (group, device, workload, variant), to report ratios to fused AdamW
_MEDIANS: dict[tuple, float] = {}

CASES = [
    pytest.param(v, d, w, id=f"optimizer={v},device={d},workload={w}")
    for w in WORKLOADS for d in DEVICES for v in VARIANTS
]


def _skip_unless_runnable(variant: str, device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("optim: no CUDA device")
    if device not in VARIANTS[variant][3]:
        pytest.skip(f"{variant}: a CUDA-only variant (on {device}: {variant.rsplit('_', 1)[0]} covers it)")


def _setup(variant: str, device: str, workload: str, data_scale: str):
    name, options, lr, _ = VARIANTS[variant]
    torch.manual_seed(0)
    task = make_task(workload, device=device, seed=0, **(CI_SIZES[workload] if data_scale == "ci" else {}))
    opts = OptimizerSet(build_optimizer(name, task.parameters(), lr=lr, **options))
    # correctness before timing: a few real steps must give finite parameters and lower the loss
    first = train_step(task.loss(), opts)["loss"]
    for _ in range(3):
        last = train_step(task.loss(), opts)["loss"]
    assert all(torch.isfinite(p).all() for p in task.parameters()), f"{variant}: non-finite parameters"
    assert last < first, f"{variant} on {workload}: loss did not go down ({first} -> {last})"
    return task, opts


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step_alone_seconds(opt, device: str, calls: int = 20) -> float:
    """Median wall time of opt.step() with a synchronised device around each call."""
    times = []
    for _ in range(calls):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state_bytes(opt) -> int:
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _measure(benchmark, fn, device: str) -> float:
    """Time fn; returns the median seconds per call (nan when benchmarking is disabled)."""
    if device == "cuda":
        # graph=False: torch's AdamW refuses capture and our optimizers replay graphs of their own,
        # so device time comes from the profiler's kernel sum
        info = timing.bench_gpu(benchmark, fn, graph=False, flush_l2_cache=True)
        return info.get("per_call_us", float("nan")) / 1e6
    timing.bench_cpu(benchmark, fn, rounds=CPU_ROUNDS, warmup_rounds=1)  # process CPU time: torch's threads too
    return benchmark.stats.stats.median if benchmark.enabled and benchmark.stats else float("nan")


def _report(benchmark, group: str, variant: str, device: str, workload: str, task, opts, median: float,
            step_alone: float) -> None:
    dense = opts.dense
    info = benchmark.extra_info
    info["returns"] = RETURNS[group]
    info.update(sources.stamp("optim"))
    info["parameters"] = sum(p.numel() for p in task.parameters())
    info["tensors"] = sum(1 for _ in task.parameters())  # the workload's shape list (pcvr_dense follows the model)
    info["optimizer_state_bytes"] = _state_bytes(dense)
    info["optimizer_step_us"] = round(step_alone * 1e6, 3)
    with torch.no_grad():
        info["final_loss"] = float(task.loss())
    key = (group, device, workload)
    _MEDIANS[(*key, variant)] = median
    base = _MEDIANS.get((*key, "fused_adamw"))
    if base and variant != "fused_adamw" and median == median:
        info["ratio_to_fused_adamw"] = round(median / base, 3)
    name, options, _, _ = VARIANTS[variant]
    if name == "muon":
        # Newton-Schulz on a real gradient of the workload's largest matrix, with this optimizer's settings
        task.loss().backward()
        p = max((p for p in task.parameters() if p.dim() >= 2), key=lambda t: t.numel())
        g = p.grad.reshape(-1, p.shape[-2], p.shape[-1])[:1]
        dtype = torch.bfloat16 if device == "cuda" else g.dtype
        o = orthogonalize(g, 5, resolve_coefficients(options.get("ns_coefficients", "cubic")), dtype)
        err = orthogonality_error(o)
        info["ns_matrix_shape"] = list(g.shape[1:])
        info["ns_sigma_min"] = round(err["sigma_min"], 4)
        info["ns_sigma_max"] = round(err["sigma_max"], 4)
        info["ns_orthogonality_error"] = round(err["max_abs_sigma_minus_1"], 4)
        opts.zero_grad()


@pytest.mark.parametrize("variant,device,workload", CASES)
def test_optimizer_step(benchmark, data_scale, variant, device, workload):
    _skip_unless_runnable(variant, device)
    task, opts = _setup(variant, device, workload, data_scale)
    benchmark.group = f"optim.step:{workload}:{device}"
    # fixed gradients: the step alone, as the reference profiles it
    task.loss().backward()
    opt = opts.dense
    median = _measure(benchmark, opt.step, device)
    _sync(device)
    step_alone = median if median == median else _step_alone_seconds(opt, device, calls=2)
    opts.zero_grad()
    _report(benchmark, "step", variant, device, workload, task, opts, median, step_alone)


@pytest.mark.parametrize("variant,device,workload", CASES)
def test_train_step(benchmark, data_scale, variant, device, workload):
    _skip_unless_runnable(variant, device)
    task, opts = _setup(variant, device, workload, data_scale)
    benchmark.group = f"optim.train_step:{workload}:{device}"
    losses = []

    def one_step():
        losses.append(train_step(task.loss(), opts, max_grad_norm=1.0)["loss"])

    median = _measure(benchmark, one_step, device)
    assert all(x == x for x in losses), f"{variant}: NaN loss while measuring"
    task.loss().backward()
    step_alone = _step_alone_seconds(opts.dense, device, calls=10 if benchmark.enabled else 2)
    opts.zero_grad()
    _report(benchmark, "train_step", variant, device, workload, task, opts, median, step_alone)
    benchmark.extra_info["measured_steps"] = len(losses)
