"""flash_attention accuracy: every backend against an fp64 reference, with the flash-attention rule.

Rule (as flash-attention's own tests): for the output and each gradient, our max error against the fp64
reference must be at most 2x the error torch (SDPA, the torch backend) makes in the same dtype, plus one
ulp of the dtype at the reference's largest magnitude (the rounding of the result itself). For dq and dk the
baseline is the larger of torch's error and the error any flash backward makes in exact arithmetic from keeping
O in the dtype (flash_delta_error: delta = rowsum(dO * O)), which decides where a query sees only itself. NaN never
passes. Every mask mode, rows with no key, Sq != Skv, odd lengths, and dropout against a reference using
the same keep mask (for dropout, "torch" is the torch backend's explicit path in the same dtype).

CPU (CI): the torch backend, Triton under its interpreter (TRITON_INTERPRET=1 set per test with monkeypatch,
never leaked), TileLang lowered and compiled for sm_90a (forward and backward). GPU: everything, outputs
poisoned first. Cases, inputs and the fp64 reference come from pcvr_lib.workloads.attention; the rule
is tolerance.flash_rule.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accuracy_tests.attention_checks import (
    CUDA,
    DT,
    MODES,
    check_case,
    inputs,
    interpret_triton,
    mask_kwargs,
)
from pcvr_lib.kernels import dispatch, flash_attention, key_lengths_from_mask
from pcvr_lib.kernels.attention import allowed_mask, dropout_keep_mask, role_mask
from pcvr_lib.kernels.attention.reference import reference
from pcvr_lib.kernels.testing import poisoned_outputs
from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.workloads import attention as workload

# ----------------------------------------------------------------------------------------------- helpers


def test_key_lengths_from_mask():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    assert key_lengths_from_mask(mask).tolist() == [2, 0, 3]
    assert key_lengths_from_mask(mask).dtype == torch.int32
    with pytest.raises(ValueError, match="row 1 .*not prefix-valid"):
        key_lengths_from_mask(torch.tensor([[True, False], [False, True]]))
    with pytest.raises(TypeError, match="boolean"):
        key_lengths_from_mask(mask.int())
    with pytest.raises(ValueError, match=r"shape \(B, S\)"):
        key_lengths_from_mask(mask[0])


def test_mask_definitions():
    kl = torch.tensor([2])
    cv = allowed_mask(1, 4, 4, kl, False, True, "cpu")[0, 0].int().tolist()
    # valid queries 0, 1 see the valid past; padded queries 2, 3 see only themselves
    assert cv == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    causal_kl = allowed_mask(1, 4, 4, kl, True, False, "cpu")[0, 0].int().tolist()
    assert causal_kl == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    # Sq != Skv: top-left aligned causal mask, like SDPA's is_causal
    assert allowed_mask(1, 2, 3, None, True, False, "cpu")[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0]]


def test_window_mask_definition():
    # L = 5 of 6: window 2 for valid rows, the last valid query (4) sees every valid key, padded 5 itself
    w = allowed_mask(1, 6, 6, torch.tensor([5]), False, False, "cpu", window=2, n_global=1)[0, 0]
    assert w.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                                [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    # two global queries without key lengths: query 2 also sees key 3 (after it)
    g = allowed_mask(1, 4, 4, None, False, False, "cpu", window=1, n_global=2)[0, 0]
    assert g.int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def test_role_mask_definition_and_checks():
    vis = torch.tensor([[True, False], [True, True]])  # role 0 sees role 0 only, role 1 sees both
    rm = role_mask(torch.tensor([[0, 1, 1, 0]]), vis, torch.tensor([[True, True, False, True]]))
    m = allowed_mask(1, 4, 4, None, False, False, "cpu", roles=rm.roles, role_visibility=rm.visibility,
                     key_valid=rm.key_valid)[0, 0]
    # key 2 is padding: seen only by itself (the diagonal)
    assert m.int().tolist() == [[1, 0, 0, 1], [1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 0, 1]]
    assert rm.codes.tolist() == [[0, 1, 33, 0]] and rm.words[:2].tolist() == [1, 3] and not rm.words[2:].any()
    with pytest.raises(ValueError, match=r"role ids must be in \[0, 2\)"):
        role_mask(torch.tensor([[0, 2]]), vis)
    with pytest.raises(ValueError, match="square bool"):
        role_mask(torch.tensor([[0, 1]]), vis.int())
    with pytest.raises(ValueError, match="at most 16 roles"):
        role_mask(torch.tensor([[0, 1]]), torch.ones(17, 17, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_valid must be a bool tensor"):
        role_mask(torch.tensor([[0, 1]]), vis, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"integer tensor of shape \(B, S\)"):
        role_mask(torch.tensor([0, 1]), vis)


def test_dropout_keep_mask_rate_and_seed():
    a = dropout_keep_mask(123, 2, 3, 64, 64, 0.3)
    assert torch.equal(a, dropout_keep_mask(123, 2, 3, 64, 64, 0.3))
    assert not torch.equal(a, dropout_keep_mask(124, 2, 3, 64, 64, 0.3))
    assert abs(a.float().mean().item() - 0.7) < 0.02
    assert not torch.equal(a[0, 0], a[0, 1]), "heads must draw different masks"


def test_errors():
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="unknown backend"):
        flash_attention(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="head dim 40"):
        x = torch.randn(1, 2, 8, 40, dtype=torch.float16)
        flash_attention(x, x, x)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        flash_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="global_queries=1 needs a window"):
        flash_attention(q, q, q, global_queries=1)
    rm = role_mask(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not pass key_lengths"):
        flash_attention(q, q, q, role_mask=rm, key_lengths=torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="self-attention"):
        flash_attention(q, q[:, :, :4], q[:, :, :4], role_mask=rm)
    with pytest.raises(ValueError, match="cannot be combined"):
        flash_attention(q, q, q, role_mask=rm, window=3)
    with pytest.raises(TypeError, match="role_mask must come from role_mask"):
        flash_attention(q, q, q, role_mask=torch.zeros(1, 8))
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, q.float(), q)
    with pytest.raises(ValueError, match="shapes do not match"):
        flash_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(TypeError, match="key_lengths must be integer"):
        flash_attention(q, q, q, key_lengths=torch.ones(1))
    with pytest.raises(ValueError, match=r"key_lengths must be a tensor of shape \(1,\)"):
        flash_attention(q, q, q, key_lengths=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attention(q, q, q, dropout_p=1.0, training=True)
    if not dispatch.triton_interpret_enabled():
        with pytest.raises(RuntimeError, match="requires CUDA tensors"):
            flash_attention(q, q, q, backend="triton")
        with pytest.raises(RuntimeError, match="requires CUDA tensors"):
            flash_attention(q, q, q, backend="tilelang")


@pytest.mark.parametrize("backend", ["torch", "triton", "tilelang"])
def test_empty_sequences_give_zeros(backend):
    device = "cpu"
    if backend != "torch":
        if not CUDA:
            pytest.skip(f"{backend}: no CUDA device")
        device = "cuda"
    q = torch.randn(2, 2, 5, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 0, 32, dtype=torch.float16, device=device, requires_grad=True)
    out = flash_attention(q, k, k, backend=backend)
    assert out.shape == q.shape and not out.any()
    out.sum().backward()
    assert not q.grad.any()
    empty_q = torch.randn(2, 2, 0, 32, dtype=torch.float16, device=device)
    assert flash_attention(empty_q, q.detach(), q.detach(), backend=backend).shape == (2, 2, 0, 32)


def test_fp32_inputs_run_in_bf16_and_return_fp32():
    q, k, v, _ = inputs(2, 2, 9, 11, 32, torch.float32, seed=3)
    kl = torch.tensor([4, 11], dtype=torch.int32)
    out = flash_attention(q, k, v, key_lengths=kl)
    assert out.dtype == torch.float32
    expected = flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_lengths=kl).float()
    assert torch.equal(out, expected)


def test_dropout_only_in_training_and_reproducible():
    q, k, v, _ = inputs(1, 2, 16, 16, 32, torch.float32, seed=4)
    plain = flash_attention(q, k, v)
    assert torch.equal(flash_attention(q, k, v, dropout_p=0.5, training=False), plain)
    a = flash_attention(q, k, v, dropout_p=0.5, training=True, generator=torch.Generator().manual_seed(9))
    b = flash_attention(q, k, v, dropout_p=0.5, training=True, generator=torch.Generator().manual_seed(9))
    c = flash_attention(q, k, v, dropout_p=0.5, training=True, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------------------- torch backend


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_torch_backend_cpu(mode, dtype):
    """The baseline itself: SDPA with the equivalent mask stays within the tolerance table of fp64."""
    from pcvr_lib.kernels.tolerance import assert_close

    use_kl, causal, causal_valid = MODES[mode]
    q, k, v, _ = inputs(5, 2, 13, 19, 32, DT[dtype], seed=1)
    kl = workload.key_lengths(5, 19) if use_kl else None
    out = flash_attention(q, k, v, key_lengths=kl, causal=causal, causal_valid=causal_valid, backend="torch")
    ref = reference(q.double(), k.double(), v.double(), kl, causal, causal_valid)
    assert_close(out, ref, DT[dtype], what=f"torch {mode}")
    if use_kl and not causal_valid:  # (causal-valid: a padded query sees itself, so no row is empty here)
        assert torch.equal(out[0], torch.zeros_like(out[0])), "a row with no key must be zeros"


@pytest.mark.parametrize("mode", list(workload.STRUCTURED))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_torch_backend_structured_masks_cpu(mode, dtype):
    """The torch backend (SDPA with the equivalent boolean mask) for the window and roles masks."""
    from pcvr_lib.kernels.tolerance import assert_close

    q, k, v, _ = inputs(5, 2, 23, 23, 16, DT[dtype], seed=2)
    kw, mask = mask_kwargs(mode, 5, 23, 23)
    out = flash_attention(q, k, v, backend="torch", **kw)
    ref = reference(q.double(), k.double(), v.double(), None, False, False, mask=mask)
    assert_close(out, ref, DT[dtype], what=f"torch {mode}")


# --------------------------------------------------------------------------------- triton (interpreter)

INTERP_SHAPES = [(5, 2, 17, 17, 32), (5, 1, 33, 70, 64), (5, 1, 70, 33, 32)]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", INTERP_SHAPES, ids=lambda s: "B{}xH{}xSq{}xSkv{}xD{}".format(*s))
def test_triton_interpreter_case(shape, mode, p, monkeypatch):
    """The Triton kernels under Triton's interpreter on CPU tensors (the shared launcher interprets them)."""
    interpret_triton(monkeypatch)
    check_case("triton", *shape, torch.float16, mode, p=p, device="cpu")


