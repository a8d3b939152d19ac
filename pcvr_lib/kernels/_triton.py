"""Triton plumbing shared by the operators: one kernel object that runs compiled on CUDA tensors and
under Triton's interpreter on CPU tensors when TRITON_INTERPRET=1.

Triton decides between the two when `@triton.jit` runs (at import), so a test that sets the variable
afterwards would still get the compiled kernel. `kernel(fn)` therefore keeps the Python function and
builds the compiled JITFunction and the InterpretedFunction lazily, choosing per launch from the
tensors' device; the variable itself is read by triton during interpretation, so tests set it with
monkeypatch (restored after each test) and nothing leaks.
"""

from __future__ import annotations

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
        return self.compiled if device.type == "cuda" else self.interpreted


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
