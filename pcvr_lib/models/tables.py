"""Sparse embedding tables, and their row gradients in a form torch.compile can trace.

Eagerly a table is an `nn.Embedding(sparse=True)` whose backward gives a COO gradient of one piece per
position read, of fixed size (no device-to-host sync). torch.compile's AOTAutograd cannot produce sparse
gradients, so a compiled step runs under a `RowCapture`: every lookup of a table adds a zero "sink" tensor
of the lookup's shape to the rows it reads (x + 0 is x) and keeps the rows it read (an extra output of the
compiled graph). Backward then gives each sink, as a plain dense gradient, the gradient of every row read
(one piece per position, 0 at the padding row), and `install_gradients` hands the tables these pieces as
uncoalesced COO gradients (rows, pieces): what the optimizers, the grad-norm clip and
`embedding_bag.merge_rows` already take, with nothing of data-dependent size and no device-to-host sync.
The sinks are planned once per batch shape (`RowCapture.plan`, one eager forward at the compiled graph's
static shapes) and reused, so the compiled graph sees the same inputs at every step.

Where the pieces of a gradient outnumber the table's rows (a batch's sequence lookups read a small table
millions of times, most of them the padding row), `table_gradient` makes it dense instead: one scatter-add
into a (V, D) buffer is cheaper than carrying a slot per piece through the grad-norm clip's and the sparse
optimizer's merges, and it is the same gradient. The choice depends on shapes only (no sync), so it is
fixed for a compiled graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib import kernels
from pcvr_lib.models.sequences import static_lengths


class SparseTable(nn.Embedding):
    """A row-sparse embedding table (padding row 0, sparse gradients) whose lookups a `RowCapture` can
    take over. Same parameters and state-dict keys as `nn.Embedding`."""

    def __init__(self, num_rows: int, dim: int):
        super().__init__(num_rows, dim, padding_idx=0, sparse=True)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if _ACTIVE is None:
            if not (torch.is_grad_enabled() and self.weight.requires_grad):
                return F.embedding(rows, self.weight)
            return _RowLookup.apply(self.weight, rows)
        sink = _ACTIVE.lookup(self, rows)
        return F.embedding(rows, self.weight.detach()) + sink.view(*rows.shape, -1) * _real(rows, self.weight.dtype)


def _real(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows[..., None] != 0 as `dtype`: 1 where a lookup reads a real row, 0 at the padding row (which gets
    no gradient)."""
    return (rows != 0).unsqueeze(-1).to(dtype)


class _RowLookup(torch.autograd.Function):
    """weight[rows] whose backward gives the table a COO gradient of one piece per position read (0 at the
    padding row): fixed size, where nn.Embedding's sparse backward drops the padding positions by a boolean
    mask (a device-to-host sync on CUDA). On the CPU the padding positions are dropped instead (half the
    pieces of a sequence lookup, which the autograd sums, the clip and the optimizer all carry): that mask
    waits for nothing there, and the eager forward already reads the host to trim the sequences. Not at
    `sequences.static_lengths()`, the shapes a compiled or captured step sees, which CPU tests count host
    reads in."""

    @staticmethod
    def forward(ctx, weight, rows):
        ctx.save_for_backward(rows)
        ctx.table_shape = weight.shape
        ctx.drop_padding = (rows.device.type == "cpu" and not static_lengths()
                            and not dense_gradient_pays(rows.numel(), weight.shape[0]))
        return F.embedding(rows, weight)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        flat = rows.reshape(-1)
        pieces = grad.reshape(flat.numel(), -1)
        if ctx.drop_padding:
            real = flat != 0
            return table_gradient(flat[real].long(), pieces[real], ctx.table_shape), None
        pieces = pieces.masked_fill((flat == 0).unsqueeze(-1), 0)
        return table_gradient(flat.long(), pieces, ctx.table_shape), None


def dense_gradient_pays(pieces: int, num_rows: int) -> bool:
    """A table's gradient of `pieces` row pieces is kept dense when there are at least as many pieces as
    rows: then the (V, D) buffer is no larger than the pieces themselves."""
    return pieces >= num_rows


# scratch rows past the table that a dense gradient spreads the padding row's pieces over (see table_gradient)
PADDING_SPREAD = 1024