# head dims 16 and 48 (padded to 64) in every mode; the structured masks (window + global queries, roles)
# across several key tiles, Sq == Skv (they are self-attention masks), with dropout once each
NEW_CASES = (
    [(5, 2, 37, 37, d, mode, 0.0) for d in (16, 48) for mode in (*MODES, *workload.STRUCTURED)]
    + [(5, 1, 130, 130, d, mode, 0.0) for d in (16, 32) for mode in workload.STRUCTURED]
    + [(3, 2, 110, 110, 32, "roles", 0.0), (5, 2, 70, 70, 64, "window", 0.0), (5, 2, 70, 70, 128, "roles", 0.0)]
    + [(5, 1, 45, 45, 16, mode, 0.3) for mode in workload.STRUCTURED]
    # head dim 16 in bucket 1 (its own dK/dV tile, 128 x 128, tuned on the H200) in every mode, a tail, dropout
    + [(3, 2, 200, 200, 16, mode, 0.0) for mode in MODES]
    + [(3, 2, 257, 300, 16, "key_lengths", 0.2), (3, 2, 300, 300, 16, "causal_valid", 0.2)]
)


@pytest.mark.parametrize("case", NEW_CASES, ids=lambda c: "B{}xH{}xSq{}xSkv{}xD{}-{}-p{}".format(*c))
def test_triton_interpreter_head_dims_and_masks(case, monkeypatch):
    interpret_triton(monkeypatch)
    B, H, Sq, Skv, D, mode, p = case
    check_case("triton", B, H, Sq, Skv, D, torch.float16, mode, p=p, device="cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 4), H=st.integers(1, 2), S=st.integers(1, 150), D=st.sampled_from([16, 32, 48, 64]),
       mode=st.sampled_from(["causal_valid", "key_lengths", *workload.STRUCTURED]), seed=st.integers(0, 99))
