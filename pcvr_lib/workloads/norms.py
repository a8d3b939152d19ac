"""The norm workload (RMSNorm and LayerNorm): the shapes the accuracy tests and the benchmarks run, their
inputs, their fp64 results (from pcvr_lib.kernels.norms.reference), the bytes a case must move, and the
TileLang kernels those shapes need (the manifest `python -m pcvr_lib.precompile` builds).
"""

from __future__ import annotations

import torch

from pcvr_lib.kernels.norms.reference import layer_norm_reference, rms_norm_reference
from pcvr_lib.kernels.testing import randn

EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}
# accuracy_tests/test_norms.py: odd widths (padding paths), one row, leading dims in every dtype; big rows
# in fp16/bf16 on a GPU; one width for the row-count test (fp16) and one for the NaN-row test (fp32)
ACCURACY_SHAPES = [(1, 96), (3, 127), (5, 385), (2, 3, 400), (33, 128), (4, 1)]
GPU_SHAPES = [(4097, 1024), (3, 16384), (1000, 4096), (2, 2, 8192, 128)]
RECOMPILE_WIDTH = 333
NAN_WIDTH = 200
# perf_tests/test_norms.py: the reference's shape first, then the large ones of h200-peers.md
PERF_SHAPES = [(8192, 128), (65536, 1024), (262144, 128), (16384, 4096)]
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
TILELANG_KINDS = ("fwd_infer", "fwd_train", "bwd")


def accuracy_widths() -> list[int]:
    return sorted({s[-1] for s in ACCURACY_SHAPES})


def inputs(op: str, shape, dtype: torch.dtype, device, seed: int = 0, requires_grad: bool = False,
           draw_on_device: bool = False):
    """[x, weight(, bias)]: x ~ 2 N(0,1) + 0.3, weight ~ 0.5 N(0,1) + 1, bias ~ 0.5 N(0,1), from `seed`:
    drawn on the CPU (the same values on every device), or with `draw_on_device` by the device's generator
    (the benchmarks' large shapes: seconds faster)."""
    width = shape[-1]
    if draw_on_device:
        g = torch.Generator(device=device).manual_seed(seed)

        def draw(size, scale, shift):
            return (torch.randn(size, device=device, generator=g) * scale + shift).to(dtype)
    else:
        def draw(size, scale, shift):
            seed_i = seed + len(tensors)
            return randn(size, dtype, device, seed_i, scale=scale, shift=shift)
    tensors = []
    tensors.append(draw(tuple(shape), 2.0, 0.3))
    tensors.append(draw((width,), 0.5, 1.0))
    if op == "layer_norm":
        tensors.append(draw((width,), 0.5, 0.0))
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors


def grad_output(shape, dtype: torch.dtype, device, seed: int = 4321) -> torch.Tensor:
    """dy ~ N(0, 1), drawn by the device's generator. Zero mean matters: dbias sums dy over every row, and a
    shifted draw (0.3 per element) overflows fp16 at 262144 rows (0.3 x 262144 > 65504) for every backend."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), device=device, generator=g).to(dtype)


def reference(op: str, tensors, grad_out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[y] in fp64, and with `grad_out` also the fp64 gradients of every input (same device)."""
    ref_inputs = [t.detach().double().requires_grad_(grad_out is not None) for t in tensors]
    fn = rms_norm_reference if op == "rms_norm" else layer_norm_reference
    y = fn(*ref_inputs, EPS[op])
    if grad_out is None:
        return [y.detach()]
    return [y.detach(), *torch.autograd.grad(y, ref_inputs, grad_out.double())]


def bytes_moved(op: str, shape, dtype: torch.dtype, direction: str) -> int:
    """Fewest bytes: fwd reads x and writes y; fwd+bwd adds reading dy and x, writing dx (5 passes)."""
    rows, width = shape
    elem = torch.finfo(dtype).bits // 8
    passes = 2 if direction == "fwd" else 5
    n_params = 1 if op == "rms_norm" else 2
    return passes * rows * width * elem + n_params * width * elem * (1 if direction == "fwd" else 2)


def tilelang_variants(op: str) -> list[tuple]:
    """(kind, width, dtype) of every TileLang kernel the suites use for `op`."""
    out = set()
    for kind in TILELANG_KINDS:
        out.update((kind, w, dt) for w in accuracy_widths() for dt in FLOAT_DTYPES)
        widths = {s[-1] for s in GPU_SHAPES} | {s[-1] for s in PERF_SHAPES}
        out.update((kind, w, dt) for w in widths for dt in HALF_DTYPES)
        out.add((kind, RECOMPILE_WIDTH, torch.float16))
    out.add(("fwd_infer", NAN_WIDTH, torch.float32))
    return sorted(out, key=str)
