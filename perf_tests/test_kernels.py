"""Norm benchmarks: op x backend x shape x dtype x direction, ours against the peers, on one GPU.

Each case is checked against the fp64 reference first (outputs poisoned; a mismatch fails the case and
nothing is timed), then timed with `pcvr_lib.timing.bench_gpu` (per-call statistics; device and host
times in extra_info). Order: for every case key torch eager runs first, then torch.compile and Liger,
then ours, so `speedup_vs_torch` and `speedup_vs_best_peer` come from the same run.

    pytest perf_tests/test_kernels.py --benchmark-only --benchmark-json=out.json
    python -m perf_tests.kernel_bench out.json      # the summary table
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib.kernels import _tilelang, layer_norm, rms_norm
from pcvr_lib.kernels.layer_norm import layer_norm_reference
from pcvr_lib.kernels.rms_norm import rms_norm_reference, rms_norm_torch
from pcvr_lib.kernels.testing import poisoned_outputs
from pcvr_lib.kernels.tolerance import DTYPE_NAMES, assert_close, max_errors
from perf_tests import kernel_bench as kb

# the reference's shape first, then the large ones of h200-peers.md
SHAPES = [(8192, 128), (65536, 1024), (262144, 128), (16384, 4096)]
DTYPES = [torch.float16, torch.bfloat16]
BACKENDS = ["torch", "torch_compile", "liger", "triton", "tilelang"]
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}


def _cases():
    cases = []
    for direction in ("fwd", "fwdbwd"):  # forward first: the targets that matter most
        for op in ("rms_norm", "layer_norm"):
            for shape in SHAPES:
                for dtype in DTYPES:
                    key = kb.CaseKey(op, f"{shape[0]}x{shape[1]}", DTYPE_NAMES[dtype], direction)
                    for backend in BACKENDS:
                        if backend == "torch_compile" and direction == "fwdbwd" and shape != SHAPES[0]:
                            continue  # compile time: fwd+bwd compile peer at the reference shape only
                        cases.append(pytest.param(key, backend, shape, dtype, id=key.case_id(backend)))
    return cases


def _peer_fn(op: str, backend: str):
    """The callable for a peer backend: (x, weight[, bias]) -> y."""
    eps = EPS[op]
    if backend == "torch":
        if op == "rms_norm":
            return lambda x, w: rms_norm_torch(x, w, eps)
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if backend == "torch_compile":
        torch._dynamo.reset()  # a fresh compile per case: no recompile limits, no dynamic-shape reuse
        if op == "rms_norm":
            return torch.compile(lambda x, w: rms_norm_torch(x, w, eps), dynamic=False)
        return torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), dynamic=False)
    if backend == "liger":
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # in_place=False: the benchmark reuses one grad tensor, which in-place would overwrite
            return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)
    if op == "rms_norm":
        return lambda x, w: rms_norm(x, w, eps, backend=backend)
    return lambda x, w, b: layer_norm(x, w, b, eps, backend=backend)


def _inputs(op: str, shape, dtype, grad: bool):
    g = torch.Generator(device="cuda").manual_seed(1234)
    rows, width = shape
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.3).to(dtype)
    params = [(torch.randn(width, device="cuda", generator=g) * 0.5 + 1).to(dtype)]
    if op == "layer_norm":
        params.append((torch.randn(width, device="cuda", generator=g) * 0.5).to(dtype))
    tensors = [x, *params]
    if grad:
        for t in tensors:
            t.requires_grad_(True)
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype) if grad else None
    return tensors, dy


def _reference(op: str, tensors, dy):
    ref_inputs = [t.detach().double().requires_grad_(dy is not None) for t in tensors]
    fn = rms_norm_reference if op == "rms_norm" else layer_norm_reference
    y = fn(*ref_inputs, EPS[op])
    if dy is None:
        return [y.detach()]
    return [y.detach(), *torch.autograd.grad(y, ref_inputs, dy.double())]


def _bytes(op: str, shape, dtype, direction: str) -> int:
    """Fewest bytes: fwd reads x and writes y; fwd+bwd adds reading dy and x, writing dx (5 passes)."""
    rows, width = shape
    elem = torch.finfo(dtype).bits // 8
    passes = 2 if direction == "fwd" else 5
    n_params = 1 if op == "rms_norm" else 2
    return passes * rows * width * elem + n_params * width * elem * (1 if direction == "fwd" else 2)


@pytest.mark.gpu
@pytest.mark.parametrize(("key", "backend", "shape", "dtype"), _cases())
def test_norm(benchmark, key, backend, shape, dtype):
    kb.require_gpu_backend(key.op, backend)
    fn = _peer_fn(key.op, backend)
    grad = key.direction == "fwdbwd"
    tensors, dy = _inputs(key.op, shape, dtype, grad)

    if grad:
        def call():
            return torch.autograd.grad(fn(*tensors), tensors, dy)
    else:
        def call():
            return fn(*tensors)

    def check():
        with poisoned_outputs():
            if grad:
                y = fn(*tensors)
                outs = [y, *torch.autograd.grad(y, tensors, dy)]
            else:
                outs = [fn(*tensors)]
        refs = _reference(key.op, tensors, dy)
        worst = (0.0, 0.0)
        for name, got, want in zip(("y", "dx", "dweight", "dbias"), outs, refs, strict=False):
            assert_close(got, want, dtype, what=f"{key.case_id(backend)} {name}")
            worst = tuple(max(a, b) for a, b in zip(worst, max_errors(got, want), strict=True))
        return worst

    before = _tilelang.compile_seconds((key.op,))
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    compile_s = _tilelang.compile_seconds((key.op,)) - before if backend == "tilelang" else first_call_s
    benchmark.extra_info["compile_s_source"] = (
        "tilelang compile or disk-cache load" if backend == "tilelang" else "first call (compile if not cached)")

    torch_fn = _peer_fn(key.op, "torch")
    if grad:
        def torch_call():
            return torch.autograd.grad(torch_fn(*tensors), tensors, dy)
    else:
        def torch_call():
            return torch_fn(*tensors)

    kb.run_case(benchmark, key=key, backend=backend, call=call, check=check,
                bytes_moved=_bytes(key.op, shape, dtype, key.direction), compile_s=compile_s,
                torch_call=torch_call)
