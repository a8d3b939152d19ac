"""The peers table's glue on the CPU: the frontier peers (quack, FlashAttention 4) run only on the GPU host, so
here their packages are stood in for by torch implementations of the same contracts (argument order, layouts,
partial gradient sums), and what our side adds (layout transposes, key lengths, the autograd wiring, skip
reasons) is checked against torch."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib import report
from pcvr_lib.kernels.attention.reference import reference_mask
from perf_tests import peers


def test_every_peer_is_displayed_by_the_report():
    assert set(peers.PEERS) <= set(report.KERNEL_PEERS), "pcvr report orders the peers it knows first"


@pytest.mark.parametrize("name", [name for name, peer in peers.PEERS.items() if peer.package])
def test_a_missing_package_is_a_skip_reason(monkeypatch, name):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda _name: None)
    ok, reason = peers.status(name, "cpu")
    assert not ok and reason == f"{name}: package not installed"


def test_a_missing_parent_package_is_not_an_error():
    """FlashAttention 4's package is flash_attn.cute: without flash_attn, find_spec of the submodule raises."""
    if "flash_attn" in sys.modules or peers.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    ok, reason = peers.status("fa4", "cpu")
    assert not ok and reason == "fa4: package not installed"


@pytest.mark.parametrize("kw", [{"window": 8, "global_queries": 1}, {"role_mask": object()},
                                {"key_lengths": None, "causal_valid": True}])
def test_fa4_refuses_the_masks_it_has_no_form_for(kw):
    with pytest.raises(peers.PeerUnavailable, match="fa4: no mask of"):
        peers.fa4_peer(kw)


def test_fa4_key_lengths_are_forward_only():
    with pytest.raises(peers.PeerUnavailable, match="backward with key lengths"):
        peers.fa4_peer({"key_lengths": torch.tensor([3]), "causal": False}, grad=True)


def _fake_module(monkeypatch, name: str, **attrs) -> None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        module = types.ModuleType(".".join(parts[:i]))
        monkeypatch.setitem(sys.modules, module.__name__, module)
        if i > 1:
            setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)


def _sdpa_bshd(q, k, v, causal=False, lengths=None):
    """Attention on FlashAttention's (B, S, H, D) layout, keys past `lengths` masked (FA4's contract)."""
    B, S, _, _ = q.shape
    mask = None
    if lengths is not None:
        mask = (torch.arange(S)[None, :] < lengths[:, None].long())[:, None, None, :]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                         is_causal=causal and mask is None)
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask", ["none", "key_lengths", "causal"])
def test_fa4_peer_layout_and_key_lengths(monkeypatch, mask):
    """Our (B, H, S, D) tensors reach FA4 as (B, S, H, D) views; key lengths as seqused_k; gradients flow back."""
    seen = {}

    def flash_attn_func(q, k, v, causal=False):
        seen["strides"] = q.stride()
        return _sdpa_bshd(q, k, v, causal=causal), None  # FA4 may return (out, lse)

    def flash_attn_varlen_func(q, k, v, seqused_k=None, causal=False):
        assert seqused_k.dtype == torch.int32
        return _sdpa_bshd(q, k, v, causal=causal, lengths=seqused_k)

    _fake_module(monkeypatch, "flash_attn.cute", flash_attn_func=flash_attn_func,
                 flash_attn_varlen_func=flash_attn_varlen_func)
    B, H, S, D = 3, 2, 24, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kw = {"key_lengths": torch.tensor([24, 9, 1]) if mask == "key_lengths" else None, "causal": mask == "causal"}
    got = peers.fa4_peer(kw)(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(B, S, S, kw) if mask != "none" else None)
    torch.testing.assert_close(got, want)
    if mask != "key_lengths":
        assert seen["strides"] == (H * S * D, D, S * D, 1), "q reaches FA4 as a transposed view, not a copy"
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, b)


def _fake_quack(monkeypatch, sm_count: int = 3) -> dict:
    """quack.rmsnorm's LayerNorm kernels as torch code with their contracts: the forward fills out, rstd, mean;
    the backward fills dx and per-program fp32 partial sums of dweight and dbias (rows split over sm_count)."""
    calls = {}

    def _rmsnorm_fwd(x, weight, out, bias, rstd, mean, residual, residual_out, eps, is_layernorm):
        assert is_layernorm and residual is None and residual_out is None
        calls["weight_dtype"] = weight.dtype
        xf = x.double()
        mean.copy_(xf.mean(-1))
        rstd.copy_((xf.var(-1, unbiased=False) + eps).rsqrt())
        out.copy_((xf - mean.double()[:, None]) * rstd.double()[:, None] * weight.double() + bias.double())

    def _rmsnorm_bwd(x, weight, dout, rstd, dx, dw_partial, db_partial, dresidual_out, dresidual, sm_count,
                     mean=None, is_layernorm=False):
        assert is_layernorm and mean is not None and dresidual_out is None
        xhat = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
        dxhat = dout.double() * weight.double()
        dx.copy_(rstd.double()[:, None] * (dxhat - dxhat.mean(-1, keepdim=True)
                                           - xhat * (dxhat * xhat).mean(-1, keepdim=True)))
        dw_partial.zero_()
        db_partial.zero_()
        for i, rows in enumerate(torch.arange(x.shape[0]).chunk(sm_count)):
            dw_partial[i] = (dout.double()[rows] * xhat[rows]).sum(0)
            db_partial[i] = dout.double()[rows].sum(0)

    _fake_module(monkeypatch, "quack.rmsnorm", _rmsnorm_fwd=_rmsnorm_fwd, _rmsnorm_bwd=_rmsnorm_bwd,
                 get_sm_count=lambda width, device: sm_count,
                 rmsnorm=lambda x, w, eps: calls.setdefault("rms_eps", eps) and x)
    return calls


def test_quack_layer_norm_glue_matches_torch(monkeypatch):
    """The LayerNorm peer's autograd Function: the case's parameter dtype reaches the kernel, the partial
    parameter gradients are summed and cast back, the gradients equal torch's."""
    calls = _fake_quack(monkeypatch)
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((7, 12), (12,), (12,)))
    dy = torch.randn(7, 12, generator=g, dtype=torch.float64)
    fn = peers.norm_peer("layer_norm", "quack", 1e-5)
    got = fn(x, w, b)
    want = F.layer_norm(x, (12,), w, b, 1e-5)
    torch.testing.assert_close(got, want)
    assert calls["weight_dtype"] == torch.float64
    dx, dw, db = torch.autograd.grad(got, (x, w, b), dy)
    want_dx, want_dw, want_db = torch.autograd.grad(want, (x, w, b), dy)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-6)  # quack's partial sums are fp32
    torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-6)


def test_quack_rms_norm_gets_the_case_eps(monkeypatch):
    calls = _fake_quack(monkeypatch)
    peers.norm_peer("rms_norm", "quack", 1e-6)(torch.ones(2, 4), torch.ones(4))
    assert calls["rms_eps"] == 1e-6
