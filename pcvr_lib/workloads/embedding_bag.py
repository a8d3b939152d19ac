"""The embedding-bag workload: the cases the accuracy tests and the benchmarks run, their inputs, the
bytes a case must move, and the TileLang kernels those cases need (the manifest of
`python -m pcvr_lib.precompile embedding_bag_mean`). The fp64 references are pcvr_lib.kernels.embedding_bag's.
"""

from __future__ import annotations

import torch

from pcvr_lib.kernels.embedding_bag.config import vector_width

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)

# accuracy_tests/test_embedding_bag.py: name -> (B, L, V, D, padding fraction)
EDGE_CASES = {
    "odd96": (37, 5, 97, 96, 0.25),
    "odd127": (19, 3, 50, 127, 0.5),
    "bag1": (16, 1, 10, 64, 0.3),
    "allpad": (8, 6, 40, 64, 1.0),
    "long20": (9, 20, 30, 96, 0.25),
    "onerow": (1, 4, 5, 127, 0.0),
}
# the widths the TileLang kernels are checked at (each width x dtype x id dtype x kind is one compile)
TILELANG_DIMS = (64, 96, 127)

# perf_tests/test_embedding_bag.py: name, B, V, D, L, dtypes
PERF_SHAPES = [
    ("B8192xV1MxD64xbag4", 8192, 1_000_000, 64, 4, ("fp16", "fp32")),
    ("B65536xV1MxD128xbag8", 65536, 1_000_000, 128, 8, ("fp16", "fp32")),
    ("B8192xV10MxD64xbag20", 8192, 10_000_000, 64, 20, ("fp16",)),
]
CPU_PERF_SHAPES = [("B256xV1000xD16xbag4", 256, 1000, 16, 4, ("fp32",))]
DISTS = ("uniform", "zipf")
PERF_PAD = 0.25
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def accuracy_ids(batch: int, bag: int, num_rows: int, pad: float, seed: int, dtype=torch.int64,
                 out_of_range: float = 0.1) -> torch.Tensor:
    """Ids in [1, V) with a fraction `pad` of padding (0) and `out_of_range` ids >= V or negative;
    row 0 is all padding when batch > 1 and the last row holds the largest id V-1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, max(num_rows, 2), (batch, bag), generator=g)
    u = torch.rand((batch, bag), generator=g)
    ids[u < pad] = 0
    oob = (u >= pad) & (u < pad + out_of_range)
    wild = torch.randint(num_rows, num_rows + 50, (batch, bag), generator=g)
    wild[torch.rand((batch, bag), generator=g) < 0.3] *= -1
    ids[oob] = wild[oob]
    if batch > 1:
        ids[0] = 0
    ids[-1, -1] = num_rows - 1
    return ids.to(dtype)


def weight(num_rows: int, dim: int, dtype, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, dim), generator=g).to(device=device, dtype=dtype)


def perf_ids(batch: int, num_rows: int, bag: int, dist: str, device, seed: int = 0) -> torch.Tensor:
    """"uniform": fixed bag length, each position padding with probability PERF_PAD, ids uniform in [1, V);
    "zipf": bag lengths uniform in [1, L] (the rest padding), ids log-uniform (P(id) ~ 1/id) scattered over
    the table by a multiplicative hash, so hot rows are not neighbours."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dist == "uniform":
        ids = torch.randint(1, num_rows, (batch, bag), generator=g, device=device)
        ids[torch.rand((batch, bag), generator=g, device=device) < PERF_PAD] = 0
        return ids
    u = torch.rand((batch, bag), generator=g, device=device, dtype=torch.float64)
    rank = torch.exp(u * torch.log(torch.tensor(float(num_rows - 1), dtype=torch.float64))).floor().to(torch.int64)
    ids = (rank * 1_000_003) % (num_rows - 1) + 1
    lengths = torch.randint(1, bag + 1, (batch, 1), generator=g, device=device)
    ids[torch.arange(bag, device=device)[None, :] >= lengths] = 0
    return ids


def perf_inputs(shape, dtype: str, dist: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, ids, grad_out) of one benchmark case, drawn on `device`."""
    _, batch, num_rows, dim, bag = shape
    g = torch.Generator(device=device).manual_seed(1)
    table = torch.randn((num_rows, dim), generator=g, device=device).to(_DTYPES[dtype])
    ids = perf_ids(batch, num_rows, bag, dist, device)
    grad_out = torch.randn((batch, dim), generator=g, device=device).to(_DTYPES[dtype])
    return table, ids, grad_out


def bytes_moved(table: torch.Tensor, ids: torch.Tensor, direction: str) -> int:
    """Distinct valid rows + ids + output (fwd); plus grad_out read, ids read and the COO values + indices
    written (fwd+bwd, B*L entries of fp32 values and int64 indices: our layout; the merge of duplicate rows
    after the kernel is not counted: a lower bound). fwd+bwd+adagrad (the sparse train path: forward, backward
    and an Adagrad step of the touched rows): fwd, grad_out read, each distinct row written and its accumulator
    read and written at the table's dtype (a lower bound: no gradient buffer, as FBGEMM's fused step has
    none)."""
    num_rows, dim = table.shape
    esize = table.element_size()
    # distinct rows: a row repeated within a call (Zipf ids) is read from DRAM once, then from L2; counting
    # every gathered row put cold cases above the copy ceiling, which now fails a case (timing.check_ceiling)
    valid = int(ids[(ids > 0) & (ids < num_rows)].unique().numel())
    fwd = valid * dim * esize + ids.numel() * ids.element_size() + ids.shape[0] * dim * esize
    if direction == "fwd":
        return fwd
    if direction == "fwd+bwd+adagrad":
        return fwd + ids.shape[0] * dim * esize + 3 * valid * dim * esize
    return fwd + ids.shape[0] * dim * esize + ids.numel() * (ids.element_size() + dim * 4 + 8)


def tilelang_variants() -> list[tuple]:
    """(kind, dim, weight dtype, ids dtype, vector width) of every TileLang kernel the suites use."""
    out = {(kind, dim, wdt, idt, vector_width(dim, wdt.itemsize, 0))
           for wdt in FLOAT_DTYPES for idt in ID_DTYPES for dim in TILELANG_DIMS
           for kind in ("fwd", "fwd_train", "bwd_sparse")}
    out |= {("bwd_dense", dim, wdt, idt, 1) for wdt in FLOAT_DTYPES for idt in ID_DTYPES for dim in TILELANG_DIMS}
    for _, _, _, dim, _, dtypes in PERF_SHAPES:
        wdts = [_DTYPES[d] for d in dtypes]
        out |= {(kind, dim, wdt, torch.int64, vector_width(dim, wdt.itemsize, 0)) for wdt in wdts
                for kind in ("fwd", "fwd_train", "bwd_sparse")}
    return sorted(out, key=str)
