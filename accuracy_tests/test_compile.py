"""Our kernels under torch.compile: each op x GPU backend is a torch.library custom op with a fake kernel and its
backward, so `torch.compile(fullgraph=True)` traces it without a graph break, and the compiled call gives the
eager call's result.

CPU (CI): Triton under its interpreter, compiled with the aot_eager backend (AOTAutograd traces the forward and the
backward; the ops run for real) and checked against the eager call; TileLang traced by dynamo on fake CUDA
tensors (the graph must hold our op as one node; nothing runs). GPU: both backends compiled by inductor against
eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pcvr_lib.kernels import dispatch, embedding_bag_mean, flash_attention, layer_norm, rms_norm
from pcvr_lib.kernels.testing import triton_interpreter_problem
from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.workloads import attention as attention_workload
from pcvr_lib.workloads import embedding_bag as embedding_workload

CUDA = torch.cuda.is_available()
ATTENTION_MASKS = ("key_lengths", "window", "roles")


def _attention_kwargs(mask: str, B: int, S: int, convert) -> dict:
    """flash_attention's mask keyword arguments, each tensor passed through `convert`."""
    if mask == "key_lengths":
        return {"key_lengths": convert(attention_workload.key_lengths(B, S))}
    kw = attention_workload.structured_mask(mask, B, S)
    if "role_mask" in kw:
        rm = kw["role_mask"]
        fields = {f.name: getattr(rm, f.name) for f in dataclasses.fields(rm)}
        kw["role_mask"] = dataclasses.replace(rm, **{k: convert(t) for k, t in fields.items() if t is not None})
    return {name: convert(v) if isinstance(v, torch.Tensor) else v for name, v in kw.items()}


def _cases(dtype, convert=lambda t: t):
    """(name, function of the inputs, inputs that require grad, the other inputs, grad of the output) per op, every
    tensor drawn on the CPU and passed through `convert` (to the device, or to a fake CUDA tensor)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return convert((torch.randn(*shape, generator=g) * scale).to(dtype))

    x, w, b = randn(4, 3, 64), randn(64, scale=0.5) + 1, randn(64, scale=0.5)
    cases = [("rms_norm", lambda x, w, backend: rms_norm(x, w, backend=backend), (x, w), (), randn(4, 3, 64)),
             ("layer_norm", lambda x, w, b, backend: layer_norm(x, w, b, backend=backend), (x, w, b), (),
              randn(4, 3, 64))]
    B, H, S, D = 2, 2, 40, 16
    q, k, v, do = (randn(B, H, S, D) for _ in range(4))
    for mask in ATTENTION_MASKS:
        kw = _attention_kwargs(mask, B, S, convert)
        cases.append((f"flash_attention[{mask}]",
                      lambda q, k, v, backend, kw=kw: flash_attention(q, k, v, backend=backend, **kw),
                      (q, k, v), (), do))
    ids = convert(embedding_workload.accuracy_ids(9, 5, 30, 0.3, seed=1))
    table = convert(embedding_workload.weight(30, 8, dtype, 2, "cpu"))
    for sparse in (True, False):
        cases.append((f"embedding_bag_mean[{'sparse' if sparse else 'dense'}]",
                      lambda w, ids, backend, sparse=sparse: embedding_bag_mean(w, ids, backend=backend,
                                                                                sparse_grad=sparse),
                      (table,), (ids,), randn(9, 8)))
    return cases


CASE_NAMES = [c[0] for c in _cases(torch.float32)]



def _run(fn, grads_of, others, grad_out, backend):
    inputs = [t.detach().clone().requires_grad_() for t in grads_of]
    out = fn(*inputs, *others, backend=backend)
    grads = torch.autograd.grad(out, inputs, grad_out)
    return [out, *(g.to_dense() if g.is_sparse else g for g in grads)]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_triton_compiles_fullgraph_and_matches_eager_interpreter(name, monkeypatch):
    if CUDA:
        pytest.skip("triton: on a GPU test_gpu_compiled_matches_eager checks the compiled kernels")
    problem = dispatch.package_problem("triton") or triton_interpreter_problem()
    if problem:
        pytest.fail(f"triton: {problem}: the compiled path cannot be checked on this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dtype = torch.float16 if name.startswith("flash_attention") else torch.float32
    _, fn, grads_of, others, grad_out = next(c for c in _cases(dtype) if c[0] == name)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = _run(compiled, grads_of, others, grad_out, "triton")
    want = _run(fn, grads_of, others, grad_out, "triton")
    for what, a, e in zip(("output", *(f"grad {i}" for i in range(len(grads_of)))), got, want, strict=True):
        assert_close(a, e.double(), dtype, what=f"{name} compiled vs eager: {what}")


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_the_compiled_graph_holds_our_op_as_one_node(name, backend):
    """Dynamo traces the inference call on fake CUDA tensors (no device, nothing runs) in one graph, whose only
    call into the library is our custom op."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dtype = torch.float16 if name.startswith("flash_attention") else torch.float32
    torch._dynamo.reset()
    mode = FakeTensorMode()

    def fake_cuda(t: torch.Tensor) -> torch.Tensor:  # a fake CUDA tensor shaped like t (no device needed)
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    _, fn, grads_of, others, _ = next(c for c in _cases(dtype, fake_cuda) if c[0] == name)
    compiled = torch.compile(lambda *args: fn(*args, backend=backend), fullgraph=True, backend=capture)
    with mode, torch.no_grad():
        compiled(*grads_of, *others)
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    ours = [t for t in targets if t.startswith("pcvr.")]
    assert len(ours) == 1, targets


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_gpu_compiled_matches_eager(name, backend):
    if not CUDA:
        pytest.skip(f"{backend}: no CUDA device")
    ok, reason = dispatch.backend_status(name.split("[")[0], backend, "cuda")
    if not ok:
        pytest.skip(reason)
    dtype = torch.bfloat16 if name.startswith("flash_attention") else torch.float32
    _, fn, grads_of, others, grad_out = next(c for c in _cases(dtype, lambda t: t.cuda()) if c[0] == name)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    got = _run(compiled, grads_of, others, grad_out, backend)
    want = _run(fn, grads_of, others, grad_out, backend)
    for what, a, e in zip(("output", *(f"grad {i}" for i in range(len(grads_of)))), got, want, strict=True):
        assert_close(a, e.double(), dtype, what=f"{name} {backend} compiled vs eager: {what}")
