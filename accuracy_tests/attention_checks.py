"""The flash-attention accuracy checks shared by the CPU and GPU test files: inputs, mask arguments, one
case checked against the fp64 reference by the flash-attention rule (test_attention.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels import dispatch, flash_attention
from pcvr_lib.kernels.attention import dropout_keep_mask, role_mask
from pcvr_lib.kernels.attention.masks import draw_seed
from pcvr_lib.kernels.attention.reference import reference, reference_mask
from pcvr_lib.kernels.testing import poisoned_outputs, triton_interpreter_problem
from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error
from pcvr_lib.workloads import attention as workload

CUDA = torch.cuda.is_available()
DT = workload.DTYPES
MODES = workload.MODES


inputs = workload.inputs


def on_device(kw, device):
    """flash_attention's mask keyword arguments with their tensors moved to `device`."""
    out = dict(kw)
    if out.get("key_lengths") is not None:
        out["key_lengths"] = out["key_lengths"].to(device)
    rm = out.get("role_mask")
    if rm is not None:
        out["role_mask"] = role_mask(rm.roles.to(device), rm.visibility.to(device),
                                     None if rm.key_valid is None else rm.key_valid.to(device))
    return out


def run_backend(backend, q, k, v, do, device, kw, p, seed):
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, **on_device(kw, device), dropout_p=p, training=p > 0,
                          generator=torch.Generator().manual_seed(seed), backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), do.to(device))
    return [t.detach().cpu() for t in (out, *grads)]


def mask_kwargs(mode, B, Sq, Skv, seed=0):
    """(flash_attention's mask keyword arguments, the equivalent boolean (B, 1, Sq, Skv) mask) of a mode."""
    if mode in workload.STRUCTURED:
        kw = workload.structured_mask(mode, B, Sq, seed)
    else:
        use_kl, causal, causal_valid = MODES[mode]
        kw = {"key_lengths": workload.key_lengths(B, Skv) if use_kl else None, "causal": causal,
              "causal_valid": causal_valid}
    return kw, reference_mask(B, Sq, Skv, kw)


def check_case(backend, B, H, Sq, Skv, D, dtype, mode, p=0.0, device="cpu", seed=0):
    """Output and dq, dk, dv of `backend` against fp64, judged by torch's own error in the same dtype."""
    q, k, v, do = inputs(B, H, Sq, Skv, D, dtype, seed)
    kw, mask = mask_kwargs(mode, B, Sq, Skv, seed)
    theirs = run_backend("torch", q, k, v, do, device, kw, p, seed)
    if device != "cpu":
        with poisoned_outputs(device):
            ours = run_backend(backend, q, k, v, do, device, kw, p, seed)
    else:
        ours = run_backend(backend, q, k, v, do, device, kw, p, seed)
    keep = None
    if p > 0:
        keep = dropout_keep_mask(draw_seed(torch.Generator().manual_seed(seed)), B, H, Sq, Skv, p)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, None, False, False, keep, p, mask=mask)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    inherent = dict(zip(("dq", "dk"), flash_delta_error(q64, k64, ref.detach(), do, dtype, mask), strict=True))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, (ref.detach(), *ref_grads), strict=True):
        baseline = max(max_abs_error(b, r), inherent.get(name, 0.0))
        flash_rule(a, r, baseline, dtype, f"{backend} {mode} {name} B{B} H{H} Sq{Sq} Skv{Skv} D{D} p={p}")


def flash_delta_error(q64, k64, out64, do, dtype, mask):
    """(max error in dQ, in dK) that a flash backward cannot avoid in delta = rowsum(dO * O), to first order:
    it keeps O in `dtype` (|rowsum(dO * (round(O) - O))|) and forms delta and dP = dO . V as two fp32 dot products
    (each within D * 2^-24 * rowsum|dO * O|, the standard bound). An error e in delta moves dS by -P * e, so dQ by
    up to scale * e * (P |K|) and dK by up to scale * P^T (e * |Q|). torch's SDPA has no delta: where P is
    one-hot (a padded query that sees only itself under causal-valid, exact dQ 0) its error is 0 while every flash
    implementation's is this, so the rule's baseline for dq and dk is the larger of the two (notes/attention.md
    "Tests")."""
    dO, D = do.double(), q64.shape[-1]
    e = ((dO * (out64.to(dtype).double() - out64)).sum(-1, keepdim=True).abs()
         + 2 * D * 2.0**-24 * (dO * out64).abs().sum(-1, keepdim=True))
    q, k = q64.detach(), k64.detach()
    probe = k.abs().requires_grad_()  # the reference with |K| as the values gives P |K|; its vjp gives P^T X
    pk = reference(q, k, probe, None, False, False, mask=mask)
    (pt,) = torch.autograd.grad(pk, probe, e * q.abs())
    scale = D ** -0.5
    return float((scale * e * pk.detach()).max()), float((scale * pt).max())


def interpret_triton(monkeypatch):
    if CUDA:
        pytest.skip("triton: on a GPU test_gpu_accuracy checks the compiled kernels")
    problem = dispatch.package_problem("triton") or triton_interpreter_problem()
    if problem:
        pytest.fail(f"triton: {problem}: the Triton attention kernels cannot be checked on this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test
