"""Benchmarks of flash_attention: backend x shape x mask x dtype x direction, against SDPA's backends.

Backends: SDPA forced to one implementation (`sdpa_flash`, `sdpa_efficient`, `sdpa_cudnn`: the global
switches are set for the case, so the timed call is a plain `F.scaled_dot_product_attention`), FlashAttention 4
(`fa4`, CuTe-DSL; no mask, key lengths and causal), our `torch` backend (SDPA's own choice), `triton` and
`tilelang`. Masked cases give SDPA the equivalent boolean mask
(built once, outside the timed call); SDPA's flash kernel takes no mask and is skipped there.
`speedup_vs_torch` is against the best SDPA backend measured for the same case in this run.

Each case checks first (a mismatch fails it untimed): output (and dq, dk, dv for fwd+bwd) against an
fp64 reference computed on the GPU one batch row at a time (kernels.attention.reference), by the flash-attention rule
(tolerance.flash_rule: error <= 2x the error of SDPA's default dispatch in the same dtype, measured once per case
outside any forced backend, + one ulp at the largest magnitude). Then per-call time as a user sees it
(back-to-back calls, host work included, no CUDA graph) via perf_tests/kernel_bench.py; device-only time
beside it (graph replay for fwd, the profiler's kernel-time sum for fwd+bwd, whose autograd pass is not
captured). FLOPs: 4*B*H*Sq*Skv*D forward, 3.5x that for fwd+bwd; half for the causal
masks (noted in extra_info); key padding is not subtracted (nominal FLOPs).

The models' shapes (workload.MODEL_PERF_SHAPES: symbiosis' role mask, key lengths at D16,
tokenformer's window + global query), bf16, also time `sdpa` (SDPA's default dispatch with the boolean mask
built once outside the call, as a model would) and `flex` (torch.compile'd flex_attention with a block mask,
peers.flex_peer); kernel_bench records `best_peer`, `best_peer_us` and `speedup_vs_best_peer` (the best
of the SDPA backends and flex measured before; target 1.5x). Their ids carry `set=model` (select them with `-k model`).
FLOPs of the window and roles masks are nominal (the full S x S).

The table of a saved run (every backend, flex included, and the speedups): pcvr report RUN.json --view cases
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib import precompile, sources
from pcvr_lib.kernels import flash_attention
from pcvr_lib.kernels.attention import OP
from pcvr_lib.kernels.attention.reference import reference as attention_reference
from pcvr_lib.kernels.attention.reference import reference_mask
from pcvr_lib.kernels.testing import poisoned_outputs
from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error
from pcvr_lib.workloads import attention as workload
from perf_tests import kernel_bench as kb
from perf_tests import peers
from perf_tests.peers import SDPA_FORCED, flex_peer, sdpa_only

CUDA = torch.cuda.is_available()
DTYPES = {name: kb.DTYPES[name] for name in ("fp16", "bf16")}
SDPA = SDPA_FORCED
# baselines first (the speedups need their times); without a GPU only the torch backend's case code runs
BACKENDS = (*SDPA, "fa4", "triton", "tilelang") if CUDA else ("torch",)
MODE_ARGS = workload.MODES  # mask -> (key lengths, causal, causal_valid)
GPU_SHAPES = workload.PERF_SHAPES
TILELANG_SKIP = workload.PERF_TILELANG_SKIP
SHAPES = GPU_SHAPES if CUDA else workload.CPU_PERF_SHAPES
# the models' shapes: the peers a model would call (SDPA with its boolean mask, flex_attention), then ours
MODEL_BACKENDS = (("sdpa", "sdpa_efficient", "sdpa_cudnn", "fa4", "flex", "triton", "tilelang") if CUDA
                  else ("sdpa", "flex"))


def cases():
    out = []
    for name, B, H, S, D, masks, directions in SHAPES:
        for mask in masks:
            for dtype in DTYPES:
                for direction in directions:
                    for backend in BACKENDS:
                        if backend == "tilelang" and (name, mask) in TILELANG_SKIP:
                            continue
                        cid = f"op={OP},backend={backend},shape={name},mask={mask},dtype={dtype},dir={direction}"
                        out.append(pytest.param(backend, (name, B, H, S, D), mask, dtype, direction, id=cid))
    model_shapes = workload.MODEL_PERF_SHAPES if CUDA else [("B2xH2xS40xD16", 2, 2, 40, 16, ("window", "roles"),
                                                             ("fwd", "fwd+bwd"))]
    for name, B, H, S, D, masks, directions in model_shapes:
        for mask in masks:
            for direction in directions:
                for backend in MODEL_BACKENDS:
                    cid = f"op={OP},set=model,backend={backend},shape={name},mask={mask},dtype=bf16,dir={direction}"
                    out.append(pytest.param(backend, (name, B, H, S, D), mask, "bf16", direction, id=cid))
    return out


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Warm every Triton/TileLang variant of these cases in parallel processes before timing anything
    (skipped when PCVR_ATTENTION_PRECOMPILED=1 says the caller already did)."""
    if not CUDA or os.environ.get("PCVR_ATTENTION_PRECOMPILED") == "1":
        return
    workers = str(max(1, min(14, (os.cpu_count() or 2) - 2)))
    precompile.main(["flash_attention", "--run-triton", "--workers", workers])


