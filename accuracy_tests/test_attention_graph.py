"""flash_attention inside a CUDA graph: the whole forward + backward captured once, replayed on new values.

At the PCVR shape (B8 H8 S128 D64) the kernels take a few microseconds and the host path (checks, autograd, launches)
the rest; a caller that captures the step removes that host cost, so capture must be supported, not luck.

Protocol (torch's documented one): static inputs; three warm-up calls on a side stream (compiles, the
launchers' caches, the autograd graph); capture `out = flash_attention(...)` and
`torch.autograd.grad(out, (q, k, v), do)` into a `torch.cuda.CUDAGraph`; copy new values into the static
inputs (q, k, v, grad_out and the key lengths: a new length pattern); replay; compare with an eager call on
the same values.

Comparison: bitwise (`torch.equal`). The replay runs the very kernels the eager call launches, with the same
tile configs, on the same values; at Sq <= 512 every backward kernel is deterministic (no atomics: each
output element is written by one program in a fixed order), so any difference means the graph replayed
something stale: a value read on the host at capture (a key length, a shape-dependent branch taken on data),
a buffer the caller's copy did not reach, or a launch that was not captured. The replayed output is also
required to differ from the captured call's output, so a replay that did nothing cannot pass.

Dropout under capture is refused with a ValueError (tested here on the GPU and, with the capture state
faked, on the CPU): the seed is drawn on the host, so a captured call would replay one dropout mask forever.
"""

import pytest
import torch

from accuracy_tests.skips import require_cuda_backend
from pcvr_lib.kernels import flash_attention
from pcvr_lib.workloads import attention as workload

CUDA = torch.cuda.is_available()
DT = workload.DTYPES
# (dtype, mask): the PCVR shape's key lengths in both dtypes, causal, and causal-valid with key lengths
# (every one a TileLang variant the GPU suite already compiles, so no new TileLang compile)
GRAPH_CASES = [("bf16", "key_lengths"), ("fp16", "key_lengths"), ("bf16", "causal"), ("bf16", "causal_valid")]
PCVR = (8, 8, 128, 64)  # B, H, S, D


def _mask_kwargs(mask: str, lengths: torch.Tensor) -> dict:
    use_kl, causal, causal_valid = workload.MODES[mask]
    return {"key_lengths": lengths if use_kl else None, "causal": causal, "causal_valid": causal_valid}


def _values(seed: int, dtype, device):
    """q, k, v, grad_out and a key-length pattern drawn from `seed` (lengths 0..S+5: empty, partial, full rows)."""
    B, H, S, D = PCVR
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    lengths = torch.randint(0, S + 6, (B,), generator=g, dtype=torch.int32)
    lengths[seed % B] = 0  # one all-padding row every time
    return q, k, v, do, lengths.to(device)


def _eager(backend, q, k, v, do, lengths, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, **_mask_kwargs(mask, lengths.clone()), backend=backend)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("dtype,mask", GRAPH_CASES, ids=[f"{d}-{m}" for d, m in GRAPH_CASES])
def test_gpu_graph_capture_forward_backward(backend, dtype, mask):
    require_cuda_backend("flash_attention", backend)
    dt = DT[dtype]
    q0, k0, v0, do0, len0 = _values(1, dt, "cuda")
    q = q0.clone().requires_grad_()
    k = k0.clone().requires_grad_()
    v = v0.clone().requires_grad_()
    do, lengths = do0.clone(), len0.clone()
    kw = _mask_kwargs(mask, lengths)

    def step():
        out = flash_attention(q, k, v, **kw, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    first = [t.detach().clone() for t in static]
    expected_first = _eager(backend, q0, k0, v0, do0, len0, mask)
    for name, got, want in zip(("out", "dq", "dk", "dv"), first, expected_first, strict=True):
        assert torch.equal(got, want), f"{backend} {dtype} {mask}: replay of the captured values differs in {name}"

    for seed in (2, 3):  # new values (and a new key-length pattern) copied into the static inputs
        qn, kn, vn, don, lenn = _values(seed, dt, "cuda")
        with torch.no_grad():
            for static_in, new in ((q, qn), (k, kn), (v, vn), (do, don), (lengths, lenn)):
                static_in.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(backend, qn, kn, vn, don, lenn, mask)
        for name, got, w, before in zip(("out", "dq", "dk", "dv"), static, want, first, strict=True):
            assert not torch.equal(got, before), f"{name}: the replay left the captured call's result in place"
            assert torch.isfinite(got).all(), f"{backend} {dtype} {mask} seed {seed}: non-finite {name}"
            if not torch.equal(got, w):
                err = float((got.float() - w.float()).abs().max())
                raise AssertionError(f"{backend} {dtype} {mask} seed {seed}: graph replay differs from the eager "
                                     f"call in {name} (max abs {err:.3g}); something was baked in at capture")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "tilelang"])
def test_gpu_graph_capture_refuses_dropout(backend):
    """A captured dropout call would replay one mask forever: refused by name, on every backend."""
    require_cuda_backend("flash_attention", backend)
    q, k, v, _, lengths = _values(4, torch.bfloat16, "cuda")
    # causal-valid with key lengths: its dropout variant is one the GPU suite already compiles for TileLang
    kw = {"key_lengths": lengths, "causal_valid": True, "backend": backend}
    flash_attention(q, k, v, **kw)  # warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="inside a CUDA graph capture"), torch.cuda.graph(graph):
        flash_attention(q, k, v, dropout_p=0.1, training=True, **kw)
    # outside a capture the same call runs, and without training dropout is off (so capture is allowed; the
    # torch backend's own capture is SDPA's business, not checked here)
    flash_attention(q, k, v, dropout_p=0.1, training=True, **kw)
    if backend == "torch":
        return
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        flash_attention(q, k, v, dropout_p=0.1, training=False, **kw)
    graph2.replay()
    torch.cuda.synchronize()


def test_dropout_refused_while_capturing_cpu(monkeypatch):
    """The capture check itself, on the CPU with the capture state faked: dropout raises with the reason,
    no-dropout and eval calls go through (CPU tensors, torch backend)."""
    q, k, v, _, lengths = _values(5, torch.float32, "cpu")
    import pcvr_lib.kernels.attention as attention

    monkeypatch.setattr(attention, "_capturing", lambda: True)
    with pytest.raises(ValueError, match="dropout_p=0.2 inside a CUDA graph capture"):
        flash_attention(q, k, v, key_lengths=lengths, dropout_p=0.2, training=True, backend="torch")
    flash_attention(q, k, v, key_lengths=lengths, dropout_p=0.2, training=False, backend="torch")
    flash_attention(q, k, v, key_lengths=lengths, backend="torch")
    monkeypatch.setattr(attention, "_capturing", lambda: False)
    flash_attention(q, k, v, key_lengths=lengths, dropout_p=0.2, training=True, backend="torch")


def test_capturing_is_false_without_a_capture():
    from pcvr_lib.kernels.attention import _capturing

    assert _capturing() is False
