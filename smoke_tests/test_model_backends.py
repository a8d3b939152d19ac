"""The models on our kernels: the Triton backend of the norms (RMSNorm and LayerNorm) and of the
embedding-bag mean gives the torch backend's logits (and so its loss), before and after one training
step, on CPU under Triton's interpreter.

Attention stays on torch here: the model runs in fp32, which flash_attention computes in bf16, and the
interpreter cannot run bf16 (numpy has no bf16); the attention kernels are checked in fp16 under the
interpreter by accuracy_tests/test_attention.py and the model-level routing on the H200 by
perf_tests/test_models.py (its check before timing)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pcvr_lib.kernels import dispatch
from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.models import model_names
from pcvr_lib.models.step import ModelStep
from pcvr_lib.train import TrainError, add_backend_arguments, backend_overrides
from pcvr_lib.workloads.models import demo_schema, random_batch

TINY = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}


def _logits(name, schema, batch, **backends):
    """Logits before and after one training step (the loss a step sees is their BCE: logits are the
    stricter check, a loss averages small differences away)."""
    step = ModelStep(name, schema, batch, "torch", config={**TINY, **backends})
    before = step.infer()
    torch.manual_seed(1)  # the same dropout draws on every backend
    step.train_step()
    return before, step.infer()


@pytest.mark.parametrize("name", model_names())
def test_triton_norms_and_embedding_give_the_torch_loss(name, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter check; on a GPU perf_tests/test_models.py checks every backend")
    if dispatch.package_problem("triton"):
        pytest.skip(f"triton: {dispatch.package_problem('triton')}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test
    schema = demo_schema(max_len=6)
    batch = random_batch(schema, batch=2, seed=3)
    expected = _logits(name, schema, batch)
    actual = _logits(name, schema, batch, rms_norm_backend="triton", embedding_backend="triton")
    for what, a, e in zip(("initial logits", "logits after one step"), actual, expected, strict=True):
        assert_close(a, e, torch.float32, what=f"{name} {what}, triton vs torch")


def test_backend_flags_set_the_model_options_and_refuse_a_contradiction():
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    args = parser.parse_args(["--attention-backend", "triton", "--embedding-backend", "tilelang"])
    assert backend_overrides(args, {"d_model": 32}) == {
        "d_model": 32, "attention_backend": "triton", "embedding_backend": "tilelang"}
    assert backend_overrides(args, {"attention_backend": "triton"})["attention_backend"] == "triton"
    with pytest.raises(TrainError, match="--attention-backend triton contradicts --model-config's"):
        backend_overrides(args, {"attention_backend": "torch"})
    with pytest.raises(SystemExit):
        parser.parse_args(["--rms-norm-backend", "cuda"])


def test_models_report_view_compares_the_fastest_backend_with_torch():
    from pcvr_lib.report import models_view

    def case(backend, per_call_us, device_us, torch_ops=(), mode=None, precision=None):
        axis = f",mode={mode}" if mode else ""  # files from before the mode axis name no mode: eager
        at = f",precision={precision}" if precision else ""  # fp32 ids name no precision
        return {"name": f"test_model[model=tokenformer,backend={backend}{axis},phase=train_step{at}]",
                "stats": {"median": device_us * 1e-6},
                "extra_info": {"stat": "device", "per_call_us": per_call_us, "device_us": device_us,
                               "torch_ops": list(torch_ops)}}

    text = models_view({"benchmarks": [case("torch", 1200.0, 900.0), case("triton", 1000.0, 700.0, ["attention"]),
                                       case("tilelang", 800.0, 750.0, ["attention"])]})
    row = next(line for line in text.splitlines() if line.startswith("tokenformer"))
    assert "1200 [900]" in row and "800 [750]" in row and "1.50x (tilelang/eager)" in row
    assert row.rstrip().endswith("attention")
    # with the mode axis: the fastest of ours in any mode, against eager torch and against torch.compile of torch
    text = models_view({"benchmarks": [case("torch", 1200.0, 900.0, mode="eager"),
                                       case("torch", 900.0, 800.0, mode="compile"),
                                       case("triton", 1000.0, 700.0, mode="eager"),
                                       case("triton", 600.0, 550.0, mode="graph")]})
    header, row = text.splitlines()[0], next(line for line in text.splitlines() if line.startswith("tokenformer"))
    assert "torch compile us [device]" in header and "triton graph us [device]" in header
    assert "tilelang" not in header  # only the columns the file holds
    assert "2.00x (triton/graph)" in row and "1.50x (triton/graph)" in row
    # a bf16 case is a row of its own, set against torch at bf16 only
    text = models_view({"benchmarks": [case("torch", 1200.0, 900.0, mode="eager"),
                                       case("triton", 1000.0, 700.0, mode="eager"),
                                       case("torch", 600.0, 400.0, mode="eager", precision="bf16"),
                                       case("triton", 400.0, 300.0, mode="eager", precision="bf16")]})
    rows = [line for line in text.splitlines() if line.startswith("tokenformer")]
    fp32, bf16 = (next(row for row in rows if ("train_step bf16" in row) == at) for at in (False, True))
    assert "1200 [900]" in fp32 and "1.20x (triton/eager)" in fp32
    assert "600 [400]" in bf16 and "1.50x (triton/eager)" in bf16


def _kernel_and_torch(monkeypatch, **args):
    """kernel_ops.attention on the Triton kernels (interpreter, fp16) and on torch (fp32 of the same inputs)."""
    from pcvr_lib.models.kernel_ops import attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    sq = args.pop("sq", 20)
    q = torch.randn(2, 2, sq, 16, generator=gen).half()
    k, v = (torch.randn(2, 2, 20, 16, generator=gen).half() for _ in range(2))
    torch_args = {key: value for key, value in args.items() if key != "role_mask"}
    if "role_mask" in args:
        rm = args["role_mask"]
        allowed = rm.visibility[rm.roles[:, :, None], rm.roles[:, None, :]] & rm.key_valid[:, None, :]
        torch_args["mask"] = (allowed | torch.eye(20, dtype=torch.bool))[:, None]
    ours = attention(q, k, v, backend="triton", **args)
    expected = attention(q.float(), k.float(), v.float(), **torch_args)
    return ours, expected


LENGTHS = torch.tensor([20, 7])


@pytest.mark.parametrize("case", ["key_lengths_cross", "causal", "window_global_last", "causal_global_last",
                                  "roles"])
def test_attention_call_sites_on_the_kernels_match_torch(case, monkeypatch):
    """Each mask the models pass (baseline/queryformer/dualq cross, onetrans, tokenformer's two kinds of
    block, symbiosis' roles) gives torch's output on valid queries through the Triton kernels (fp16 under
    the interpreter: the models' fp32 calls run in bf16, which the interpreter cannot)."""
    if torch.cuda.is_available() or dispatch.package_problem("triton"):
        pytest.skip("CPU interpreter check")
    from pcvr_lib.kernels.attention import role_mask

    args = {
        "key_lengths_cross": {"sq": 3, "key_lengths": LENGTHS},
        "causal": {"key_lengths": LENGTHS, "causal": True},
        "window_global_last": {"key_lengths": LENGTHS, "causal": True, "window": 5, "global_last": True},
        "causal_global_last": {"key_lengths": LENGTHS, "causal": True, "global_last": True},
        "roles": {"role_mask": role_mask(
            torch.tensor([0, 0, 1, 1, 2] * 4).expand(2, -1), torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1]]).bool(),
            torch.arange(20)[None] < LENGTHS[:, None])},
    }[case]
    ours, expected = _kernel_and_torch(monkeypatch, **args)
    if case in ("causal", "window_global_last", "causal_global_last"):  # padded queries are unspecified
        for b, n in enumerate(LENGTHS.tolist()):
            assert_close(ours[b, :, :n], expected[b, :, :n], torch.float16, what=f"{case} row {b}")
    else:
        assert_close(ours, expected, torch.float16, what=case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["additive_mask", "causal"])