def test_triton_interpreter_odd_shapes(B, H, S, D, mode, seed, monkeypatch):
    """Odd self-attention shapes (hypothesis): lengths around the tile edges, every head size, the masks (B 1
    included: batch row 0 has key length 0, all queries padding under causal-valid; see flash_delta_error)."""
    interpret_triton(monkeypatch)
    check_case("triton", B, H, S, S, D, torch.float16, mode, device="cpu", seed=seed)


# The one-tile backward (config.TRITON_BWD_ONE_TILE_CONFIGS) routed: every mask, dropout, Sq != Skv where the mask
# allows it, every head dim, lengths at and inside the tile's edge (the cases above run the two-kernel backward).
ONE_TILE_CASES = (
    [(3, 2, 33, 47, 32, mode, p) for mode in MODES for p in (0.0, 0.3)]
    + [(3, 2, 45, 45, 16, mode, p) for mode in workload.STRUCTURED for p in (0.0, 0.3)]
    + [(5, 2, 17, 17, 48, "causal_valid", 0.0), (3, 1, 128, 128, 64, "key_lengths", 0.0),
       (2, 1, 70, 128, 128, "causal", 0.3), (3, 2, 110, 110, 32, "roles", 0.0), (3, 1, 100, 100, 16, "window", 0.0)]
)


