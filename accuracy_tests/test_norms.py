"""RMSNorm and LayerNorm, every backend, against fp64 references: forward and all gradients.

Ids carry the backend (`-k triton`, `-k tilelang`). On a machine without CUDA the Triton kernels run
under Triton's interpreter (TRITON_INTERPRET=1, set per test with monkeypatch so it never leaks), and
the TileLang kernels are compiled for sm_90 (nvcc) but not run: TileLang's C target cannot execute
them (its CPU reduce does not take fragment buffers), so those cases skip with that reason.
Outputs are poisoned (NaN) before every run, so a kernel that skips an element fails.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcvr_lib.kernels import compile_log, dispatch, layer_norm, rms_norm
from pcvr_lib.kernels.norms.reference import layer_norm_reference
from pcvr_lib.kernels.testing import grad_input_term_scale, grad_param_term_scale, poisoned_outputs, randn
from pcvr_lib.kernels.tolerance import DTYPE_NAMES, assert_close, tolerance
from pcvr_lib.workloads import norms as workload

CUDA = torch.cuda.is_available()
BACKENDS = ["torch", "triton", "tilelang"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = ["rms_norm", "layer_norm"]
# the workload's shapes (its manifest is what `python -m pcvr_lib.precompile` builds for TileLang)
SHAPES = workload.ACCURACY_SHAPES
GPU_SHAPES = workload.GPU_SHAPES


def _id(value) -> str:
    if isinstance(value, torch.dtype):
        return DTYPE_NAMES[value]
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value)


@pytest.fixture
def device_for(monkeypatch):
    """The device a backend's case runs on here, or a skip with the reason it cannot."""
    def pick(backend: str) -> torch.device:
        if CUDA:
            ok, reason = dispatch.backend_status("rms_norm", backend, "cuda")
            if not ok:
                pytest.skip(reason)
            return torch.device("cuda")
        if backend == "triton":
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test
        ok, reason = dispatch.backend_status("rms_norm", backend, "cpu")
        if not ok:
            pytest.skip(f"{reason} (TileLang's C target cannot run these kernels; compiled for sm_90 below)")
        return torch.device("cpu")
    return pick


_inputs = workload.inputs


def _run(op: str, backend: str, tensors):
    fn = rms_norm if op == "rms_norm" else layer_norm
    return fn(*tensors, workload.EPS[op], backend=backend)


def _reference(op: str, tensors):
    return workload.reference(op, tensors)[0]


def check_forward(op, backend, shape, dtype, device, seed=0):
    tensors = _inputs(op, shape, dtype, device, seed, requires_grad=False)
    with poisoned_outputs(device):
        y = _run(op, backend, tensors)
    assert y.dtype == dtype and y.shape == tensors[0].shape
    assert_close(y, _reference(op, tensors), dtype, what=f"{op}[{backend}] forward {_id(shape)}")


