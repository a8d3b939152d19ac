"""The one Triton launcher every kernel uses: compiled on CUDA tensors, interpreted on CPU tensors.

`@kernel(do_not_specialize=[...])` replaces `@triton.jit`. It keeps the Python function and builds the
compiled JITFunction and the InterpretedFunction lazily, so one kernel object serves both. Triton 3.x reads
TRITON_INTERPRET when `@triton.jit` runs (at import), for our kernels and for its own library functions
(`tl.sum` is itself a jit function): a test that sets the variable later would still get compiled
kernels, and an interpreted kernel would fail on `tl.sum`. So the interpreter is chosen per launch from
the tensors' device, and an interpreted launch swaps triton's library jit functions for interpreted twins
for its duration. Tests set TRITON_INTERPRET with monkeypatch (the registry's gate for CPU tensors).

`Launcher(kernel, name)` launches one kernel with as little host work as triton allows:
- the first launch of a key goes through triton's JIT path (binding, specialisation, cache lookup,
  compile when needed), is timed (compile or disk-cache load, first launch included) into
  `compile_log`, and its CompiledKernel is kept;
- later launches with that key call the kept kernel's launcher directly, the very call `JITFunction.run`
  ends with: one dict lookup, one stream query, one foreign call.
The key is the caller's and must pin everything triton specialises on (argument dtypes, 16-byte
alignment of pointers and of the integers it does not exclude, constexprs, launch options) and the
device. Launch hooks (a profiler's) are honoured by the JIT path: a key first launched while a hook is
set is never cached, and `forget_compiled()` sends every later launch back through the JIT path once
(set a hook, then call it). If the direct call fails with a TypeError (a triton whose launcher takes
other arguments), the launcher uses the JIT path from then on and `fast_path_error` says why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

import torch

from pcvr_lib.kernels import compile_log

# torch's raw current-stream handle (an int): triton's own getter builds a torch.cuda.Stream per call
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_LAUNCHERS: list[Launcher] = []


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

    def compiled_variants(self) -> int:
        """How many binaries triton's JIT holds for this kernel in this process (all devices)."""
        if self._compiled is None:
            return 0
        return sum(len(cache[0]) for cache in self._compiled.device_caches.values())


def kernel(do_not_specialize=()):
    """Decorator: `@kernel(do_not_specialize=["M"])` instead of `@triton.jit`."""
    def wrap(fn):
        return DualKernel(fn, do_not_specialize)
    return wrap


def helper(fn):
    """Decorator for a device function our kernels call (`@helper` instead of `@triton.jit`): a JITFunction,
    which compiled kernels inline; an interpreted launch swaps it for its interpreted twin (see below)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


@contextlib.contextmanager
def interpreted_triton_library(kernel_globals: dict | None = None):
    """Temporarily replace the JITFunctions of triton.language (sum, max, ...) and those in the launched
    kernel's module namespace (`kernel_globals`: its @helper functions, own or imported, and the helpers in
    the namespaces of those helpers, transitively) by interpreted twins."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # an interpreted library call (InterpretedFunction.__call__) patches triton.language's builtins for the
    # interpreter and never restores them (triton 3.9): a later compile in this process would then fail
    # ("'value' object has no attribute 'dtype'"), so the namespaces it touches are restored here
    patched = (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)
    saved = [(ns, dict(vars(ns))) for ns in patched]
    swapped = []
    for module in (tl, standard):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swapped.append((module, name, value))
                setattr(module, name, InterpretedFunction(value.fn))
    # the helpers the kernel's module holds, and those their own modules hold (a helper may call helpers)
    namespaces = [kernel_globals] if kernel_globals is not None else []
    helpers = []  # (namespace, name, JITFunction)
    for ns in namespaces:
        for name, value in list(ns.items()):
            if isinstance(value, JITFunction):
                helpers.append((ns, name, value))
                ns[name] = InterpretedFunction(value.fn)
                if all(value.fn.__globals__ is not seen for seen in namespaces):
                    namespaces.append(value.fn.__globals__)
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)
        for ns, name, value in helpers:
            ns[name] = value
        for ns, before in saved:
            for name in [n for n, v in vars(ns).items() if n not in before and not inspect.ismodule(v)]:
                delattr(ns, name)
            for name, value in before.items():
                if vars(ns).get(name, None) is not value and name not in ("__dict__", "__weakref__"):
                    setattr(ns, name, value)


