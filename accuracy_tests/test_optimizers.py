"""Optimizers against torch and fp64 references: AdamW, Newton-Schulz / Muon, orthogonal transform,
sparse Adagrad, global clipping, the lr multiplier, the training step and the error messages."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pcvr_lib.kernels.testing import count_host_reads
from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.optim import (
    CUBIC,
    QUINTIC,
    Muon,
    OptimizerError,
    OptimizerSet,
    SparseAdagrad,
    UnsupportedOptimizer,
    build_optimizer,
    build_optimizer_set,
    clip_global_grad_norm,
    foreach_adamw_,
    global_grad_norm,
    lr_multiplier,
    merge_sparse_gradients_,
    orthogonal_transform,
    orthogonality_error,
    orthogonalize,
    train_step,
)
from pcvr_lib.optim.newton_schulz import muon_scale, scalar_map
from pcvr_lib.workloads.optim import make_task, pcvr_dense_shapes

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="optim: no CUDA device (CUDA graph / bf16 path)")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _params(shapes, seed=0, device="cpu", dtype=torch.float32):
    g = _gen(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype)) for s in shapes]


def _set_grads(params, seed):
    g = _gen(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)


# ---------------------------------------------------------------- AdamW


def test_foreach_adamw_matches_torch_adamw_fp32():
    shapes = [(7, 5), (33,), (4, 3, 2)]
    ours, ref = _params(shapes, 1), _params(shapes, 1)
    torch_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01, foreach=False)
    m1 = [torch.zeros_like(p) for p in ours]
    m2 = [torch.zeros_like(p) for p in ours]
    for step in range(1, 6):
        _set_grads(ours, step)
        _set_grads(ref, step)
        with torch.no_grad():
            foreach_adamw_(ours, [p.grad for p in ours], m1, m2, step, 3e-3, (0.9, 0.98), 1e-8, 0.01)
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "fused_adamw"])
def test_registry_adamw_is_torch_adamw_with_reference_defaults(name):
    shapes = [(16, 8), (8,)]
    ours, ref = _params(shapes, 2), _params(shapes, 2)
    opt = build_optimizer(name, ours, lr=1e-3)
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    for step in range(3):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_muon_vectors_take_torch_adamw_steps(fused):
    """Muon's AdamW part (vectors, and a group marked use_muon=False) equals torch's AdamW."""
    ours = _params([(10,), (3,), (6, 4)], 3)
    ref = _params([(10,), (3,), (6, 4)], 3)
    opt = Muon([{"params": ours[:2]}, {"params": ours[2:], "use_muon": False}], lr=2e-3, adamw_fused=fused)
    torch_opt = torch.optim.AdamW(ref, lr=2e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    for step in range(4):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- Newton-Schulz and Muon


@pytest.mark.parametrize("coefficients", [CUBIC, QUINTIC], ids=["cubic", "quintic"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 17, 9)])
def test_newton_schulz_acts_on_singular_values_by_the_scalar_map(coefficients, shape):
    """Each singular value of G/||G||_F goes through the scalar polynomial; singular vectors are kept."""
    g = torch.randn(shape, generator=_gen(4), dtype=torch.float64)
    out = orthogonalize(g, steps=5, coefficients=coefficients)
    stack = g if g.dim() == 3 else g.unsqueeze(0)
    u, s, vh = torch.linalg.svd(stack, full_matrices=False)
    s = s / torch.linalg.vector_norm(stack, dim=(-2, -1)).unsqueeze(-1)
    expected = u @ torch.diag_embed(scalar_map(s, 5, coefficients)) @ vh
    torch.testing.assert_close(out, expected.reshape(out.shape), rtol=1e-9, atol=1e-9)


def test_quintic_output_is_close_to_orthogonal_in_its_band():
    g = torch.randn(64, 128, generator=_gen(5))
    err = orthogonality_error(orthogonalize(g, steps=5, coefficients=QUINTIC))
    assert 0.6 <= err["sigma_min"] and err["sigma_max"] <= 1.25, err


def test_cubic_converges_to_orthogonal_for_a_well_conditioned_input():
    q, _ = torch.linalg.qr(torch.randn(48, 48, generator=_gen(6), dtype=torch.float64))
    g = q * torch.linspace(0.5, 1.0, 48, dtype=torch.float64)  # sigma / ||G||_F in [0.09, 0.18]
    err = orthogonality_error(orthogonalize(g, steps=12, coefficients=CUBIC))
    assert err["max_abs_sigma_minus_1"] < 1e-6, err


def test_orthogonalize_gives_zero_for_tiny_and_non_finite_matrices():
    g = torch.randn(3, 8, 8, generator=_gen(7))
    g[1] = 1e-14
    g[2, 0, 0] = float("inf")
    out = orthogonalize(g)
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0 and out[2].abs().max() == 0
    assert out[0].abs().max() > 0


def _reference_muon(params, grad_seqs, lr, momentum=0.95, wd=0.01, steps=5, coefficients=CUBIC):
    """Per-matrix Muon in fp64, written plainly from the definition."""
    ws = [p.detach().to(torch.float64).clone() for p in params]
    bufs = [torch.zeros_like(w) for w in ws]
    for grads in grad_seqs:
        for i, (w, g) in enumerate(zip(ws, grads, strict=True)):
            g = g.to(torch.float64)
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            u = (1 - momentum) * g + momentum * bufs[i]
            mats = u.reshape(-1, u.shape[-2], u.shape[-1])
            outs = []
            for mat in mats:
                x = mat.T if mat.shape[0] > mat.shape[1] else mat
                x = x / torch.linalg.norm(x)
                for _ in range(steps):
                    a, b, c = coefficients
                    gram = x @ x.T
                    x = a * x + b * gram @ x + c * gram @ gram @ x
                outs.append(x.T if mat.shape[0] > mat.shape[1] else x)
            o = torch.stack(outs).reshape(w.shape) * math.sqrt(max(1.0, w.shape[-2] / w.shape[-1]))
            ws[i] = w * (1 - lr * wd) - lr * o
    return ws


@pytest.mark.parametrize("ns", ["cubic", "quintic"])
def test_muon_matches_fp64_per_matrix_reference(ns):
    shapes = [(12, 20), (12, 20), (20, 12), (2, 6, 5)]
    params = _params(shapes, 8)
    start = [p.detach().clone() for p in params]
    grad_seqs = [[torch.randn(s, generator=_gen(100 + k * 10 + i)) for i, s in enumerate(shapes)]
                 for k in range(3)]
    opt = Muon(params, lr=0.02, ns_coefficients=ns)
    for grads in grad_seqs:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    expected = _reference_muon(start, grad_seqs, 0.02, coefficients=CUBIC if ns == "cubic" else QUINTIC)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach().to(torch.float64), e, rtol=1e-5, atol=1e-5)


def test_muon_stacked_3d_parameter_equals_per_matrix_muon():
    stacked = _params([(4, 16, 24)], 9)[0]
    singles = [nn.Parameter(stacked.detach()[i].clone()) for i in range(4)]
    opt_a, opt_b = Muon([stacked], lr=0.05), Muon(singles, lr=0.05)
    for k in range(3):
        g = torch.randn(4, 16, 24, generator=_gen(200 + k))
        stacked.grad = g.clone()
        for i, p in enumerate(singles):
            p.grad = g[i].clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in singles]), rtol=0, atol=1e-6)


def test_stack_plan_merges_shapes_by_padding_cost():
    from pcvr_lib.optim.stacking import StackPlan

    mlp = [torch.empty(s) for s in [(512, 256), (512, 512), (512, 512), (512, 512), (1, 512)]]
    assert [(k.rows, k.cols, k.size) for k in StackPlan(mlp, "stack", 3e8).classes] == [(512, 512, 5)]
    assert len(StackPlan(mlp, "stack", 0.0).classes) == 3
    pcvr = [torch.empty(s) for s in pcvr_dense_shapes() if len(s) >= 2]
    assert len(StackPlan(pcvr, "stack", 0.0).classes) > 10
    assert len(StackPlan(pcvr, "stack", 3e8).classes) <= 3


@pytest.mark.parametrize("name", ["muon", "orthogonal_adamw"])
def test_merged_padded_stacks_equal_one_stack_per_shape(name):
    """Zero padding is exact: merging every shape into one padded stack changes nothing (fp64)."""
    shapes = [(12, 20), (20, 12), (5, 7), (2, 6, 5), (1, 9), (9,)]
    a = _params(shapes, 23, dtype=torch.float64)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = build_optimizer(name, a, lr=0.01, merge_flops=1e12)
    opt_b = build_optimizer(name, b, lr=0.01, merge_flops=0.0)
    for k in range(3):
        _set_grads(a, k)
        _set_grads(b, k)
        opt_a.step()
        opt_b.step()
    tol = 1e-12 if name == "muon" else 1e-6  # the orthogonal transform computes in fp32
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_muon_scale_and_zero_gradient_gives_weight_decay_only():
    assert muon_scale(256, 64) == 2.0 and muon_scale(64, 256) == 1.0
    p = _params([(8, 8)], 10)[0]
    before = p.detach().clone()
    p.grad = torch.zeros(8, 8)
    Muon([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), before * (1 - 0.1 * 0.5))


def test_muon_skips_parameters_without_gradient_and_keeps_their_momentum():
    params = _params([(6, 6), (6, 6), (6, 6)], 11)
    opt = Muon(params, lr=0.01)
    _set_grads(params, 1)
    opt.step()
    frozen = params[1].detach().clone()
    buf = opt.state[params[1]]["momentum_buffer"].clone()
    _set_grads(params, 2)
    params[1].grad = None
    opt.step()
    torch.testing.assert_close(params[1].detach(), frozen, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[params[1]]["momentum_buffer"], buf, rtol=0, atol=0)


def test_muon_state_dict_round_trip_continues_identically():
    a = _params([(8, 12), (12,)], 12)
    opt_a = Muon(a, lr=0.02)
    for k in range(2):
        _set_grads(a, k)
        opt_a.step()
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = Muon(b, lr=0.02)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for k in range(2, 4):
        _set_grads(a, k)
        _set_grads(b, k)
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------- orthogonal AdamW


def test_orthogonal_transform_preserves_norm_and_follows_the_definition():
    g = torch.randn(5, 30, 12, generator=_gen(13), dtype=torch.float64)
    out = orthogonal_transform(g, steps=2)
    torch.testing.assert_close(torch.linalg.vector_norm(out, dim=(-2, -1)),
                               torch.linalg.vector_norm(g, dim=(-2, -1)), rtol=1e-6, atol=0)  # fp32 inside
    for i in range(5):
        x = g[i].T / torch.linalg.norm(g[i])
        for _ in range(2):
            x = 1.5 * x - 0.5 * (x @ x.T) @ x
        torch.testing.assert_close(out[i], (x * torch.linalg.norm(g[i]) / torch.linalg.norm(x)).T,
                                   rtol=1e-5, atol=1e-6)


def test_orthogonal_transform_bf16_matmuls_keep_the_norm_and_the_direction():
    g = torch.randn(4, 24, 40, generator=_gen(24))
    ref = orthogonal_transform(g.double(), steps=2)
    out = orthogonal_transform(g, steps=2, compute_dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(torch.linalg.vector_norm(out, dim=(-2, -1)),
                               torch.linalg.vector_norm(g, dim=(-2, -1)), rtol=1e-5, atol=0)
    assert ((out.double() - ref).norm() / ref.norm()) < 2e-2


def test_orthogonal_adamw_flattens_to_rows_and_then_steps_like_adamw():
    shapes = [(6, 2, 5), (6,)]
    ours, ref = _params(shapes, 14), _params(shapes, 14)
    opt = build_optimizer("orthogonal_adamw", ours, lr=1e-2)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01)
    for k in range(3):
        _set_grads(ours, k)
        _set_grads(ref, k)
        norm_before = ours[0].grad.norm()
        ref[0].grad = orthogonal_transform(ref[0].grad.reshape(1, 6, 10), 2).reshape(6, 2, 5)
        opt.step()
        torch_opt.step()
        torch.testing.assert_close(ours[0].grad.norm(), norm_before)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- sparse Adagrad


def test_sparse_adagrad_equals_torch_dense_adagrad_and_leaves_other_rows():
    torch.manual_seed(15)
    ours = nn.Embedding(40, 6, sparse=True)
    ref = nn.Embedding(40, 6)
    ref.weight.data.copy_(ours.weight.data)
    start = ours.weight.detach().clone()
    opt = SparseAdagrad(ours.parameters(), lr=0.05)
    torch_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    batches = [torch.tensor([[1, 3, 3, 3], [7, 1, 9, 3]]), torch.tensor([[9, 9, 2, 12]])]
    for ids in batches:
        w = torch.randn(ids.numel(), 6, generator=_gen(int(ids.sum())))
        for emb in (ours, ref):
            (emb(ids).reshape(-1, 6) * w).sum().backward()
        assert ours.weight.grad.is_sparse and not ours.weight.grad.is_coalesced()
        opt.step()
        torch_opt.step()
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-7)
    touched = torch.tensor([1, 2, 3, 7, 9, 12])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(ours.weight.detach()[untouched], start[untouched])
    assert torch.count_nonzero(opt.state[ours.weight]["sum"][untouched]) == 0
    assert not torch.equal(ours.weight.detach()[touched], start[touched])


def test_sparse_adagrad_merges_duplicates_before_squaring():
    w = nn.Parameter(torch.zeros(4, 1))
    # row 2 appears twice with +1 and +1: merged gradient 2, accumulator 4 (not 1 + 1 = 2)
    w.grad = torch.sparse_coo_tensor(torch.tensor([[2, 2]]), torch.tensor([[1.0], [1.0]]), (4, 1),
                                     check_invariants=True)
    opt = SparseAdagrad([w], lr=1.0, eps=0.0)
    opt.step()
    assert opt.state[w]["sum"][2, 0] == 4.0
    assert w[2, 0] == -1.0  # -lr * 2 / sqrt(4)
    others = torch.tensor([0, 1, 3])
    assert torch.equal(w.detach()[others], torch.zeros(3, 1)), "rows without a gradient must not move (eps 0)"
    assert torch.equal(opt.state[w]["sum"][others], torch.zeros(3, 1))


def test_sparse_adagrad_takes_a_dense_table_gradient_as_its_sparse_form():
    """A table's gradient is dense where its pieces outnumber its rows (models.tables): the same update as
    the COO of the touched rows, and rows whose gradient and state are 0 stay put with eps 0 (no 0 / 0)."""
    rows = torch.tensor([1, 3, 3, 5])
    values = torch.randn(4, 2, generator=_gen(21))
    coo = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (6, 2), check_invariants=True)
    start = torch.randn(6, 2, generator=_gen(22))
    tables = [nn.Parameter(start.clone()) for _ in range(2)]
    optimizers = [SparseAdagrad([t], lr=0.3, eps=0.0) for t in tables]
    for _ in range(2):
        tables[0].grad, tables[1].grad = coo.clone(), coo.to_dense()
        for opt in optimizers:
            opt.step()
    assert not torch.isnan(tables[1]).any(), "a dense gradient's untouched rows became NaN (0 / 0 at eps 0)"
    torch.testing.assert_close(tables[1], tables[0], rtol=1e-6, atol=1e-7)
    untouched = torch.tensor([0, 2, 4])
    assert torch.equal(tables[1].detach()[untouched], start[untouched])
    torch.testing.assert_close(optimizers[1].state[tables[1]]["sum"], optimizers[0].state[tables[0]]["sum"])


@pytest.mark.parametrize("capturable", [False, True])
def test_reset_state_makes_the_next_step_a_first_step(capturable):
    """OptimizerSet.reset_state_ (what a captured CUDA graph's warm-up is undone with, in place): after
    three steps, reset and the weights restored, a step equals a fresh optimizer set's first step."""
    shapes = [(5, 4), (4,)]
    start_dense, start_table = _params(shapes, seed=31), torch.randn(9, 3, generator=_gen(32))

    def build():
        dense = [nn.Parameter(p.detach().clone()) for p in start_dense]
        table = nn.Parameter(start_table.clone())
        opts = build_optimizer_set(dense, [table], dense="fused_adamw", dense_options={"capturable": capturable},
                                   sparse_options={"initial_accumulator_value": 0.1})
        return dense + [table], opts

    def step(params, opts, seed):
        _set_grads(params[:-1], seed)
        rows = torch.randint(1, 9, (6,), generator=_gen(seed))
        params[-1].grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(6, 3, generator=_gen(seed + 1)),
                                                  (9, 3), check_invariants=True)
        opts.step()
        opts.zero_grad()

    def state_memory(opts):
        return {(i, j, key): value.data_ptr() for i, o in enumerate(opts.optimizers)
                for j, st in enumerate(o.state.values()) for key, value in st.items() if torch.is_tensor(value)}

    used, used_opts = build()
    for seed in range(3):
        step(used, used_opts, seed)
    memory = state_memory(used_opts)
    assert len(memory) >= 4, memory  # AdamW's step and moments, Adagrad's accumulator
    used_opts.reset_state_()
    with torch.no_grad():
        for p, start in zip(used, [*start_dense, start_table], strict=True):
            p.copy_(start)
    assert state_memory(used_opts) == memory, "reset_state_ replaced a state tensor (a captured graph keeps the old)"
    fresh, fresh_opts = build()
    step(used, used_opts, 7)
    step(fresh, fresh_opts, 7)
    for a, b in zip(used, fresh, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_reset_state_refuses_an_optimizer_without_a_known_fresh_state():
    params = _params([(4, 4)])
    with pytest.raises(OptimizerError, match="Muon"):
        OptimizerSet(dense=Muon(params, lr=0.02)).reset_state_()


def test_the_sparse_step_reads_nothing_back_from_the_device():
    """Clipping and the sparse Adagrad step merge a sparse gradient's duplicate rows on the device (fixed-size
    slots), so neither asks for a value on the host (which would be a sync on a GPU)."""
    table = nn.Parameter(torch.zeros(12, 3))
    opt = SparseAdagrad([table], lr=0.1)
    for step in range(2):
        table.grad = torch.sparse_coo_tensor(torch.tensor([[3, 7, 3, 0, 11]]), torch.randn(5, 3, generator=_gen(step)),
                                             (12, 3), check_invariants=True)
        expected = table.grad.coalesce()
        with count_host_reads() as reads:
            clip_global_grad_norm([table], 0.5)
            opt.step()
        assert reads == [], reads
        torch.testing.assert_close(table.grad.coalesce().to_dense(), expected.to_dense() * min(
            1.0, 0.5 / float(expected.values().norm() + 1e-6)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_sparse_gradients_in_either_form_are_the_summed_rows(dtype):
    """merge_sparse_gradients_: fixed-size slots (no host read, what a GPU step uses) or, on the CPU, only the
    distinct rows (coalesced); both the fp32 sum of the pieces rounded once, and both stepped alike."""
    rows = torch.tensor([[3, 7, 3, 0, 11, 3, 7]])
    pieces = torch.randn(7, 3, generator=_gen(5), dtype=torch.float64)
    expected = torch.zeros(12, 3, dtype=torch.float64).index_add_(0, rows[0], pieces.to(dtype).double())
    stepped = []
    for fixed_size in (True, False):
        table = nn.Parameter(torch.ones(12, 3, dtype=dtype))
        table.grad = torch.sparse_coo_tensor(rows, pieces.to(dtype), (12, 3), check_invariants=True)
        with count_host_reads() as reads:
            merge_sparse_gradients_([table], fixed_size=fixed_size)
        grad = table.grad
        assert grad.dtype == dtype
        if fixed_size:
            assert reads == [] and grad._nnz() == 7 and not grad.is_coalesced(), (reads, grad._nnz())
        else:
            assert grad.is_coalesced() and grad._indices()[0].tolist() == [0, 3, 7, 11]
        assert_close(grad.to_dense(), expected, dtype, what=f"merged gradient, fixed_size={fixed_size}")
        opt = OptimizerSet(dense=None, sparse=SparseAdagrad([table], lr=0.1))
        opt.step(rows_merged=True)
        stepped.append(table.detach().double())
    assert_close(stepped[1], stepped[0], dtype, what="Adagrad step of the coalesced vs the fixed-size gradient")


# ---------------------------------------------------------------- clipping and the training step


def _sparse_and_dense_grads():
    dense = _params([(5, 4), (4,)], 16)
    _set_grads(dense, 16)
    table = nn.Parameter(torch.zeros(10, 3))
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]),
                                         torch.randn(3, 3, generator=_gen(17)), (10, 3),
                                         check_invariants=True)
    return dense, table