def table_gradient(rows: torch.Tensor, pieces: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The gradient of a (V, D) table from N row pieces (rows (N,) int64, pieces (N, D)): dense (the pieces
    summed per row in fp32, rounded once to the pieces' dtype) when `dense_gradient_pays`, else the
    uncoalesced COO of the pieces. Row 0 is the padding row, whose pieces every caller has zeroed: the dense
    form leaves them out (row 0 stays zero), the COO form carries them.

    The padding row's pieces are often most of a sequence lookup's, and index_add's atomics on one row
    serialise them (4.7 of 9.1 ms of device time in an onetrans train step compiled on the Triton backend,
    H100, notes/models.md), so the dense form sends them to `PADDING_SPREAD` scratch rows past the table,
    round robin, and drops those: no data-dependent size, no host sync."""
    if dense_gradient_pays(rows.numel(), shape[0]):
        spread = min(PADDING_SPREAD, rows.numel())
        scratch = shape[0] + torch.arange(rows.numel(), device=rows.device) % spread
        target = torch.where(rows == 0, scratch, rows)
        summed = torch.zeros((shape[0] + spread, *shape[1:]), dtype=torch.float32, device=pieces.device)
        return summed.index_add_(0, target, pieces.float())[:shape[0]].to(pieces.dtype)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), pieces, shape, check_invariants=False)


def bag_mean_of_table(table: nn.Embedding, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """[N, L] table rows (0 = no id) -> [N, E] bag means on a kernel backend. Under a `RowCapture` the kernel
    computes the means from the detached table, and the sink of the lookup carries the gradient of every
    piece (the mean's backward: grad / count at each non-zero id)."""
    if _ACTIVE is None:
        sparse = table.sparse and not dense_gradient_pays(ids.numel(), table.num_embeddings)
        return kernels.embedding_bag_mean(table.weight, ids, backend=backend, sparse_grad=sparse)
    sink = _ACTIVE.lookup(table, ids).view(*ids.shape, -1)
    real = _real(ids, sink.dtype)
    share = real / real.sum(-2, keepdim=True).clamp(min=1)
    mean = kernels.embedding_bag_mean(table.weight.detach(), ids, backend=backend)
    return mean + (sink * share).sum(-2)


def field_means_of_table(table: nn.Embedding, rows: torch.Tensor, slot_feature: torch.Tensor, n_features: int,
                         bags: torch.Tensor, backend: str) -> torch.Tensor:
    """`common.field_means` on a kernel backend: rows [..., D] (the table rows of D id slots, 0 = no id) ->
    [..., n_features, E], one bag per (row, feature) of the feature's slots padded to the widest feature's
    (bags [n_features, width], slot D a zero column). Under a `RowCapture` the sink covers the D slots, not
    the n_features x width padded positions the kernel reads: the demo schema's user side has 234 slots in
    46 x 66 bag positions, and every position's piece (mostly padding) went through the captured gradient's
    concatenation and scatter-add."""
    padded = F.pad(rows, (0, 1))[..., bags]  # [..., n_features, width]
    flat = padded.reshape(-1, padded.shape[-1])
    if _ACTIVE is None:
        return bag_mean_of_table(table, flat, backend).view(*padded.shape[:-1], table.embedding_dim)
    mean = kernels.embedding_bag_mean(table.weight.detach(), flat, backend=backend)
    mean = mean.view(*padded.shape[:-1], table.embedding_dim)
    sink = _ACTIVE.lookup(table, rows).view(*rows.shape, -1)
    axis = rows.dim() - 1
    real = _real(rows, sink.dtype)  # [..., D, 1]
    counts = real.new_zeros(*rows.shape[:-1], n_features, 1).index_add(axis, slot_feature, real)
    share = real / counts.clamp(min=1).index_select(axis, slot_feature)  # 1 / the slot's feature's id count
    return mean + sink.new_zeros(mean.shape).index_add(axis, slot_feature, sink * share)


@dataclass
class _Slot:
    table: nn.Embedding
    sink: torch.Tensor  # (N, E) zeros, requires grad: its gradient is the lookup's row pieces
    rows: torch.Tensor | None = None  # (N,) int64: the rows the last forward's lookup read


class RowCapture:
    """The sinks of one forward's table lookups, in call order (see the module docstring)."""

    def __init__(self):
        self.slots: list[_Slot] = []
        self._position = 0
        self._planning = False

    @classmethod
    def plan(cls, forward) -> RowCapture:
        """Run `forward()` once eagerly (no gradient) and keep a sink per table lookup it makes."""
        capture = cls()
        capture._planning = True
        with torch.no_grad(), capture.active():
            forward()
        capture._planning = False
        return capture

    @contextlib.contextmanager
    def active(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("RowCapture: another capture is already active (captures do not nest)")
        _ACTIVE, self._position = self, 0
        try:
            yield self
        finally:
            _ACTIVE = None
        if not self._planning and self._position != len(self.slots):
            raise RuntimeError(f"RowCapture: the forward made {self._position} table lookups, the plan has "
                               f"{len(self.slots)} (the model's lookups changed since it was planned)")

    def lookup(self, table: nn.Embedding, rows: torch.Tensor) -> torch.Tensor:
        """The sink of the next lookup; records the rows it reads."""
        if self._planning:
            weight = table.weight
            sink = torch.zeros(rows.numel(), weight.shape[1], dtype=weight.dtype, device=weight.device,
                               requires_grad=True)
            # the same tensor at every step: CUDA graphs may read it in place instead of copying it in
            torch._dynamo.mark_static_address(sink)
            self.slots.append(_Slot(table, sink))
        if self._position >= len(self.slots):
            raise RuntimeError(f"RowCapture: the forward made more table lookups than the {len(self.slots)} "
                               "planned")
        slot = self.slots[self._position]
        self._position += 1
        if slot.table is not table or slot.sink.shape[0] != rows.numel():
            raise RuntimeError("RowCapture: a table lookup does not match the plan (another table or batch "
                               "shape); plan a capture per batch shape")
        slot.rows = rows.reshape(-1).long()  # under torch.compile an extra output of the graph, not a copy
        return slot.sink

    def install_gradients(self) -> None:
        """After backward: each table's gradient becomes `table_gradient` of its lookups' (row, piece) pairs
        (sinks without a gradient add nothing), and the sinks' gradients are cleared."""
        by_table: dict[int, tuple[nn.Embedding, list[torch.Tensor], list[torch.Tensor]]] = {}
        for slot in self.slots:
            if slot.sink.grad is None or slot.rows is None:
                continue
            _, rows, pieces = by_table.setdefault(id(slot.table), (slot.table, [], []))
            rows.append(slot.rows)
            pieces.append(slot.sink.grad)
            slot.sink.grad, slot.rows = None, None
        for table, rows, pieces in by_table.values():
            weight = table.weight
            grad = table_gradient(torch.cat(rows), torch.cat(pieces), weight.shape)
            weight.grad = grad if weight.grad is None else weight.grad + grad


_ACTIVE: RowCapture | None = None
