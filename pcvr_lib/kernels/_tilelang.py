"""The one TileLang runtime every kernel uses: target choice, one compile cache, the direct executable.

- `arch(device, arch_specific)` is the one architecture rule: the device's sm_XY (sm_90 without a device,
  the H200's, for compile-only checks and precompiling on a CPU machine), with Hopper's arch-specific
  "a" variant (sm_90a: wgmma, register reallocation) only for kernels that ask for it (attention).
- `kernel(key, build, arch, pass_configs)` compiles `build()` (a prim_func) once per (key, arch) in this
  process and records the seconds in `compile_log` (compile, or load from TileLang's disk cache,
  TILELANG_CACHE_DIR, default ~/.tilelang/cache: a second process only loads).
- `launcher(key, build, device, ...)` is what a launch calls: the TVM-FFI executable of that kernel (it
  checks ranks, dtypes and static dims and launches on torch's current stream), skipping the JITKernel
  wrapper's per-call Python work (about a third of the host time of a call through JITKernel.__call__).
  Callers look `LAUNCHERS[key + (device index,)]` up first and call this only on a miss.
The compile arguments (target dict, out_idx, execution backend, pass configs) are part of TileLang's disk
cache key: they are the ones the kernels were always compiled with, so a cache built before stays valid.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from pcvr_lib.kernels import compile_log

DEFAULT_ARCH = "sm_90"  # the H200's, when there is no device to ask
_KERNELS: dict[tuple, object] = {}
LAUNCHERS: dict[tuple, Callable] = {}
_TORCH_TO_TL = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.int32: "int32", torch.int64: "int64"}


def tl_dtype(dtype: torch.dtype) -> str:
    return _TORCH_TO_TL[dtype]


def arch(device: torch.device | None = None, arch_specific: bool = False, base: str | None = None) -> str:
    """sm_XY of `device` (or `base`, e.g. "sm_90a" from the command line, or DEFAULT_ARCH), plus "a" on
    Hopper when `arch_specific` (and never otherwise: the norms' and embedding's cache entries are sm_90)."""
    if base is None:
        base = _device_arch(device.index if device.index is not None else -1) \
            if device is not None and device.type == "cuda" else DEFAULT_ARCH
    base = base.removesuffix("a")
    return base + "a" if arch_specific and base == "sm_90" else base


@functools.cache
def _device_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(None if index < 0 else index)
    return f"sm_{major}{minor}"


def kernel(key: tuple, build: Callable[[], object], arch: str, pass_configs: dict | None = None):
    """The compiled JITKernel for `key` on `arch`, compiling `build()` on first use (key[0]: kernel name)."""
    full_key = (*key, arch)
    compiled = _KERNELS.get(full_key)
    if compiled is None:
        import tilelang

        t0 = time.perf_counter()
        compiled = tilelang.compile(build(), out_idx=None, target={"kind": "cuda", "arch": arch},
                                    execution_backend="tvm_ffi", pass_configs=pass_configs)
        compile_log.record("tilelang", full_key, time.perf_counter() - t0)
        _KERNELS[full_key] = compiled
    return compiled


def launcher(key: tuple, build: Callable[[], object], device: torch.device, arch_specific: bool = False,
             pass_configs: dict | None = None) -> Callable:
    """The direct-call executable of `kernel(key, ...)` for `device`, kept in LAUNCHERS[(*key, index)]."""
    compiled = kernel(key, build, arch(device, arch_specific), pass_configs)
    adapter = getattr(compiled, "adapter", None)
    launch = adapter.get_exportable_executable() if hasattr(adapter, "get_exportable_executable") else compiled
    LAUNCHERS[(*key, device.index)] = launch
    return launch


class Kernels:
    """One op's TileLang kernels: `builders` maps a kernel name ("rms_norm.bwd") to a function of the
    variant (torch dtypes arrive as TileLang names) returning the prim_func.

    `compile((name, *variant), arch)` compiles one without a device (precompile; `arch` normalised by the
    rule above); `first((name, *variant, device index), device)` is a launch key's first call, returning
    the executable it caches in LAUNCHERS. `pass_configs(key)` gives TileLang pass options per variant.
    """

    def __init__(self, builders: dict[str, Callable], arch_specific: bool = False,
                 pass_configs: Callable[[tuple], dict | None] = lambda key: None):
        self.builders = builders
        self.arch_specific = arch_specific
        self.pass_configs = pass_configs

    def build(self, key: tuple) -> Callable[[], object]:
        name, *variant = key
        args = [tl_dtype(v) if isinstance(v, torch.dtype) else v for v in variant]
        return lambda: self.builders[name](*args)

    def compile(self, key: tuple, arch_name: str):
        return kernel(key, self.build(key), arch(base=arch_name, arch_specific=self.arch_specific),
                      self.pass_configs(key))

    def first(self, key: tuple, device: torch.device) -> Callable:
        return launcher(key[:-1], self.build(key[:-1]), device, self.arch_specific, self.pass_configs(key[:-1]))


def lower_cuda(program, target: dict, pass_configs: dict | None = None) -> str:
    """The CUDA source TileLang lowers a prim_func to for `target` (no nvcc, no device)."""
    import tilelang
    import tvm

    with tvm.transform.PassContext(config=pass_configs or {}), tvm.target.Target(target):
        return tilelang.lower(program, target=target).kernel_source


def nvcc_cubin_bytes(sources: list[str], arch: str) -> int:
    """Compile lowered TileLang CUDA sources for `arch` with one nvcc invocation (one header parse); returns the
    cubin's size, or raises RuntimeError with nvcc's errors."""
    import os
    import subprocess
    import tempfile

    import tilelang

    root = os.path.dirname(tilelang.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.cubin")
        with open(cu, "w") as f:
            f.write("\n".join(sources))
        cmd = ["nvcc", "--cubin", "-O3", f"-arch={arch}", "-std=c++20", f"-I{root}/src",
               f"-I{root}/3rdparty/cutlass/include", "-o", cubin, cu]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"nvcc failed ({result.returncode}): " + "\n".join(errors[:10]))
        return os.path.getsize(cubin)
