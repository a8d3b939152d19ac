"""A table's gradient is dense where its pieces outnumber its rows and COO otherwise (models.tables), and
either form is the fp64 gradient of the lookups: eagerly (torch lookups and the kernels' bag means) and
from a RowCapture. CPU; the Triton bag mean runs in Triton's interpreter."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pcvr_lib.kernels.embedding_bag import reference_weight_grad
from pcvr_lib.kernels.testing import count_host_reads
from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.models.tables import RowCapture, SparseTable, bag_mean_of_table, dense_gradient_pays, table_gradient
from pcvr_lib.optim import build_optimizer_set, train_step


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(1, 40), pieces=st.integers(1, 60), dim=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_table_gradient_is_the_sum_of_its_pieces_in_either_form(num_rows, pieces, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, num_rows, (pieces,), generator=gen)
    values = torch.randn(pieces, dim, generator=gen, dtype=torch.float64)
    values[rows == 0] = 0  # the padding row's pieces, zeroed by every caller
    grad = table_gradient(rows, values.to(dtype), torch.Size((num_rows, dim)))
    assert grad.is_sparse == (pieces < num_rows), (pieces, num_rows, grad.layout)
    assert grad.dtype == dtype
    expected = torch.zeros(num_rows, dim, dtype=torch.float64).index_add_(0, rows, values.to(dtype).double())
    # many pieces on one row: atol relative to the size of the terms, not of their (possibly cancelling) sum
    assert_close(_dense(grad), expected, dtype, scale=float(values.square().mean().sqrt()) * pieces ** 0.5,
                 what=f"{pieces} pieces into {num_rows} rows")


@pytest.mark.parametrize("pieces", [5, 2000, 5000])
def test_a_dense_gradient_leaves_out_the_padding_row(pieces):
    """The dense form sends the padding row's pieces to scratch rows (fewer pieces than scratch rows, and
    more, so that several share one): row 0 stays zero and every other row is the sum of its pieces."""
    gen = torch.Generator().manual_seed(pieces)
    rows = torch.randint(0, 4, (pieces,), generator=gen)  # about a quarter at the padding row
    values = torch.randn(pieces, 3, generator=gen, dtype=torch.float64)
    grad = table_gradient(rows, values.float(), torch.Size((4, 3)))
    assert not grad.is_sparse and grad.shape == (4, 3) and grad.dtype == torch.float32
    expected = torch.zeros(4, 3, dtype=torch.float64).index_add_(0, rows, values)
    expected[0] = 0
    assert torch.count_nonzero(grad[0]) == 0, "the padding row got a gradient"
    assert_close(grad, expected, torch.float32, scale=pieces ** 0.5, what=f"{pieces} pieces into 4 rows")


@pytest.mark.parametrize("reads, dense", [((3, 2), False), ((2, 5), True), ((6, 5), True)])  # of 10 rows
def test_a_torch_lookup_gradient_is_dense_exactly_when_it_pays(reads, dense):
    torch.manual_seed(4)
    table = SparseTable(10, 4)
    reference = torch.nn.Embedding(10, 4, padding_idx=0, dtype=torch.float64)
    reference.weight.data.copy_(table.weight.data)
    rows = torch.randint(0, 10, reads)
    rows[0, 0] = 0  # a padding read: no gradient on row 0
    weights = torch.randn(*reads, 4, dtype=torch.float64)
    (table(rows).double() * weights).sum().backward()
    (reference(rows) * weights).sum().backward()
    grad = table.weight.grad
    assert dense_gradient_pays(rows.numel(), 10) == dense
    assert grad.is_sparse != dense, grad.layout
    assert_close(_dense(grad), reference.weight.grad, torch.float32, what=f"lookup gradient, reads {reads}")
    assert torch.count_nonzero(_dense(grad)[0]) == 0, "the padding row got a gradient"


def test_an_eager_cpu_lookup_drops_its_padding_pieces_except_at_static_lengths():
    """On the CPU the eager lookup's COO gradient leaves out the padding positions (a boolean mask, which waits
    for nothing there); at static lengths (the shapes a compiled or captured step sees) it keeps a zero piece
    per padding position and reads nothing back. Both are the same gradient."""
    torch.manual_seed(7)
    rows = torch.tensor([[4, 0, 9, 0], [0, 4, 0, 0]])  # 3 real reads of a 20-row table
    weights = torch.randn(2, 4, 5, dtype=torch.float64)
    reference = torch.zeros(20, 5, dtype=torch.float64)
    reference.index_add_(0, rows.reshape(-1), (weights * (rows != 0).unsqueeze(-1)).reshape(-1, 5))
    for static, pieces in ((False, 3), (True, 8)):
        table = SparseTable(20, 5)
        with at_static_lengths() if static else contextlib.nullcontext(), count_host_reads() as reads:
            (table(rows).double() * weights).sum().backward()
        grad = table.weight.grad
        assert grad.is_sparse and grad._nnz() == pieces, (static, grad._nnz())
        assert (reads == []) == static, reads
        assert_close(grad.to_dense(), reference, torch.float32, what=f"lookup gradient, static lengths {static}")


@pytest.mark.parametrize("seed", range(3))
def test_a_train_step_steps_alike_with_compact_or_fixed_size_table_gradients(seed):
    """A CPU step that may read the host (read=True: padding dropped, duplicate rows coalesced) and one that
    may not (read=False at static lengths: a slot per position) update the table and the dense layer alike."""
    after = []
    for compact in (True, False):
        torch.manual_seed(seed)
        table, head = SparseTable(64, 6), torch.nn.Linear(6, 1)
        optimizers = build_optimizer_set(head.parameters(), table.parameters(), dense="adamw")
        for step in range(2):
            rows = torch.randint(0, 12, (5, 7), generator=torch.Generator().manual_seed(seed * 10 + step))
            with contextlib.nullcontext() if compact else at_static_lengths():
                loss = head(table(rows)).square().mean()
                train_step(loss, optimizers, max_grad_norm=0.05, skip_nonfinite=compact, read=compact)
        after.append([p.detach().clone() for p in (table.weight, *head.parameters())])
    for compact, fixed in zip(*after, strict=True):
        assert_close(compact.double(), fixed.double(), torch.float32, what="parameters after two steps")


@pytest.mark.parametrize("bags, dense", [((2, 3), False), ((4, 4), True), ((5, 4), True)])  # of 16 rows
def test_a_kernel_bag_mean_gradient_is_dense_exactly_when_it_pays(bags, dense, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU check (Triton's interpreter); accuracy_tests cover the kernels on a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(5)
    table = SparseTable(16, 8)
    ids = torch.randint(0, 16, bags)
    ids[0, 0] = 0
    grad_out = torch.randn(bags[0], 8, dtype=torch.float64)
    (bag_mean_of_table(table, ids, "triton").double() * grad_out).sum().backward()
    grad = table.weight.grad
    assert dense_gradient_pays(ids.numel(), 16) == dense
    assert grad.is_sparse != dense, grad.layout
    assert_close(_dense(grad), reference_weight_grad(16, ids, grad_out), torch.float32,
                 what=f"Triton bag-mean gradient, bags {bags}")


def test_a_captured_gradient_takes_the_form_of_all_its_lookups_together():
    """Two lookups of 6 reads each into a 10-row table: each alone would be COO, together (12 >= 10) the
    captured gradient is dense, and it is the sum of both lookups' gradients."""
    torch.manual_seed(6)
    table = SparseTable(10, 3)
    first, second = torch.randint(0, 10, (2, 3)), torch.randint(0, 10, (3, 2))
    weights = [torch.randn(*rows.shape, 3) for rows in (first, second)]

    def forward():
        return sum((table(rows) * w).sum() for rows, w in zip((first, second), weights, strict=True))

    capture = RowCapture.plan(forward)
    with capture.active():
        loss = forward()
    loss.backward()
    capture.install_gradients()
    grad = table.weight.grad
    assert not grad.is_sparse, "12 reads of a 10-row table: the captured gradient should be dense"
    weight = table.weight.detach().double().requires_grad_()
    sum((F.embedding(rows, weight, padding_idx=0) * w.double()).sum()
        for rows, w in zip((first, second), weights, strict=True)).backward()
    assert_close(grad, weight.grad, torch.float32, what="captured gradient of two lookups")