@pytest.mark.parametrize("case", ONE_TILE_CASES, ids=lambda c: "B{}xH{}xSq{}xSkv{}xD{}-{}-p{}".format(*c))
def test_triton_interpreter_one_tile_backward(case, monkeypatch, one_tile_routed):
    interpret_triton(monkeypatch)
    B, H, Sq, Skv, D, mode, p = case
    check_case("triton", B, H, Sq, Skv, D, torch.float16, mode, p=p, device="cpu")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 4), H=st.integers(1, 2), Sq=st.integers(1, 128), Skv=st.integers(1, 128),
       D=st.sampled_from([16, 32, 48, 64, 128]), mode=st.sampled_from([*MODES, *workload.STRUCTURED]),
       p=st.sampled_from([0.0, 0.25]), seed=st.integers(0, 99))
def test_triton_interpreter_one_tile_odd_shapes(B, H, Sq, Skv, D, mode, p, seed, monkeypatch, one_tile_routed):
    """Odd one-tile shapes (hypothesis), routed: every head dim and mask, Sq != Skv where the mask allows it."""
    interpret_triton(monkeypatch)
    if mode in ("causal_valid", *workload.STRUCTURED):
        Skv = Sq  # self-attention masks
    check_case("triton", B, H, Sq, Skv, D, torch.float16, mode, p=p, device="cpu", seed=seed)


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "default"])
@pytest.mark.parametrize("Sq,Skv,D,expected", [
    (100, 100, 32, ["fwd", "bwd_one_tile"]), (128, 128, 64, ["fwd", "bwd_one_tile"]),
    (70, 128, 128, ["fwd", "bwd_one_tile"]), (1, 17, 16, ["fwd", "bwd_one_tile"]),
    (100, 129, 32, ["fwd", "bwd_dq", "bwd_dkdv"]), (129, 100, 64, ["fwd", "bwd_dq", "bwd_dkdv"]),
    (129, 129, 128, ["fwd", "bwd_dq", "bwd_dkdv"]),
])
def test_triton_backward_routing(Sq, Skv, D, expected, routed, monkeypatch, request, launched_kernels):
    """Which kernels one forward + backward launches: routed, the one-tile backward where Sq and Skv fit the head
    dim's BLOCK_M (128), the two-kernel one past it; by default (config.TRITON_ONE_TILE_DEFAULT_DIMS) as set."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention.config import TRITON_BWD_ONE_TILE_CONFIGS, TRITON_ONE_TILE_DEFAULT_DIMS

    block = TRITON_BWD_ONE_TILE_CONFIGS[D][0]
    assert (expected[1] == "bwd_one_tile") == (Sq <= block and Skv <= block), "the case list disagrees with config"
    if routed:
        request.getfixturevalue("one_tile_routed")
    elif D not in TRITON_ONE_TILE_DEFAULT_DIMS:
        expected = ["fwd", "bwd_dq", "bwd_dkdv"]
    launched = launched_kernels
    q, k, v, do = inputs(1, 1, Sq, Skv, D, torch.float16, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    length = min(Skv, 20)  # keys from 20 on are padding: whole key tiles nobody sees (zero dK/dV, never computed)
    with poisoned_outputs("cpu"):  # new tensors start as NaN: an unwritten gradient shows
        out = flash_attention(q, k, v, key_lengths=torch.tensor([length], dtype=torch.int32), backend="triton")
        out.backward(do)
    assert launched == expected
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), "a gradient was left unwritten"
    assert not k.grad[:, :, length:].any() and not v.grad[:, :, length:].any(), "padding keys got gradients"


@pytest.mark.parametrize("D", [32, 128])
def test_triton_one_tile_sweep_configs_interpreter(D, monkeypatch):
    """The sweep's one-tile candidates (workload.TRITON_ONE_TILE) give the default config's gradients (dropout and key
    lengths, S 60 so that the BLOCK_M 64 candidates run too); a config the shape does not fit is refused."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention import triton_impl

    q, k, v, do = inputs(2, 2, 60, 60, D, torch.float16, seed=8)
    kl = torch.tensor([60, 23], dtype=torch.int32)
    scale = D ** -0.5
    o, lse = triton_impl.forward(q, k, v, kl, "causal_valid", scale, 77, 0.2, True)
    ref = triton_impl.backward(do, q, k, v, o, lse, kl, "causal_valid", scale, 77, 0.2)
    for cfg in workload.TRITON_ONE_TILE[D]:
        got = triton_impl.backward(do, q, k, v, o, lse, kl, "causal_valid", scale, 77, 0.2, one_tile_config=cfg)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref, strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=2e-3), f"{cfg}: {name} differs from the default's"
    with pytest.raises(ValueError, match="one_tile_config"):
        triton_impl.backward(do, q, k, v, o, lse, kl, "causal_valid", scale, 77, 0.2, one_tile_config=(32, 32, 4, 1))


