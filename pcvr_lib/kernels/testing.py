"""Helpers for kernel correctness checks: poisoned outputs and seeded inputs.

A kernel that forgets to write part of its output must fail its check, so outputs are poisoned before
each run: `poisoned_outputs()` makes `torch.empty*` fill new float tensors with NaN (and integer ones
with their largest value) on every device, and `poison_cuda_allocator()` fills the CUDA caching
allocator's free blocks with all-ones bytes (NaN in fp16/bf16/fp32, -1 in integers), which also catches
buffers that never pass through `torch.empty`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys

import torch


def poison_cuda_allocator(device=None, large_bytes: int = 256 << 20, small_blocks: int = 32) -> None:
    """Fill free memory of the CUDA caching allocator with 0xFF bytes (NaN for floats).

    Frees the cache first, then allocates one large block (served to later large allocations, which
    split it) and `small_blocks` blocks of 1 MiB (the small-allocation pool), fills them, and frees
    them back to the cache. No-op for a CPU device or without CUDA.
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():  # CPU tensors: torch.empty's fill suffices
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    big = torch.empty(min(large_bytes, free // 4), dtype=torch.uint8, device=device).fill_(0xFF)
    small = [torch.empty(1 << 20, dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(small_blocks)]
    torch.cuda.synchronize(device)
    del big, small  # back to the cache, still holding 0xFF


@contextlib.contextmanager
def poisoned_outputs(device=None):
    """Within the block, newly allocated tensors start as NaN / max-int instead of stale memory."""
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    poison_cuda_allocator(device)
    # fill_uninitialized_memory acts only while deterministic mode is on; warn_only keeps
    # nondeterministic ops (e.g. atomics in index_add) usable instead of raising.
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


def generator(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype: torch.dtype, device, seed: int, *, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (identical on every device), then moved and cast."""
    t = torch.randn(tuple(shape), generator=generator(seed), dtype=torch.float32) * scale + shift
    return t.to(device=device, dtype=dtype)


def fp64(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Detached fp64 CPU copies, the inputs of every reference computation."""
    return tuple(t.detach().to(device="cpu", dtype=torch.float64) for t in tensors)


def grad_input_term_scale(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float,
                          centered: bool) -> float:
    """RMS of dy * weight / std(x): the size of the terms whose difference is a norm's input gradient.

    Rounding error in dx scales with these terms, not with dx itself, which can cancel to ~0 (one
    element per row, constant rows): the tolerance of dx is taken relative to this.
    """
    xd, wd, gd = x.detach().double(), weight.detach().double(), dy.detach().double()
    if centered:
        xd = xd - xd.mean(-1, keepdim=True)
    inv_std = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return float((gd * wd * inv_std).pow(2).mean().sqrt())


def grad_param_term_scale(dy: torch.Tensor) -> float:
    """rms(dy) * sqrt(rows): the size of a weight/bias gradient, a sum over rows of dy times a
    normalised input of order one (the reference can be exactly 0 where the fp32 result is rounding)."""
    gd = dy.detach().double()
    rows = gd.numel() // max(1, gd.shape[-1])
    return float(gd.pow(2).mean().sqrt()) * rows ** 0.5


_LOOP_BOUND_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def probe(X, n, B: tl.constexpr):
    acc = 0
    for i in range(0, n, B):
        acc += 1
    tl.store(X, acc)
x = torch.zeros(1, dtype=torch.int32)
probe[(1,)](x, 40, 16)
assert int(x) == 3, int(x)
"""


@functools.cache
def triton_interpreter_problem() -> str | None:
    """Why this triton's interpreter cannot run our kernels, or None. Probed in a child process (the
    interpreter is chosen when triton is imported): triton 3.6's interpreter passes scalar arguments as
    1-element arrays, so a loop bounded by a runtime argument fails ("only 0-dimensional arrays can be
    converted to Python scalars"); triton 3.9's works."""
    proc = subprocess.run([sys.executable, "-c", _LOOP_BOUND_PROBE], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    import triton

    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return f"triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound ({last[:160]})"


# aten ops whose result a CUDA device must hand to the host (an implicit device-to-host sync there)
HOST_READ_OPS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique_dim",
                           "_unique", "_unique2", "unique_consecutive", "unique_dim_consecutive", "item",
                           "repeat_interleave"})


def host_read(func, args, kwargs) -> str | None:
    """What an aten call reads back from the device to the host (a device-to-host sync on CUDA), or None:
    one of `HOST_READ_OPS`, indexing by a boolean mask, or a copy from a CUDA tensor to the CPU."""
    name = func._schema.name.split("::")[-1]
    if name in HOST_READ_OPS:
        return name
    if name in ("index", "index_put", "index_put_") and _boolean_index(args):
        return f"{name} by a boolean mask"
    if name in ("_to_copy", "copy_") and _cuda_to_cpu(func, args, kwargs):
        return f"{name} to cpu"
    return None


@contextlib.contextmanager
def count_host_reads():
    """Within the block, record every aten op that reads device values back to the host (`host_read`: .item(),
    bool()/int()/float() of a tensor, nonzero, masked_select, unique, repeat_interleave of a tensor; indexing by a
    boolean mask; copies from a CUDA tensor to the CPU). Yields the list of their names. It sees the ops of CPU
    tensors too, where torch.cuda.set_sync_debug_mode sees only CUDA ones (`tolist()` of a CPU tensor calls no
    op: on CUDA it is a copy to the CPU, caught there)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            read = host_read(func, args, kwargs or {})
            if read is not None:
                reads.append(read)
            return func(*args, **(kwargs or {}))

    with _Mode():
        yield reads


def graph_host_reads(graph_module) -> list[str]:
    """`host_read` for the aten ops of a traced graph (an AOTAutograd forward or backward graph, whose nodes
    carry fake tensors as `meta["val"]`): the names of the nodes that would read the device from the host."""
    from torch.fx.node import map_arg

    reads = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        args, kwargs = map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
        read = host_read(node.target, args, kwargs)
        if read is not None:
            reads.append(f"{node.name}: {read}")
    return reads


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def _cuda_to_cpu(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name == "_to_copy":
        src, device = args[0], kwargs.get("device")
        return src.is_cuda and device is not None and torch.device(device).type == "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and src.is_cuda and not dst.is_cuda