def test_torch_attention_under_cpu_autocast_matches_fp64(case, dtype):
    """The torch backend's attention under bf16 autocast on a CPU (where it computes in fp32): bf16 inputs give
    a bf16 output and gradients within bf16's tolerance of the fp64 result; fp32 inputs stay fp32 (autocast
    would have lowered them to bf16) within fp32's tolerance."""
    from pcvr_lib.models.kernel_ops import additive_mask, attention, attention_mask

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 20, 16, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(2, 2, 20, 16, generator=gen).to(dtype)
    mask = None
    if case == "additive_mask":
        mask = additive_mask(attention_mask(2, 20, 20, q.device, LENGTHS, False, None, None))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, mask=mask, causal=case == "causal")
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = attention(q64, k64, v64, mask=None if mask is None else mask.double(), causal=case == "causal")
    expected.backward(grad.double())
    assert out.dtype == dtype and q.grad.dtype == dtype
    assert_close(out, expected, dtype, what=f"{case} output")
    for name, ours, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert_close(ours, ref, dtype, what=f"{case} {name}")


def test_torch_attention_off_the_cpu_casts_an_additive_mask_to_the_queries_dtype(monkeypatch):
    """Off the CPU (here the meta device, as a GPU call takes the same path) half-precision queries run SDPA in
    their own dtype, with the additive mask cast to it."""
    import torch.nn.functional as F

    from pcvr_lib.models.kernel_ops import attention

    seen = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, attn_mask=None, **kw: seen.append((q.dtype, attn_mask.dtype)) or q)
    q, k, v = (torch.empty(2, 2, 20, 16, dtype=torch.bfloat16, device="meta") for _ in range(3))
    out = attention(q, k, v, mask=torch.zeros(2, 1, 20, 20, device="meta"))
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.bfloat16