@pytest.mark.parametrize("mask", ["none", "key_lengths", "window", "roles"])
def test_tune_mask_args_are_the_operators_masks(mask, monkeypatch):
    """`tune --mask` times the kernels under the mask the operator builds from the same keyword arguments
    (workload.key_lengths, tokenformer's window with one global query, symbiosis' roles): its kernel-level call gives
    flash_attention's output bit for bit (interpreter; S 96 > the window of 64, so the window cuts)."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention import triton_impl
    from pcvr_lib.tune import attention as tune

    B, H, S, D = 3, 2, 96, 16
    q, k, v, _ = inputs(B, H, S, S, D, torch.float16, seed=5)
    kl, mode, structured = tune.mask_args(mask, B, S, q.device)
    got = triton_impl.forward(q, k, v, kl, mode, D ** -0.5, 0, 0.0, False, structured=structured)[0]
    if mask == "roles":
        kw = workload.structured_mask("roles", B, S)
    else:
        kw = {} if mask == "none" else {"key_lengths": workload.key_lengths(B, S)}
        if mask == "window":
            kw.update(window=workload.PERF_WINDOW, global_queries=1)
    expected = flash_attention(q, k, v, backend="triton", **kw)
    assert torch.equal(got, expected), f"{mask}: the sweep's mask is not the operator's"
    with pytest.raises(ValueError, match="--mask"):
        tune.mask_args("causal", B, S, q.device)


@pytest.mark.parametrize("D,mode,has_kl,dropout", [(16, "window", True, True), (32, "roles", False, True),
                                                  (64, "key_lengths", True, False), (128, "causal_valid", True, True)])
def test_triton_one_tile_backward_compiles_for_sm90(D, mode, has_kl, dropout):
    """The one-tile backward builds for sm_90 at every head size with the models' masks and uses wgmma."""
    problem = dispatch.package_problem("triton")
    if problem:
        pytest.skip(f"triton: {problem}")
    from pcvr_lib.kernels.attention import triton_impl

    kernel = triton_impl.compile_for(90, "one_tile", D, "bf16", mode, has_kl=has_kl, dropout=dropout)
    assert len(kernel.asm["cubin"]) > 0
    assert "wgmma.mma_async" in kernel.asm["ptx"], f"one_tile {mode} D{D}: no Hopper wgmma in the PTX"


# the long bucket (Sq > 512): triton_long's forward and one-kernel-per-key-tile backward (dQ by atomics)
LONG_CASES = [(2, 1, 600, 600, 64, "causal_valid", 0.0), (2, 1, 520, 530, 64, "none", 0.0),
              (2, 1, 530, 515, 64, "causal", 0.3), (1, 2, 513, 700, 128, "key_lengths", 0.0),
              (2, 1, 540, 540, 64, "causal_kl", 0.0), (2, 1, 640, 560, 64, "causal_valid", 0.3)]


@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: "B{}xH{}xSq{}xSkv{}xD{}-{}-p{}".format(*c))
def test_triton_long_interpreter_case(case, monkeypatch):
    interpret_triton(monkeypatch)
    B, H, Sq, Skv, D, mode, p = case
    check_case("triton", B, H, Sq, Skv, D, torch.float16, mode, p=p, device="cpu")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 3), Sq=st.integers(513, 700), Skv=st.integers(513, 700), D=st.sampled_from([64, 128]),
       mode=st.sampled_from(list(MODES)), p=st.sampled_from([0.0, 0.2]), seed=st.integers(0, 99))
def test_triton_long_interpreter_odd_shapes(B, Sq, Skv, D, mode, p, seed, monkeypatch):
    """Odd long shapes (hypothesis): every mask of the long kernels, Sq != Skv, dropout, B 1 included (batch row
    0 has key length 0: under causal-valid its padded queries see only themselves; see flash_delta_error)."""
    interpret_triton(monkeypatch)
    if mode == "causal_valid":
        Skv = Sq  # causal-valid is a self-attention mask
    check_case("triton", B, 1, Sq, Skv, D, torch.float16, mode, p=p, device="cpu", seed=seed)


@pytest.mark.parametrize("config,bwd_config", [((128, 64, 8, 3, True, False), (32, 128, 4, 3, True)),
                                               ((64, 64, 4, 3, True, True), (64, 64, 4, 2, True))])