class Launcher:
    """Launches one DualKernel: `launcher(key, grid, args, num_warps, num_stages)`, grid a 3-tuple.

    `num_warps` and `num_stages` (None: triton's default) matter only on a key's first launch; pass them
    positionally. `jit(...)` launches through triton's JIT path without caching (for arguments the key
    cannot describe).
    """

    def __init__(self, dual: DualKernel, name: str):
        self.dual = dual
        self.name = name
        self.fast: dict = {}  # key -> (launcher, function handle, packed metadata, device index)
        self.fast_path_error: str | None = None
        _LAUNCHERS.append(self)

    def __call__(self, key, grid, args, num_warps, num_stages=None):
        hit = self.fast.get(key)
        if hit is not None:
            run, function, packed, device = hit
            try:
                return run(grid[0], grid[1], grid[2], _raw_stream(device), function, packed, None, None, None,
                           *args)
            except TypeError as exc:  # this triton's launcher takes other arguments: JIT path from now on
                self.fast_path_error = f"{type(exc).__name__}: {exc}"
                self.fast.clear()
        return self._first(key, grid, args, num_warps, num_stages)

    def _first(self, key, grid, args, num_warps, num_stages):
        if not args[0].is_cuda:
            return self.jit(grid, args, num_warps, num_stages)
        t0 = time.perf_counter()
        compiled = self.jit(grid, args, num_warps, num_stages)
        if not torch.cuda.is_current_stream_capturing():  # (a CUDA graph capture forbids synchronising)
            torch.cuda.synchronize()
        compile_log.record("triton", (self.name, *key), time.perf_counter() - t0)
        if self.fast_path_error is None and _raw_stream is not None and not _hooks_set():
            self.fast[key] = (compiled.run, compiled.function, compiled.packed_metadata, torch.cuda.current_device())
        return compiled

    def jit(self, grid, args, num_warps, num_stages=None):
        """One launch through triton's JIT path (compiled on CUDA tensors, interpreted on CPU tensors)."""
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if args[0].is_cuda:
            return self.dual.compiled[grid](*args, **options)
        with interpreted_triton_library(self.dual.fn.__globals__):
            return self.dual.interpreted[grid](*args, **options)

    def path(self) -> str:
        """How cached keys launch: "direct", or the reason they take the JIT path."""
        return self.fast_path_error or "direct"


def _hook_active(hook) -> bool:
    """A launch hook that would run: newer triton keeps an always-present HookChain, empty unless a tool
    added a hook to it (`is not None` alone made every key uncacheable there: all launches took the JIT path)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    from triton import knobs

    return _hook_active(knobs.runtime.launch_enter_hook) or _hook_active(knobs.runtime.launch_exit_hook)


def forget_compiled() -> None:
    """Drop every launcher's direct-launch cache: the next launch of each key takes triton's JIT path (and
    calls launch hooks set since)."""
    for launcher in _LAUNCHERS:
        launcher.fast.clear()


def align_key(*values) -> tuple:
    """What triton specialises on for tensors (16-byte alignment) and ints (multiple of 16, equal to 1)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append((v.dtype, v.data_ptr() % 16 == 0))
        else:
            out.append((v % 16 == 0, v == 1))
    return tuple(out)


@functools.cache
def sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # interpreter: a handful of programs is enough
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv costs microseconds per call on the host)


def launch_paths() -> dict[str, str]:
    """Every launcher's path for cached keys: {kernel name: "direct" or why the JIT path is used}."""
    return {launcher.name: launcher.path() for launcher in _LAUNCHERS}


def compiled_variants(prefix: str) -> int:
    """Binaries triton's JIT holds for the launched kernels whose name starts with `prefix` (e.g. "rms_norm"):
    a recompilation the launchers' keys missed would show here."""
    return sum(launcher.dual.compiled_variants() for launcher in _LAUNCHERS if launcher.name.startswith(prefix))