def _attention_in_fp16(monkeypatch) -> None:
    """The models' fp32 attention computed in fp16 on the kernels (they compute it in bf16 on a GPU, which
    the interpreter cannot run)."""
    from pcvr_lib import kernels

    original = kernels.flash_attention
    monkeypatch.setattr(kernels, "flash_attention",
                        lambda q, k, v, **kw: original(q.half(), k.half(), v.half(), **kw).float())


def _sdpa_in_fp16(monkeypatch) -> None:
    """The torch backend's SDPA computed in fp16 (inputs and additive masks cast, output cast back)."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def lowered(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.half()
        return sdpa(q.half(), k.half(), v.half(), attn_mask=attn_mask, **kw).to(q.dtype)

    monkeypatch.setattr(F, "scaled_dot_product_attention", lowered)


@pytest.mark.parametrize("name", model_names())
def test_every_switch_on_triton_gives_the_torch_loss_by_the_benchmarks_rule(name, monkeypatch):
    """All three switches on the Triton kernels, attention included (fp16 under the interpreter), against
    the torch backend by perf_tests/test_models.py's rule: logits at init and after one step within twice
    torch's own error when its SDPA runs in the same precision (its own masks, so a routing bug of the
    kernels' path cannot widen the bound), plus one fp16 ulp of the largest logit. Fails when symbiosis
    sends its role mask without the key validity (checked by hand)."""
    if torch.cuda.is_available() or dispatch.package_problem("triton"):
        pytest.skip("CPU interpreter check")
    from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    schema = demo_schema(max_len=6)
    batch = random_batch(schema, batch=2, seed=3)
    # head size 32, dualq 48 (its d divides by its 6 queries; 48 runs padded to 64 in the kernels)
    tiny = {**TINY, "d_model": 96 if name == "dualq" else 64}
    expected = _one_step_logits(ModelStep(name, schema, batch, "torch", config=tiny))
    with monkeypatch.context() as m:
        _sdpa_in_fp16(m)
        own = _one_step_logits(ModelStep(name, schema, batch, "torch", config=tiny))
    _attention_in_fp16(monkeypatch)
    actual = _one_step_logits(ModelStep(name, schema, batch, "triton", config=tiny))
    for what, a, o, e in zip(("logits at init", "logits after one step"), actual, own, expected, strict=True):
        e = e.double()
        flash_rule(a, e, max_abs_error(o, e), torch.float16, what=f"{name} {what}, every switch on triton")


@pytest.mark.parametrize("name", model_names())
def test_the_norm_and_embedding_kernels_under_bf16_autocast_give_the_torch_loss(name, monkeypatch):
    """Under bf16 autocast (`pcvr train --amp`, the benchmark's bf16 cases) a norm's input may be bf16 beside
    its fp32 parameters; the kernels take one dtype, so the models hand them the parameters in the input's.
    The norms and the embedding on the Triton kernels (interpreter; attention on torch, which the interpreter
    cannot run in bf16) against the torch backend's fp32 step, by the benchmark's rule with the bound from
    the torch backend under the same autocast. Fails with the parameters passed uncast (a dtype error)."""
    if torch.cuda.is_available() or dispatch.package_problem("triton"):
        pytest.skip("CPU interpreter check")
    from pcvr_lib.kernels.tolerance import flash_rule, max_abs_error

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    schema = demo_schema(max_len=6)
    batch = random_batch(schema, batch=2, seed=3)
    switches = {**TINY, "rms_norm_backend": "triton", "embedding_backend": "triton"}
    expected = _one_step_logits(ModelStep(name, schema, batch, "torch", config=TINY))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = _one_step_logits(ModelStep(name, schema, batch, "torch", config=TINY))
        actual = _one_step_logits(ModelStep(name, schema, batch, "torch", config=switches))
    for what, a, o, e in zip(("logits at init", "logits after one step"), actual, own, expected, strict=True):
        e = e.double()
        assert a.dtype == o.dtype, f"{name} {what}: {a.dtype} on the kernels, {o.dtype} on torch under autocast"
        flash_rule(a, e, max_abs_error(o, e), torch.bfloat16, what=f"{name} {what} under bf16 autocast, kernels")


def test_kernel_attention_gets_one_dtype_from_mixed_inputs(monkeypatch):
    """Under autocast a projection may come out bf16 beside an fp32 tensor; the kernels take one dtype, so
    the models hand them q, k and v promoted to the widest (fp32 here), and unchanged when they agree."""
    from pcvr_lib import kernels
    from pcvr_lib.models.kernel_ops import attention

    seen = []
    monkeypatch.setattr(kernels, "flash_attention", lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or q)
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 4, 16)
    assert attention(q, kv, kv, backend="triton").dtype == torch.float32
    attention(q, q, q, backend="triton")
    assert seen == [(torch.float32,) * 3, (torch.bfloat16,) * 3]


def _one_step_logits(step: ModelStep):
    before = step.infer()
    torch.manual_seed(1)  # the same dropout draws on every backend
    step.train_step()
    return before, step.infer()


def test_role_attention_masks_pack_what_the_kernels_role_mask_packs():
    """Symbiosis' per-batch role mask (static layout packed once, key validity added per batch) equals what
    kernels.attention.role_mask builds from the same inputs (the one that checks the role ids)."""
    from pcvr_lib.kernels.attention import role_mask
    from pcvr_lib.models.kernel_ops import role_attention_masks, static_role_words

    gen = torch.Generator().manual_seed(3)
    roles = torch.randint(0, 5, (23,), generator=gen)
    visibility = torch.rand(5, 5, generator=gen) < 0.5
    key_valid = torch.rand(4, 23, generator=gen) < 0.7
    pairs = visibility[roles][:, roles]
    ours = role_attention_masks(roles, visibility, pairs, key_valid, "triton", torch.float32,
                                static_role_words(roles, visibility))["role_mask"]
    theirs = role_mask(roles.expand(4, -1), visibility, key_valid)
    for name in ("codes", "words", "roles", "visibility", "key_valid"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.codes.dtype == theirs.codes.dtype and ours.codes.is_contiguous()