def test_triton_long_tma_configs_interpreter(config, bwd_config, monkeypatch):
    """The TMA-descriptor (and warp-specialised) configs of the sweep give the default configs' results, within
    fp16's tolerance: another tile order sums the scores in another order (numpy under the interpreter rounds
    those sums differently from machine to machine)."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention import triton_long

    q, k, v, do = inputs(2, 1, 600, 530, 64, torch.float16, 3)
    kl = torch.tensor([530, 301], dtype=torch.int32)
    for mode, lengths in (("key_lengths", kl), ("causal", None), ("causal_valid", kl)):
        o_ref, lse_ref = triton_long.forward(q, k, v, lengths, mode, 0.125, 0, 0.0, True)
        o, lse = triton_long.forward(q, k, v, lengths, mode, 0.125, 0, 0.0, True, config=config)
        assert_close(o, o_ref.double(), torch.float16, what=f"{mode} {config}: output against the default config's")
        assert torch.allclose(lse, lse_ref, rtol=0, atol=1e-5), f"{mode} {config}: LSE differs"
        g_ref = triton_long.backward(do, q, k, v, o_ref, lse_ref, lengths, mode, 0.125, 0, 0.0)
        g = triton_long.backward(do, q, k, v, o_ref, lse_ref, lengths, mode, 0.125, 0, 0.0, config=bwd_config)
        for name, a, b in zip(("dq", "dk", "dv"), g, g_ref, strict=True):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=2e-3), f"{mode} {bwd_config}: {name} differs"


def test_tune_long_sweep_under_interpreter(monkeypatch, tmp_path):
    """The H200 sweep's CPU path: every candidate checked (flash rule) before it is timed, JSON and summary."""
    interpret_triton(monkeypatch)
    import json

    from pcvr_lib.tune import attention_long as tune_long

    out = tmp_path / "attention_long.json"
    tune_long.main(["--device", "cpu", "--shapes", "1x1x520x64:causal", "--dtypes", "fp16", "--workers", "0",
                    "--max-candidates", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    kernels = {(r["direction"], r["kernel"]) for r in doc["rows"]}
    assert kernels == {("fwd", "long"), ("fwd", "old"), ("fwd+bwd", "long"), ("fwd+bwd", "old")}
    assert all(r["pass"] and r["us"] > 0 for r in doc["rows"]), doc["rows"]
    assert [s["passed"] for s in doc["summary"]] == ["1/1", "1/1"]


@pytest.mark.parametrize("which,config", [("fwd", None), ("fwd", (128, 64, 8, 3, True, False)),
                                          ("fwd", (128, 64, 8, 3, True, True)), ("bwd", None),
                                          ("bwd", (64, 128, 8, 2, True))])
def test_triton_long_compiles_for_sm90(which, config):
    """The long kernels build for sm_90 with wgmma; the TMA configs read through cp.async.bulk.tensor."""
    problem = dispatch.package_problem("triton")
    if problem:
        pytest.skip(f"triton: {problem}")
    from pcvr_lib.kernels.attention import triton_long

    kernel = triton_long.compile_for(90, which, 128 if config else 64, "bf16", "causal_valid", has_kl=True,
                                     dropout=True, config=config)
    assert "wgmma.mma_async" in kernel.asm["ptx"], f"{which} {config}: no Hopper wgmma in the PTX"
    if config and config[4]:
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"], f"{which} {config}: no TMA load in the PTX"


@pytest.mark.parametrize("which", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("mode,D", [("window", 16), ("roles", 32)])
def test_triton_structured_masks_compile_for_sm90(which, mode, D):
    """The window and roles kernels (models' head sizes) compile for sm_90 and use wgmma."""
    problem = dispatch.package_problem("triton")
    if problem:
        pytest.skip(f"triton: {problem}")
    from pcvr_lib.kernels.attention import triton_impl

    kernel = triton_impl.compile_for(90, which, D, "bf16", mode, has_kl=mode == "window", dropout=False)
    assert len(kernel.asm["cubin"]) > 0
    assert "wgmma.mma_async" in kernel.asm["ptx"], f"{which} {mode} D{D}: no Hopper wgmma in the PTX"


def test_triton_helpers_restored_after_an_interpreted_launch(monkeypatch):
    """The kernels call the @helper functions of triton_common, which call helpers of their own; an interpreted
    launch swaps all of them (kernel modules' and triton_common's namespaces) for interpreted twins and must
    put every JITFunction back, or a later sm_90 compile in this process would fail."""
    problem = dispatch.package_problem("triton")
    if problem:
        pytest.skip(f"triton: {problem}")
    from triton.runtime.jit import JITFunction

    from pcvr_lib.kernels.attention import triton_common, triton_impl, triton_long

    interpret_triton(monkeypatch)
    check_case("triton", 1, 1, 17, 17, 16, torch.float16, "window", p=0.3, device="cpu")
    names = [n for n, v in vars(triton_common).items() if hasattr(v, "fn") and not n.startswith("__")]
    assert {"_mix", "_rows", "_keys", "element_mask", "dropout_keep"} <= set(names)
    for module in (triton_common, triton_impl, triton_long):
        for name in names:
            if name in vars(module):
                assert isinstance(vars(module)[name], JITFunction), f"{module.__name__}.{name}"
    kernel = triton_impl.compile_for(90, "dkdv", 64, "bf16", "window", has_kl=True, dropout=True)
    assert "wgmma.mma_async" in kernel.asm["ptx"]


@pytest.mark.parametrize("which", ["fwd", "dq", "dkdv"])
def test_triton_compiles_for_sm90(which):
    """The compiled (not interpreted) kernels build for sm_90 without a GPU and use Hopper's wgmma."""
    problem = dispatch.package_problem("triton")
    if problem:
        pytest.skip(f"triton: {problem}")
    from pcvr_lib.kernels.attention import triton_impl

    kernel = triton_impl.compile_for(90, which, 64, "bf16", "causal_valid", has_kl=True, dropout=True)
    assert len(kernel.asm["cubin"]) > 0
    assert "wgmma.mma_async" in kernel.asm["ptx"], f"{which}: no Hopper wgmma in the PTX"


# ----------------------------------------------------------------------------- tilelang (compile only)


def _tilelang_sm90_compile_only():
    """These tests build kernels for sm_90a on machines without a GPU, and CI runs them on every commit. On a CUDA
    host they are skipped (the GPU cases compile the kernels the suites use for the device and check them
    numerically): on the H200 they were the suite's three longest tests, compiling beside the GPU cases."""
    if CUDA:
        pytest.skip("tilelang: a check for machines without a GPU (CI runs it); here the GPU cases compile and run")
    problem = dispatch.package_problem("tilelang")
    if problem:
        pytest.skip(f"tilelang: {problem}")
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("tilelang: nvcc not found (needed to compile for sm_90a)")


@pytest.mark.slow
def test_tilelang_compiles_for_sm90():
    """Forward and both backward kernels lower and compile (one nvcc call) for sm_90a without a GPU
    (causal-valid, key lengths, dropout variant)."""
    _tilelang_sm90_compile_only()
    from pcvr_lib.kernels.attention import tilelang_impl

    # bucket 1: the TMA + warp-specialised configuration of the long-sequence kernels
    sources = tilelang_impl.compile_only("sm_90a", D=64, dtype="bfloat16", mode=3, has_kl=True, dropout=True,
                                         bucket=1)
    assert sources["cubin_bytes"] > 0
    for which in ("fwd", "dq", "dkdv"):
        src = sources[which]
        assert "__global__" in src and "wgmma" in src, f"{which}: no Hopper matrix instructions"
        assert str(0x21F0AAAD) in src, f"{which}: the dropout hash is missing"


@pytest.mark.slow
@pytest.mark.parametrize("D,mode,has_kl,bucket", [(32, 5, False, 0), (16, 4, True, 1)], ids=["roles-D32", "window-D16"])
def test_tilelang_structured_masks_compile_for_sm90(D, mode, has_kl, bucket):
    """The roles (symbiosis' shape: bucket 0) and window (tokenformer's: bucket 1, TMA + warp-specialised)
    kernels lower and compile for sm_90a at the models' head sizes."""
    _tilelang_sm90_compile_only()
    from pcvr_lib.kernels.attention import tilelang_impl

    sources = tilelang_impl.compile_only("sm_90a", D=D, dtype="bfloat16", mode=mode, has_kl=has_kl, dropout=False,
                                         bucket=bucket)
    assert sources["cubin_bytes"] > 0
    for which in ("fwd", "dq", "dkdv"):
        assert "__global__" in sources[which], f"{which}: no kernel in the lowered source"
        if mode == 5:
            assert "VIS[" in sources[which], f"{which}: the role visibility words are not read"


@pytest.mark.slow
def test_tilelang_long_schedules_compile_for_sm90():
    """The long-sequence candidates (workload.TILELANG_*_LONG, first of each): the forward with the Hopper
    example's ordered pipeline and the fused backward (dK/dV per key block, dQ by atomics) lower and compile
    for sm_90a, here with causal-valid and key lengths (the fused one with dropout too; fa3 refuses it). D64 only: D128
    is the same code at other sizes (its unmasked candidates compile in the precompile manifest), and each
    of these costs about a minute of CI."""
    D = 64
    _tilelang_sm90_compile_only()
    from pcvr_lib.kernels.attention import tilelang_impl

    # fa3 refuses dropout (wrong on the H200): it compiles masked without; the fused backward with dropout
    fa3 = tilelang_impl.compile_only("sm_90a", D=D, dtype="bfloat16", mode=3, has_kl=True, dropout=False,
                                     fwd_config=workload.TILELANG_FWD_LONG[D][0],
                                     bwd_config=workload.TILELANG_BWD_LONG[D][0])
    fused = tilelang_impl.compile_only("sm_90a", D=D, dtype="bfloat16", mode=3, has_kl=True, dropout=True,
                                       fwd_config=(128, 128, 256, 2), bwd_config=workload.TILELANG_BWD_LONG[D][0])
    for sources in (fa3, fused):
        assert sources["cubin_bytes"] > 0
        assert set(sources) == {"fwd", "fused", "cubin_bytes"}
        for which in ("fwd", "fused"):
            assert "wgmma" in sources[which], f"{which}: no Hopper matrix instructions"
        assert "AtomicAdd" in sources["fused"], "fused: dQ is not accumulated with atomics"
    for which in ("fwd", "fused"):
        assert str(0x21F0AAAD) in fused[which], f"{which}: the dropout hash is missing"


def test_tilelang_fa3_schedule_refuses_dropout():
    """The fa3 forward schedule gave wrong output with dropout on the H200: it is refused, by name, at build."""
    pytest.importorskip("tilelang")
    from pcvr_lib.kernels.attention import tilelang_impl

    with pytest.raises(ValueError, match="'fa3' forward schedule is wrong with dropout"):
        tilelang_impl.fwd_program(64, "bfloat16", 3, True, True, 128, 128, 256, 2, schedule="fa3")
    tilelang_impl.fwd_program(64, "bfloat16", 3, True, False, 128, 128, 256, 2, schedule="fa3")  # builds


def test_precompile_runs_every_triton_variant_through_run_once():
    """`precompile --run-triton` calls workload.run_once(backend, *variant) for each Triton variant (without it
    every warm-up fails and the accuracy suite compiles in its tests)."""
    import inspect

    signature = inspect.signature(workload.run_once)
    variants = workload.variants("triton")
    assert variants
    for variant in variants:
        signature.bind("triton", *variant)


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "default"])
@pytest.mark.parametrize("mode,expected", [
    ("key_lengths", ["fwd", "fwd", "bwd_one_tile", "fwd", "fwd", "bwd_dq", "bwd_dkdv"]),
    ("roles", ["fwd", "fwd", "bwd_one_tile"]),
])
def test_precompile_warms_both_bucket0_backwards(mode, expected, routed, monkeypatch, request, launched_kernels):
    """`precompile --run-triton`'s warm-up of a bucket-0 variant (workload.run_once, under the interpreter here)
    launches the backward(s) the variant takes: routed, the one-tile backward and, where the mask allows Skv past
    its tile, the two-kernel one too; not routed (a head dim outside config.TRITON_ONE_TILE_DEFAULT_DIMS), the
    two-kernel one."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention import triton_impl

    if routed:
        request.getfixturevalue("one_tile_routed")
    elif 32 not in triton_impl.TRITON_ONE_TILE_DEFAULT_DIMS:
        expected = ["fwd", "fwd", "bwd_dq", "bwd_dkdv"]

    launched = launched_kernels
    workload.run_once("triton", 32, torch.float16, mode, True, 0, device="cpu")
    assert launched == expected


@pytest.mark.parametrize("mode,expected", [("window", (64, 64)), ("key_lengths", (128, 128))])
def test_triton_dkdv_tile_per_mask(mode, expected, monkeypatch):
    """The dK/dV tile of head dim 16, bucket 1 follows the mask: the window's own (config.TRITON_BWD_KV_MASK_CONFIGS),
    the bucket's for the other masks."""
    interpret_triton(monkeypatch)
    from pcvr_lib.kernels.attention import triton_impl

    tiles = []
    jit = triton_impl._launch_dkdv.jit

    def record(grid, args, *rest):
        tiles.append(tuple(args[-3:-1]))  # (BLOCK_M, BLOCK_N)
        return jit(grid, args, *rest)

    monkeypatch.setattr(triton_impl._launch_dkdv, "jit", record)
    B, S, D = 1, 200, 16
    q, k, v, do = inputs(B, 1, S, S, D, torch.float16, 5)
    kw = workload.structured_mask("window", B, S) if mode == "window" else {"key_lengths": workload.key_lengths(B, S)}
    q.requires_grad_()
    flash_attention(q, k, v, backend="triton", **kw).backward(do)
    assert tiles == [expected]
