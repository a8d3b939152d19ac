"""Benchmarks of embedding_bag_mean: backend x shape x dtype x id distribution x direction.

Each case checks the result against a float64 reference first (a mismatch fails the case untimed), then
times per-call latency as a user sees it (back-to-back calls, host work included; device-only time
beside it) through the shared runner perf_tests/kernel_bench.py.

The "torch" case is the peer a user would otherwise call: `F.embedding_bag(mode="mean",
padding_idx=0)` on ids that are already in range; the library's own torch backend adds one masking pass for ids
outside (0, V). fwd+bwd returns what ours returns, like for like: the output and the weight gradient with its
duplicate rows summed (torch: sparse=True and `coalesce()`, which waits for the row count on the host; ours:
merged on the device, no sync). Gradients are taken with torch.autograd.grad (nothing accumulates across
calls). fwd+bwd+adagrad is the sparse path of a model's train step: forward, backward and one Adagrad step
of the touched rows, checked by the table after one step (touched rows against float64, the others unchanged);
its peers are torch (F.embedding_bag sparse + torch.optim.Adagrad) and FBGEMM's table-batched embedding,
whose backward applies the update itself (torchrec's path). FBGEMM is a forward peer too (perf_tests/peers.py).

Distributions: "uniform" = fixed bag length, each position padding (id 0) with probability 0.25, ids
uniform in [1, V); "zipf" = bag lengths uniform in [1, L] (the rest padding), ids log-uniform
(P(id) ~ 1/id, Zipf s=1) scattered over the table by a multiplicative hash, so hot rows are not
neighbours. Bytes counted: valid gathered rows + ids + output (fwd); plus grad_out read, ids read and
the COO values + indices written (fwd+bwd, B*L entries: our layout).

Print the table of a saved run: python -m pcvr_lib report RUN.json --view cases
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib import precompile, sources
from pcvr_lib.kernels import compile_log
from pcvr_lib.kernels import embedding_bag as eb
from pcvr_lib.kernels.testing import poisoned_outputs
from pcvr_lib.kernels.tolerance import Tolerance, assert_close, max_errors, tolerance
from pcvr_lib.workloads import embedding_bag as workload
from perf_tests import kernel_bench as kb
from perf_tests import peers

OP = eb.OP
CUDA = torch.cuda.is_available()
DTYPES = kb.DTYPES  # "fp16" -> torch.float16, ...

SHAPES = workload.PERF_SHAPES if CUDA else workload.CPU_PERF_SHAPES
DISTS = workload.DISTS
FWD_BACKENDS = ("torch", "triton", "tilelang", "cuembed", "fbgemm")
TRAIN_BACKENDS = ("torch", "triton", "tilelang")
STEP_BACKENDS = ("torch", "triton", "tilelang", "fbgemm")
STEP = "fwd+bwd+adagrad"
# the step direction's Adagrad: a positive starting accumulator keeps the first update away from lr * sign(g),
# which rounding near g = 0 would flip
ADAGRAD = {"lr": 0.05, "eps": 1e-10, "initial_accumulator_value": 0.1}


def cases():
    out = []
    for name, batch, num_rows, dim, bag, dtypes in SHAPES:
        for dtype in dtypes:
            for dist in DISTS:
                for direction, backends in (("fwd", FWD_BACKENDS), ("fwd+bwd", TRAIN_BACKENDS),
                                            (STEP, STEP_BACKENDS)):
                    for backend in backends:  # torch first: the speedups need its time
                        cid = (f"op={OP},backend={backend},shape={name},dtype={dtype},dist={dist},"
                               f"dir={direction}")
                        out.append(pytest.param(backend, (name, batch, num_rows, dim, bag), dtype, dist,
                                                direction, id=cid))
    return out


@pytest.fixture(scope="module", autouse=True)
def tilelang_precompiled():
    """On a GPU, compile the workload's TileLang manifest in parallel processes before timing anything (the
    cases then load from TileLang's disk cache; each kernel's seconds are still recorded and reported)."""
    if not CUDA or not eb.backend_status("tilelang", "cuda")[0]:
        return None
    jobs = precompile.tilelang_jobs(["embedding_bag_mean"], precompile.default_arch())
    return precompile.run_pool(precompile.compile_job, jobs, min(16, os.cpu_count() or 1), "tilelang")


_INPUTS: dict[tuple, tuple] = {}


def inputs(shape, dtype, dist, device):
    key = (shape, dtype, dist)
    if key not in _INPUTS:
        _INPUTS.clear()  # one problem's tensors at a time (the V10M table is 1.3 GB)
        _INPUTS[key] = workload.perf_inputs(shape, dtype, dist, device)
    return _INPUTS[key]


def peer_or_skip(backend, weight, ids, grad_out, direction):
    """make_call, with a peer that has no form for the case skipped with its reason."""
    try:
        return make_call(backend, weight, ids, grad_out, direction)
    except peers.PeerUnavailable as exc:
        pytest.skip(str(exc))


def make_call(backend, weight, ids, grad_out, direction):
    if direction == "fwd":
        if backend == "torch":
            return lambda: F.embedding_bag(ids, weight, mode="mean", padding_idx=0)
        if backend == "fbgemm":
            return peers.fbgemm_embedding_peer(weight, ids)
        return lambda: eb.embedding_bag_mean(weight, ids, backend=backend)
    if direction == STEP:
        return adagrad_step(backend, weight, ids, grad_out)[0]
    w = weight.detach().requires_grad_()
    if backend == "torch":
        def step():
            out = F.embedding_bag(ids, w, mode="mean", padding_idx=0, sparse=True)
            return out, torch.autograd.grad(out, w, grad_out)[0].coalesce()
    else:
        def step():
            out = eb.embedding_bag_mean(w, ids, backend=backend, sparse_grad=True)
            return out, torch.autograd.grad(out, w, grad_out)[0]
    return step


def adagrad_step(backend, weight, ids, grad_out):
    """The sparse path of a model's train step on a copy of `weight`: the bag means, their backward with
    `grad_out` and one Adagrad step (ADAGRAD) on the touched rows. (call, table): call() makes one step and
    returns the bag means; table() is the updated table. torch: F.embedding_bag(sparse=True) and
    torch.optim.Adagrad (which coalesces the gradient: a host sync); ours: embedding_bag_mean(sparse_grad=True)
    and pcvr_lib's SparseAdagrad (no sync); fbgemm: its backward with the update fused (EXACT_ADAGRAD, no
    gradient materialised)."""
    if backend == "fbgemm":
        return peers.fbgemm_adagrad_step(weight, ids, grad_out, **ADAGRAD)
    from pcvr_lib.optim.sparse_adagrad import SparseAdagrad

    w = weight.detach().clone().requires_grad_()
    if backend == "torch":
        opt = torch.optim.Adagrad([w], **ADAGRAD)

        def forward():
            return F.embedding_bag(ids, w, mode="mean", padding_idx=0, sparse=True)
    else:
        opt = SparseAdagrad([w], **ADAGRAD)

        def forward():
            return eb.embedding_bag_mean(w, ids, backend=backend, sparse_grad=True)

    def call():
        out = forward()
        out.backward(grad_out)
        opt.step()
        w.grad = None
        return out.detach()

    return call, w.detach


def adagrad_check(backend, weight, ids, grad_out, device):
    """One step of a fresh adagrad_step against float64: touched rows within the dtype's tolerance, the bag
    means too, every other row unchanged (bit for bit: nothing may write them)."""
    call, table = adagrad_step(backend, weight, ids, grad_out)
    with poisoned_outputs(device):
        out = call()
    assert_close(out, eb.reference_forward(weight, ids), weight.dtype, what=f"{backend} forward (step)")
    num_rows, dim = weight.shape
    valid = (ids > 0) & (ids < num_rows)
    count = valid.sum(dim=1, keepdim=True).clamp_min(1).to(torch.float64)
    terms = (grad_out.to(torch.float64) / count)[valid.nonzero()[:, 0]]
    rows, inverse = torch.unique(ids[valid].long(), return_inverse=True)
    grad = torch.zeros(rows.numel(), dim, dtype=torch.float64, device=device).index_add_(0, inverse, terms)
    acc = ADAGRAD["initial_accumulator_value"] + grad * grad
    expected = weight[rows].to(torch.float64) - ADAGRAD["lr"] * grad / (acc.sqrt() + ADAGRAD["eps"])
    after = table()
    assert_close(after[rows], expected, weight.dtype, what=f"{backend} rows after the Adagrad step")
    untouched = torch.ones(num_rows, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(after[untouched], weight[untouched]), f"{backend}: the step changed rows no id touched"
    return max_errors(after[rows], expected)


RETURNS = {"fwd": "the bag means", "fwd+bwd": "output and the weight gradient with duplicate rows summed",
           STEP: (f"the bag means; the table after one Adagrad step on the touched rows (lr {ADAGRAD['lr']}, eps "
                  f"{ADAGRAD['eps']}, accumulator from {ADAGRAD['initial_accumulator_value']})")}


def grad_check(grad, weight, ids, grad_out):
    """Coalesced sparse gradient vs float64 (computed on the device), atol relative to sum of |terms|."""
    num_rows, dim = weight.shape
    valid = (ids > 0) & (ids < num_rows)
    count = valid.sum(dim=1, keepdim=True).clamp_min(1).to(torch.float64)
    bag_of = valid.nonzero()[:, 0]
    terms = (grad_out.to(torch.float64) / count)[bag_of]
    index = ids[valid].unsqueeze(0)
    expected = torch.sparse_coo_tensor(index, terms, (num_rows, dim)).coalesce()
    magnitude = torch.sparse_coo_tensor(index, terms.abs(), (num_rows, dim)).coalesce()
    actual = grad.to(torch.float64).coalesce()
    idx, a = actual.indices()[0], actual.values()
    if idx.numel() and int(idx[0]) == 0:  # our layout: row 0 carries zeros for all-padding bags
        assert torch.count_nonzero(a[0]) == 0, "padding row 0 got a non-zero gradient"
        idx, a = idx[1:], a[1:]
    assert torch.equal(idx, expected.indices()[0]), "gradient touches other rows than the ids"
    e = expected.values()
    ratio = float(magnitude.values().pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-300))
    base = tolerance(weight.dtype)
    assert_close(a, e, weight.dtype, what="sparse grad", tol=Tolerance(base.atol * max(ratio, 1.0), base.rtol))
    return max_errors(a, e)


@pytest.mark.parametrize("backend,shape,dtype,dist,direction", cases())
def test_embedding_bag_perf(benchmark, backend, shape, dtype, dist, direction):
    if not CUDA:
        if backend == "fbgemm":  # fbgemm-gpu-cpu runs its CPU kernel: the peer's numbers are checked here too
            ok, reason = peers.status(backend, "cpu")
            if not ok:
                pytest.skip(reason)
        elif backend != "torch":
            ok, reason = eb.backend_status(backend, "cpu")
            pytest.skip(reason if not ok else f"{backend}: GPU benchmark")
        return cpu_case(benchmark, backend, shape, dtype, dist, direction)
    device = kb.require_gpu_backend(OP, backend)
    weight, ids, grad_out = inputs(shape, dtype, dist, device)
    call = peer_or_skip(backend, weight, ids, grad_out, direction)

    before = dict(compile_log.SECONDS)
    _, first_s = kb.timed_first_call(call)
    new = {k: v for k, v in compile_log.SECONDS.items() if k not in before}
    compile_s = sum(new.values()) if new else 0.0

    def check():
        if direction == STEP:
            return adagrad_check(backend, weight, ids, grad_out, device)
        with poisoned_outputs(device):  # a kernel that skips part of its output must not pass on stale values
            out = call()
        if direction == "fwd":
            expected = eb.reference_forward(weight, ids)
            assert_close(out, expected, weight.dtype, what=f"{backend} forward")
            return max_errors(out, expected)
        out, grad = out
        expected = eb.reference_forward(weight, ids)
        assert_close(out, expected, weight.dtype, what=f"{backend} forward (train)")
        return grad_check(grad, weight, ids, grad_out)

    key = kb.CaseKey(OP, f"{shape[0]},dist={dist}", dtype, direction)
    torch_call = make_call("torch", weight, ids, grad_out, direction)
    info = kb.run_case(benchmark, key=key, backend=backend, call=call, check=check,
                       bytes_moved=workload.bytes_moved(weight, ids, direction), returns=RETURNS[direction],
                       compile_s=compile_s, torch_call=torch_call, rounds=15, graph=(direction == "fwd"))
    benchmark.extra_info.update({"dist": dist, "shape": shape[0], "first_call_s": round(first_s, 3),
                                 "compiled_now": bool(new), "ids_dtype": str(ids.dtype).replace("torch.", "")})
    assert info["max_abs_error"] == info["max_abs_error"]  # NaN never passes


def cpu_case(benchmark, backend, shape, dtype, dist, direction):
    """CI: the torch peer (and FBGEMM's CPU kernel where fbgemm-gpu-cpu is installed) at a small shape,
    checked, run once (no GPU timer on CPU)."""
    weight, ids, grad_out = inputs(shape, dtype, dist, torch.device("cpu"))
    call = peer_or_skip(backend, weight, ids, grad_out, direction)
    if direction == STEP:
        benchmark.pedantic(call, rounds=1, iterations=1)
        adagrad_check(backend, weight, ids, grad_out, weight.device)
        return _cpu_info(benchmark, backend, shape, dtype, dist, direction)
    with poisoned_outputs(weight.device):
        result = benchmark.pedantic(call, rounds=1, iterations=1)
    out = result if direction == "fwd" else result[0]
    assert_close(out, eb.reference_forward(weight, ids), weight.dtype, what=f"{backend} forward")
    if direction == "fwd+bwd":
        grad_check(result[1], weight, ids, grad_out)
    _cpu_info(benchmark, backend, shape, dtype, dist, direction)


def _cpu_info(benchmark, backend, shape, dtype, dist, direction):
    benchmark.extra_info.update({"op": OP, "backend": backend, "shape": shape[0], "dtype": dtype, "dist": dist,
                                 "dir": direction, "returns": RETURNS[direction],
                                 **sources.stamp(sources.kernel_subject(OP, backend, ours=False)),
                                 "note": "CPU smoke run, not a GPU timing"})