def test_global_norm_counts_sparse_rows_after_merging():
    dense, table = _sparse_and_dense_grads()
    expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in dense) + table.grad.to_dense().pow(2).sum())
    torch.testing.assert_close(global_grad_norm([*dense, table]), expected)


@pytest.mark.parametrize("bound", [0.5, 100.0])
def test_clipping_scales_dense_and_sparse_to_the_bound(bound):
    dense, table = _sparse_and_dense_grads()
    params = [*dense, table]
    before = [p.grad.to_dense().clone() for p in params]
    norm, coef = clip_global_grad_norm(params, bound)
    after = global_grad_norm(params)
    if norm > bound:
        torch.testing.assert_close(after, torch.tensor(bound), rtol=1e-5, atol=0)
    else:
        assert coef == 1.0
        torch.testing.assert_close(after, norm)
    for p, b in zip(params, before, strict=True):  # one common factor for every gradient
        torch.testing.assert_close(p.grad.to_dense(), b * coef)


def test_lr_multiplier_values():
    assert [lr_multiplier(s, warmup_steps=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multiplier(4, 4, 14, "linear", 0.1) == 1.0
    assert lr_multiplier(9, 4, 14, "linear", 0.1) == pytest.approx(0.55)
    assert lr_multiplier(14, 4, 14, "linear", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(99, 4, 14, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 4, 14, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_multiplier(7, 0, 10, "cosine", 0.2) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(0.7 * math.pi)))
    with pytest.raises(ValueError, match="unknown lr decay 'exp'"):
        lr_multiplier(0, decay="exp")
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(5, 2, None, "linear")


def test_train_step_dense_and_sparse_with_clipping_and_lr_multiplier():
    torch.manual_seed(18)
    emb = nn.Embedding(20, 4, sparse=True)
    lin = nn.Linear(4, 1)
    opts = build_optimizer_set(lin.parameters(), emb.parameters(), dense="adamw",
                               dense_options=dict(lr=1e-2), sparse_options=dict(lr=0.05))
    ids = torch.tensor([1, 2, 2, 5])
    emb_before = emb.weight.detach().clone()
    info = train_step((lin(emb(ids)) * 100).pow(2).mean(), opts, max_grad_norm=1.0, lr_multiplier=0.5)
    assert not info["skipped"] and info["grad_norm"] > 1.0
    assert info["clip_coef"] == pytest.approx(1.0 / (info["grad_norm"] + 1e-6))
    assert opts.dense.param_groups[0]["lr"] == 5e-3 and opts.sparse.param_groups[0]["lr"] == 0.025
    assert lin.weight.grad is None and emb.weight.grad is None
    changed = (emb.weight.detach() != emb_before).any(1)
    assert changed.tolist() == [i in (1, 2, 5) for i in range(20)]


def test_train_step_skips_a_non_finite_step():
    lin = nn.Linear(3, 1)
    before = [p.detach().clone() for p in lin.parameters()]
    opts = OptimizerSet(build_optimizer("muon", lin.parameters()))
    info = train_step(lin(torch.tensor([[1.0, float("nan"), 0.0]])).sum(), opts)
    assert info["skipped"] and math.isnan(info["grad_norm"])
    for p, b in zip(lin.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("name,lr", [("adamw", 3e-3), ("fused_adamw", 3e-3), ("orthogonal_adamw", 3e-3),
                                     ("muon", 0.02)])
def test_every_optimizer_lowers_the_mlp_loss_in_50_steps(name, lr):
    task = make_task("mlp", batch=128, features=16, hidden=64, depth=4, seed=19)
    opts = OptimizerSet(build_optimizer(name, task.parameters(), lr=lr))
    first = train_step(task.loss(), opts)["loss"]
    for _ in range(49):
        last = train_step(task.loss(), opts)["loss"]
    assert last < 0.8 * first, (first, last)


@pytest.mark.parametrize("name", ["adamw", "fused_adamw", "orthogonal_adamw", "muon"])
def test_one_dense_options_dict_fits_every_dense_optimizer(name):
    """The trainer passes lr, betas and weight_decay whatever the dense optimizer (Muon: its AdamW part)."""
    lin = nn.Linear(4, 3)
    opt = build_optimizer(name, lin.parameters(), lr=1e-3, betas=(0.8, 0.9), weight_decay=0.0)
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)


def test_pcvr_dense_shapes_are_muon_buckets():
    shapes = pcvr_dense_shapes()
    # baseline's RankMixer is parameter-free (as the reference's), so no 3-D stacks remain
    assert any(len(s) == 2 for s in shapes) and any(len(s) == 1 for s in shapes)
    task = make_task("pcvr_dense")
    opt = build_optimizer("muon", task.parameters(), lr=0.02)
    loss0 = task.loss().item()
    opts = OptimizerSet(opt)
    for _ in range(3):
        train_step(task.loss(), opts)
    assert task.loss().item() < loss0


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name,options,match",
    [
        ("adamw", dict(lr=0.0), "adamw: lr must be a finite number > 0, got 0.0"),
        ("fused_adamw", dict(lr=-1e-3), "fused_adamw: lr must be"),
        ("orthogonal_adamw", dict(lr=float("nan")), "orthogonal_adamw: lr must be"),
        ("muon", dict(momentum=1.0), r"muon: momentum must be in \[0, 1\), got 1.0"),
        ("muon", dict(momentum=-0.1), "muon: momentum must be in"),
        ("muon", dict(ns_steps=0), "muon: ns_steps must be an integer >= 1, got 0"),
        ("muon", dict(ns_coefficients="septic"), "unknown Newton-Schulz iteration 'septic'; known: cubic, quintic"),
        ("sparse_adagrad", dict(lr=0), "sparse_adagrad: lr must be"),
        ("adamw", dict(betas=(0.9, 1.0)), "betas must be two numbers in"),
        ("muon", dict(nesterov_typo=True), "muon: .*unexpected keyword argument 'nesterov_typo'"),
    ],
)
def test_bad_options_are_clear_errors(name, options, match):
    with pytest.raises(OptimizerError, match=match):
        build_optimizer(name, [nn.Parameter(torch.zeros(4, 4))], **options)


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(OptimizerError, match="unknown optimizer 'lion'; known: adamw, fused_adamw, "
                                             "orthogonal_adamw, muon, sparse_adagrad"):
        build_optimizer("lion", [nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("name", ["muon", "orthogonal_adamw", "adamw"])
def test_sparse_gradient_given_to_a_dense_optimizer(name):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = build_optimizer(name, emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises((OptimizerError, RuntimeError), match="sparse"):
        opt.step()


def test_fused_adamw_unsupported_device_says_why():
    with pytest.raises(UnsupportedOptimizer, match="fused_adamw: torch has no fused AdamW kernel for device 'meta'"):
        build_optimizer("fused_adamw", [nn.Parameter(torch.zeros(2, device="meta"))])


def test_clip_bound_must_be_positive():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(OptimizerError, match="max_grad_norm must be > 0"):
        clip_global_grad_norm([p], 0.0)


# ---------------------------------------------------------------- CUDA: graphs and bf16


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("ns", ["cubic", "quintic"])
def test_muon_cuda_graph_equals_eager(ns):
    shapes = [(64, 32), (64, 32), (32, 96), (3, 16, 16), (64,)]
    a = _params(shapes, 20, device="cuda")
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = Muon(a, lr=0.02, ns_coefficients=ns, cuda_graph=True)
    opt_b = Muon(b, lr=0.02, ns_coefficients=ns, cuda_graph=False)
    for k in range(4):
        _set_grads(a, k)
        _set_grads(b, k)
        opt_a.step()
        opt_b.step()
    # the same kernels; only cuBLAS's algorithm choice under capture may differ (bf16 updates ~2e-3)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=5e-5)


@needs_cuda
@pytest.mark.gpu
def test_orthogonal_adamw_cuda_graph_equals_eager():
    shapes = [(64, 32), (64, 32), (8, 4, 4), (64,)]
    a = _params(shapes, 21, device="cuda")
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = build_optimizer("orthogonal_adamw", a, cuda_graph=True)
    opt_b = build_optimizer("orthogonal_adamw", b, cuda_graph=False)
    for k in range(3):
        _set_grads(a, k)
        _set_grads(b, k)
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@needs_cuda
@pytest.mark.gpu
def test_muon_bf16_on_cuda_matches_fp64_reference():
    shapes = [(128, 64), (128, 64), (64, 256)]
    params = _params(shapes, 22, device="cuda")
    start = [p.detach().cpu().clone() for p in params]
    grad_seqs = [[torch.randn(s, generator=_gen(300 + k * 10 + i)) for i, s in enumerate(shapes)] for k in range(2)]
    opt = Muon(params, lr=0.02, ns_coefficients="quintic")
    for grads in grad_seqs:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.cuda()
        opt.step()
    expected = _reference_muon(start, grad_seqs, 0.02, coefficients=QUINTIC)
    for p, s, e in zip(params, start, expected, strict=True):
        # bf16 Newton-Schulz: the total update is right to bf16 precision (relative, in norm)
        err = (p.detach().cpu().double() - e).norm() / (e - s.double()).norm()
        assert err < 5e-2, err


@needs_cuda
@pytest.mark.gpu
def test_quintic_bf16_band_on_cuda():
    g = torch.randn(8, 256, 512, device="cuda")
    err = orthogonality_error(orthogonalize(g, 5, QUINTIC, compute_dtype=torch.bfloat16))
    assert 0.55 <= err["sigma_min"] and err["sigma_max"] <= 1.3, err