def check_backward(op, backend, shape, dtype, device, seed=0):
    tensors = _inputs(op, shape, dtype, device, seed, requires_grad=True)
    grad_out = randn(shape, dtype, device, seed + 7)
    with poisoned_outputs(device):
        y = _run(op, backend, tensors)
        grads = torch.autograd.grad(y, tensors, grad_out)
    ref_y, *ref_grads = workload.reference(op, tensors, grad_out)
    assert_close(y, ref_y, dtype, what=f"{op}[{backend}] training forward")
    dx_scale = grad_input_term_scale(tensors[0], tensors[1], grad_out, workload.EPS[op], centered=op == "layer_norm")
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, ref_grads, strict=False):
        assert got.dtype == dtype
        assert_close(got, want, dtype, what=f"{op}[{backend}] {name} {_id(shape)}",
                     scale=dx_scale if name == "dx" else grad_param_term_scale(grad_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"backend={b}")
def test_layer_norm_rows_far_from_zero(backend, dtype, device_for):
    """Rows with |mean| ~ 1000 std (first element an outlier): a variance from sums must not cancel.

    The input itself limits accuracy here (x - mean carries ulp(1000) of error), so the bound is the flash
    rule: at most 2x the error of torch's own layer_norm in the same dtype, plus the table's tolerance.
    """
    device = device_for(backend)
    x = randn((37, 385), dtype, device, 5, shift=1000.0)
    x[:, 0] += 40.0  # an outlier first element (what a shifted one-pass variance would shift by)
    w, b = randn((385,), dtype, device, 6, shift=1.0), randn((385,), dtype, device, 7)
    with poisoned_outputs(device):
        y = layer_norm(x, w, b, 1e-5, backend=backend)
    expected = layer_norm_reference(x, w, b, 1e-5)
    torch_err = float((layer_norm(x, w, b, 1e-5, backend="torch").double() - expected).abs().max())
    err = float((y.double() - expected).abs().max())
    tol = tolerance(dtype)
    bound = 2 * torch_err + tol.atol * float(expected.pow(2).mean().sqrt())
    assert err <= bound, f"layer_norm[{backend}] mean 1000 ({_id(dtype)}): max error {err:.3g} > {bound:.3g}"


def _skip_degenerate(op, shape):
    if op == "layer_norm" and shape[-1] <= 2:
        pytest.skip("layer_norm of one or two elements: the normalised row is (0) or (+-1) whatever x is, so "
                    "the exact input gradient is ~0 and any computed one is rounding noise amplified by 1/std; "
                    "LayerNorm is checked from width 3")


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_forward(op, backend, dtype, shape, device_for):
    _skip_degenerate(op, shape)
    check_forward(op, backend, shape, dtype, device_for(backend))


@pytest.mark.parametrize("shape", SHAPES[1:4] + SHAPES[5:], ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_backward(op, backend, dtype, shape, device_for):
    _skip_degenerate(op, shape)
    check_backward(op, backend, shape, dtype, device_for(backend))


@pytest.mark.parametrize("prefetch", [True, False], ids=lambda p: f"prefetch={int(p)}")
@pytest.mark.parametrize("shape", [(600, 96), (70, 385)], ids=_id)
@pytest.mark.parametrize("op", OPS)
def test_triton_backward_walks_several_row_blocks(op, shape, prefetch, device_for, monkeypatch):
    """Triton's persistent backward over more row blocks than programs (here and on a GPU alike: 16 programs
    of the interpreter's 4 SMs, or the GPU's), with and without loading the next block ahead, and a last block
    cut short: every program's later iterations and the prefetch past the last row."""
    from pcvr_lib.kernels.norms import config

    monkeypatch.setattr(config, "BWD_PREFETCH", prefetch)
    rows = shape[0] if not CUDA else shape[0] * 200  # a GPU has 132 SMs: more rows for several blocks each
    check_backward(op, "triton", (rows, shape[1]), torch.float32, device_for("triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_big_rows_forward_backward(op, backend, dtype, shape, device_for):
    if not CUDA:
        pytest.skip(f"{backend}: big rows run on a CUDA device only (the interpreter is too slow)")
    device = device_for(backend)
    check_forward(op, backend, shape, dtype, device, seed=3)
    check_backward(op, backend, shape, dtype, device, seed=4)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_hypothesis_shapes_and_dtypes(op, backend, device_for):
    """Random rows, widths, leading dims, dtypes, seeds, forward or backward.

    TileLang compiles per exact width (5-10 s each), so its widths come from the precompiled set;
    torch and Triton (one compile per width class) draw any width."""
    device = device_for(backend)
    min_width = 3 if op == "layer_norm" else 1  # see _skip_degenerate (a stored width-2 example failed)
    widths = (st.sampled_from([w for w in workload.accuracy_widths() if w >= min_width]) if backend == "tilelang"
              else st.integers(min_width, 2500 if CUDA else 520))

    @settings(max_examples=15 if CUDA else 6, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rows=st.integers(1, 300 if CUDA else 40), width=widths,
           lead=st.sampled_from([(), (2,)]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
           backward=st.booleans())
    def check(rows, width, lead, dtype, seed, backward):
        shape = (*lead, rows, width)
        (check_backward if backward else check_forward)(op, backend, shape, dtype, device, seed)

    check()


@pytest.mark.parametrize("backend", ["triton", "tilelang"], ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_nan_input_rows_stay_local(op, backend, device_for):
    """A NaN in one row makes that row NaN (as the reference does) and leaves the others exact."""
    device = device_for(backend)
    tensors = _inputs(op, (6, workload.NAN_WIDTH), torch.float32, device, 11, requires_grad=False)
    tensors[0][2, 17] = float("nan")
    with poisoned_outputs(device):
        y = _run(op, backend, tensors)
    assert_close(y, _reference(op, tensors), torch.float32, what=f"{op}[{backend}] NaN row")
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3, 4, 5]]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"], ids=lambda b: f"backend={b}")
@pytest.mark.parametrize("op", OPS)
def test_row_count_change_does_not_recompile(op, backend, device_for):
    if not CUDA:
        pytest.skip(f"{backend}: compilation caching is observable on a CUDA device only")
    device = device_for(backend)
    from pcvr_lib.kernels import _triton

    def compiled_count() -> int:
        if backend == "tilelang":
            return compile_log.count("tilelang", op)
        # triton's own count too: a recompile that the launcher's key missed would launch a stale binary
        return compile_log.count("triton", op) + _triton.compiled_variants(op)

    width = workload.RECOMPILE_WIDTH
    for rows in (17, 4096):  # first: compile inference + training kernels for this width
        check_forward(op, backend, (rows, width), torch.float16, device)
        check_backward(op, backend, (rows, width), torch.float16, device)
    before = compiled_count()
    for rows in (1, 31, 1000, 12345):
        check_forward(op, backend, (rows, width), torch.float16, device, seed=rows)
        check_backward(op, backend, (rows, width), torch.float16, device, seed=rows)
    assert compiled_count() == before


@pytest.mark.parametrize("op", OPS)
def test_errors_are_clear(op, monkeypatch):
    x = torch.randn(4, 8)
    params = [torch.ones(8)] * (1 if op == "rms_norm" else 2)
    fn = rms_norm if op == "rms_norm" else layer_norm
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; known backends: torch, triton, tilelang"):
        fn(x, *params, backend="cuda")
    with pytest.raises(ValueError, match="no 'cuembed' backend"):
        fn(x, *params, backend="cuembed")
    if not CUDA:
        with pytest.raises(RuntimeError, match=f"{op} requires CUDA tensors"):
            fn(x, *params, backend="tilelang")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match=f"{op} requires CUDA tensors"):
            fn(x, *params, backend="triton")
    with pytest.raises(TypeError, match="share one dtype"):
        fn(x, *[p.half() for p in params], backend="torch")
    with pytest.raises(ValueError, match=r"does not match the last dimension"):
        fn(x, *[torch.ones(7)] * len(params), backend="torch")
    with pytest.raises(TypeError, match="dtype float64 not supported"):
        fn(x.double(), *[p.double() for p in params], backend="torch")
    # a missing package names itself
    monkeypatch.setattr(dispatch, "package_problem", lambda pkg: "package not installed")
    dispatch.forget_implementations()
    with pytest.raises(RuntimeError, match="backend 'tilelang' cannot run here: tilelang: package not installed"):
        if CUDA:
            fn(x.cuda(), *[p.cuda() for p in params], backend="tilelang")
        else:  # on CPU the CUDA-tensor check fires first; ask the registry directly
            dispatch.require_backend(op, "tilelang", "cpu")


def test_backend_status_reasons():
    for op in OPS:
        assert dispatch.op_backends(op) == ("torch", "triton", "tilelang")
        assert dispatch.backend_status(op, "torch", "cpu") == (True, "ok")
        if not CUDA:
            assert dispatch.backend_status(op, "tilelang", "cpu") == (False, "tilelang: no CUDA device")
            assert dispatch.backend_status(op, "triton", "cpu") == (False, "triton: no CUDA device")


# ------------------------------------------------------------------ Triton: compile for sm_90 (no GPU)


def test_triton_kernels_compile_for_sm90_after_a_launch(device_for):
    """The four Triton kernels, which call the shared @helper `row_tile`, compile for sm_90 after a launch in
    this process. On CPU that launch is interpreted: it swaps the helper for its interpreted twin in the
    kernels' namespaces and must put the JITFunction back, or the compile would fail."""
    from triton.runtime.jit import JITFunction

    from pcvr_lib.kernels.norms import triton_impl as norms_triton

    device = device_for("triton")
    for op in OPS:
        check_backward(op, "triton", (3, 127), torch.float32, device)
    assert isinstance(norms_triton.row_tile, JITFunction)
    for name in ("rms_fwd", "rms_bwd", "ln_fwd", "ln_bwd"):
        ptx = norms_triton.compile_for(90, name, 333, "bf16").asm["ptx"]
        assert f".entry _{name}(" in ptx, name


# ------------------------------------------------------------------ TileLang: compile for sm_90 (no GPU)


def _compile_tilelang(spec):
    """Compile one TileLang kernel for sm_90 in a worker; returns (name, source length, seconds)."""
    import time

    from pcvr_lib import precompile

    op, kind, width, dtype = spec
    t0 = time.perf_counter()
    kernel = precompile.compile_variant(op, (kind, width, dtype), "sm_90a")  # the norms take sm_90 of it
    return f"{op}/{kind}", kernel.get_kernel_source(), time.perf_counter() - t0


def test_tilelang_kernels_compile_for_sm90():
    """Every TileLang kernel (inference, training forward, backward) lowers and compiles for sm_90."""
    problem = dispatch.package_problem("tilelang") or (None if CUDA else dispatch.nvcc_problem(torch.device("cpu")))
    if problem:
        pytest.skip(f"tilelang: {problem}")
    # 385 exercises the padded, guarded path; bf16 the conversions
    specs = [(op, kind, 385, torch.bfloat16) for op in OPS for kind in ("fwd_infer", "fwd_train", "bwd")]
    with ProcessPoolExecutor(max_workers=min(6, os.cpu_count() or 1)) as pool:
        results = list(pool.map(_compile_tilelang, specs))
    for name, source, _seconds in results:
        assert "__global__" in source, name
        assert "385" in source, f"{name}: the true width must appear in the guarded code"
