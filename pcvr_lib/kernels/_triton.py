"""Triton plumbing shared by the operators: one kernel object that runs compiled on CUDA tensors and
under Triton's interpreter on CPU tensors when TRITON_INTERPRET=1.

Triton 3.x reads TRITON_INTERPRET when `@triton.jit` runs, i.e. at import, for our kernels and for
its own library functions (`tl.sum` is itself a jit function): a test that sets the variable later
would still get compiled kernels, and an interpreted kernel would fail on `tl.sum` ("Cannot call
@triton.jit'd outside of the scope of a kernel"). So `kernel(fn)` keeps the Python function and builds
the compiled JITFunction and the InterpretedFunction lazily, choosing per launch from the tensors'
device, and an interpreted launch swaps triton's library jit functions for interpreted ones for its
duration. Tests set the variable with monkeypatch (restored after each test), so nothing leaks.
"""

from __future__ import annotations

import contextlib
import functools

import torch


class DualKernel:
    def __init__(self, fn, do_not_specialize=()):
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled = None
        self._interpreted = None
        functools.update_wrapper(self, fn)

    @property
    def compiled(self):
        if self._compiled is None:
            from triton.runtime.jit import JITFunction

            self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
        return self._compiled

    @property
    def interpreted(self):
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def for_device(self, device: torch.device):
        return self.compiled if device.type == "cuda" else _Interpreted(self.interpreted)


class _Interpreted:
    """`kernel[grid](...)` through the interpreter, with triton's library jit functions interpreted."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with interpreted_triton_library():
                return self.fn[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def interpreted_triton_library():
    """Temporarily replace the JITFunctions of triton.language (sum, max, ...) by interpreted twins."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped = []
    for module in (tl, standard):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swapped.append((module, name, value))
                setattr(module, name, InterpretedFunction(value.fn))
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


class Launcher:
    """Launches one DualKernel with little host work per call.

    The first launch for a `key` goes through triton's JIT path (binding, specialisation, cache lookup,
    compile if needed), which returns the CompiledKernel; later launches with the same key call that
    kernel's launcher directly, the very call JITFunction.run ends with. The key must therefore pin
    everything triton specialises on: argument dtypes, 16-byte alignment of pointers and of integers
    that are not excluded (and whether they equal 1), constexprs and launch options. If the direct
    call fails (a triton version with another launcher signature), every later launch takes the JIT
    path and `fast_path_error` says why.
    """

    def __init__(self, dual: DualKernel):
        self.dual = dual
        self.compiled_by_key: dict = {}
        self.fast_path_error: str | None = None

    def __call__(self, key, grid: tuple[int, ...], args: tuple, num_warps: int, device: torch.device):
        if device.type != "cuda":
            return self.dual.for_device(device)[grid](*args, num_warps=num_warps)
        compiled = self.compiled_by_key.get(key)
        if compiled is not None and self.fast_path_error is None:
            try:
                return _direct_launch(compiled, grid, args, device)
            except TypeError as exc:  # launcher signature differs in this triton version
                self.fast_path_error = f"{type(exc).__name__}: {exc}"
        compiled = self.dual.compiled[grid](*args, num_warps=num_warps)
        self.compiled_by_key[key] = compiled
        return compiled


@functools.cache
def _triton_runtime():
    from triton import knobs
    from triton.runtime.driver import driver

    # torch's raw current-stream handle: triton's own getter builds a torch.cuda.Stream object per call
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or driver.active.get_current_stream
    return knobs.runtime, raw_stream


def _direct_launch(compiled, grid, args, device):
    runtime, current_stream = _triton_runtime()
    stream = current_stream(device.index)
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    meta = compiled.launch_metadata(grid, stream, *args) if enter is not None or exit_ is not None else None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, meta, enter, exit_, *args)
    return compiled


def align_key(*values) -> tuple:
    """What triton specialises on for tensors (16-byte alignment) and ints (multiple of 16, equal to 1)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append((v.dtype, v.data_ptr() % 16 == 0))
        else:
            out.append((v % 16 == 0, v == 1))
    return tuple(out)


def kernel(do_not_specialize=()):
    """Decorator: `@kernel(do_not_specialize=["M"])` instead of `@triton.jit`."""
    def wrap(fn):
        return DualKernel(fn, do_not_specialize)
    return wrap


@functools.cache
def sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # interpreter: a handful of programs is enough
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