_PROBLEM: dict = {}


def problem(shape, mask, dtype, device):
    """Inputs (q, k, v, grad_out, flash_attention's mask keyword arguments, SDPA boolean mask) of one case,
    cached across backends."""
    key = (shape, mask, dtype)
    if key not in _PROBLEM:
        _PROBLEM.clear()
        _REF.clear()
        name, B, H, S, D = shape
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, S, D, generator=g, device=device).to(DTYPES[dtype]) for _ in range(4))
        if mask == "roles":
            kw = workload.structured_mask("roles", B, S, device=device)
        else:
            use_kl, causal, causal_valid = MODE_ARGS.get(mask, (True, False, False))
            kl = None
            if use_kl:
                kl = torch.randint(S // 4, S + 1, (B,), generator=g, device=device, dtype=torch.int32)
            kw = {"key_lengths": kl, "causal": causal, "causal_valid": causal_valid}
            if mask == "window":  # tokenformer: window 64, the target (last valid query) global
                kw = {"key_lengths": kl, "window": workload.PERF_WINDOW, "global_queries": 1}
        attn_mask = None
        if mask != "none":
            attn_mask = reference_mask(B, S, S, kw).to(device)
        _PROBLEM[key] = (q, k, v, do, kw, attn_mask)
    return _PROBLEM[key]


_REF: dict = {}


def case_reference(q, k, v, do, attn_mask, direction):
    """fp64 attention (and its gradients) on the device, one batch row at a time."""
    q64, k64, v64 = (t.detach().double().requires_grad_(direction != "fwd") for t in (q, k, v))
    out = attention_reference(q64, k64, v64, None, False, False, mask=attn_mask)
    if direction == "fwd":
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, (q64, k64, v64), do.double())]


def baseline(rkey, q, k, v, do, kw, attn_mask, direction):
    """(fp64 reference, max error of SDPA's default dispatch against it) of one case, computed once with
    every SDPA backend enabled (never inside a forced one)."""
    if rkey not in _REF:
        ref = case_reference(q, k, v, do, attn_mask, direction)
        got = _as_list(make_call("torch", q, k, v, do, kw, attn_mask, direction)())
        _REF[rkey] = (ref, [max_abs_error(a, r) for a, r in zip(got, ref, strict=True)])
    return _REF[rkey]


def make_call(backend, q, k, v, do, kw, attn_mask, direction):
    if direction == "fwd":
        q, k, v = (t.detach() for t in (q, k, v))
    else:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if backend in SDPA or backend == "sdpa":
        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    elif backend == "fa4":
        attend = functools.partial(peers.fa4_peer(kw, grad=direction != "fwd"), q, k, v)
    elif backend == "flex":
        B, H, S, _ = q.shape
        flex = flex_peer(kw, B, H, S, q.device)

        def attend():
            return flex(q, k, v)
    else:
        def attend():
            return flash_attention(q, k, v, **kw, backend=backend)
    if direction == "fwd":
        return attend

    def step():
        out = attend()
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    return step


RETURNS = {"fwd": "out", "fwd+bwd": "out, dq, dk, dv (torch.autograd.grad)"}