def test_kernel_field_means_under_a_capture_carry_one_piece_per_slot(monkeypatch):
    """Per-feature means of 7 id slots in 3 features (bags padded to width 3): on the Triton backend under a
    RowCapture the sink holds one piece per slot (7 a row, not the 9 padded bag positions), and the value and
    the table's gradient are torch's field means' in fp64."""
    if torch.cuda.is_available():
        pytest.skip("CPU check (Triton's interpreter); accuracy_tests cover the kernels on a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pcvr_lib.models.kernel_ops import field_means

    torch.manual_seed(8)
    table = SparseTable(30, 4)
    rows = torch.randint(0, 30, (3, 7))
    rows[0, 3] = 0  # feature 1's only slot empty in row 0: a zero mean
    rows[1, :3] = 0  # feature 0 empty in row 1
    rows[2, 4] = 0  # one of feature 2's three slots empty in row 2
    slot_feature = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    bags = torch.tensor([[0, 1, 2], [3, 7, 7], [4, 5, 6]])
    grad_out = torch.randn(3, 3, 4, dtype=torch.float64)

    def means():
        return field_means(table, rows, slot_feature, 3, bags, "triton")

    capture = RowCapture.plan(means)
    assert [slot.sink.shape[0] for slot in capture.slots] == [rows.numel()]
    with capture.active():
        value = means()
    (value.double() * grad_out).sum().backward()
    capture.install_gradients()
    weight = table.weight.detach().double().requires_grad_()
    reference = SparseTable(30, 4).double()
    reference.weight = torch.nn.Parameter(weight)
    expected = field_means(reference, rows, slot_feature, 3, bags, "torch")
    (expected * grad_out).sum().backward()
    assert_close(value, expected, torch.float32, what="captured Triton field means")
    assert_close(_dense(table.weight.grad), _dense(reference.weight.grad), torch.float32,
                 what="captured Triton field means' table gradient")