def _as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("backend,shape,mask,dtype,direction", cases())
def test_attention_perf(benchmark, backend, shape, mask, dtype, direction):
    if not CUDA:
        return cpu_case(benchmark, backend, shape, mask, dtype, direction)
    if peers.is_peer(backend):
        device = kb.require_gpu_backend(OP, backend)
        if backend == "sdpa_flash" and mask != "none":
            pytest.skip("sdpa_flash: SDPA's flash kernel takes no attention mask")
    else:
        device = kb.require_gpu_backend(OP, backend)
    q, k, v, do, kw, attn_mask = problem(shape, mask, dtype, device)
    key = kb.CaseKey(OP, f"{shape[0]},mask={mask}", dtype, direction)
    dt = DTYPES[dtype]
    ref, torch_err = baseline((shape, mask, dtype, direction), q, k, v, do, kw, attn_mask, direction)

    with sdpa_only(backend) if backend in SDPA else contextlib.nullcontext():
        try:
            call = make_call(backend, q, k, v, do, kw, attn_mask, direction)
            first, first_s = kb.timed_first_call(call)
        except peers.PeerUnavailable as exc:  # a mask the peer has no form for
            pytest.skip(str(exc))
        except Exception as exc:  # SDPA: "No available kernel" for this input; flex: a compile failure
            if backend in SDPA or backend == "flex":
                pytest.skip(f"{backend}: not available for this case ({str(exc).splitlines()[0][:120]})")
            raise
        del first

        def check():
            with poisoned_outputs(device):  # stale values from the timed calls must not pass the check
                got = _as_list(call())
            worst_abs, worst_rel = 0.0, 0.0
            for name, a, r, te in zip(("out", "dq", "dk", "dv"), got, ref, torch_err, strict=False):
                err, rel = flash_rule(a, r, te, dt, f"{backend} {name}")
                worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
            return worst_abs, worst_rel

        name, B, H, S, D = shape
        nominal = mask if mask in MODE_ARGS else "none"  # window, roles: the full S x S (nominal FLOPs)
        causal = MODE_ARGS[nominal][1] or MODE_ARGS[nominal][2]
        flops = workload.flops(B, H, S, D, nominal, direction)
        nbytes = workload.bytes_moved(B, H, S, D, q.element_size(), direction)
        info = kb.run_case(benchmark, key=key, backend=backend, call=call, check=check, bytes_moved=nbytes,
                           returns=RETURNS[direction], flops=flops,
                           compile_s=first_s if backend in ("triton", "tilelang") else None,
                           rounds=20, graph=(direction == "fwd"))
    if not benchmark.enabled:
        return
    sdpa_times = {b: t for b, t in kb.session_times().get(key, {}).items() if b in (*SDPA, "torch", "sdpa")}
    extra = {"flops_note": "causal: half the full FLOPs" if causal else "full FLOPs (key padding not subtracted)"}
    if "tflops" in info and info.get("matmul_ceiling_tflops"):
        extra["fraction_of_matmul_ceiling"] = round(info["tflops"] / info["matmul_ceiling_tflops"], 4)
    extra["device_tflops"] = round(flops / (info["device_us"] * 1e-6) / 1e12, 2) if info.get("device_us") else None
    per_call_s = info["per_call_us"] * 1e-6
    if sdpa_times and not peers.is_peer(backend):
        best = min(sdpa_times, key=sdpa_times.get)
        extra.update({"best_sdpa_backend": best, "best_sdpa_us": round(sdpa_times[best] * 1e6, 3),
                      "speedup_vs_torch": round(sdpa_times[best] / per_call_s, 3)})
    benchmark.extra_info.update(extra)


def cpu_case(benchmark, backend, shape, mask, dtype, direction):
    """Without a GPU only our torch backend and SDPA with the boolean mask run (a correctness smoke of the
    case code; not timed)."""
    if backend not in ("torch", "sdpa"):
        pytest.skip(f"{backend}: no CUDA device (GPU benchmark)")
    q, k, v, do, kw, attn_mask = problem(shape, mask, dtype, "cpu")
    call = make_call(backend, q, k, v, do, kw, attn_mask, direction)
    benchmark.extra_info.update({"op": OP, "backend": backend, "shape": f"{shape[0]},mask={mask}", "dtype": dtype,
                                 "dir": direction, "returns": RETURNS[direction],
                                 **sources.stamp(sources.kernel_subject(OP, backend, ours=backend == "torch")),
                                 "note": "CPU smoke run, not a GPU timing"})
    got = _as_list(benchmark(call))
    ref = case_reference(q, k, v, do, attn_mask, direction)
    for a, r in zip(got, ref, strict=True):
        assert float((a.double() - r).abs().max()) < 0.05 * max(float(r.abs().max()), 1e-3)


@pytest.mark.parametrize("mask", ["key_lengths", "window", "roles"])
def test_flex_peer_mask_matches_reference(mask):
    """The flex peer's mask functions define the same mask as masks.py (eager flex_attention on the CPU)."""
    B, H, S, D = 3, 2, 110, 16
    if mask == "roles":
        kw = workload.structured_mask("roles", B, S)
    else:
        kw = {"key_lengths": torch.tensor([S, 50, 1], dtype=torch.int32)}
        if mask == "window":
            kw.update(window=8, global_queries=1)
    q, k, v, _ = workload.inputs(B, H, S, S, D, torch.float32, seed=5)
    got = flex_peer(kw, B, H, S, "cpu", compile=False)(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(B, S, S, kw))
    assert float((got - expected).abs().max()) < 1e-4
