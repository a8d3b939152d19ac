"""Loader of the `cuembed` backend: cuembed.cu built at first use with torch.utils.cpp_extension.load.

The library holds no torch code (only the CUDA runtime), so the build is one short nvcc call, and it is
called through ctypes with raw pointers and the current stream: one foreign call per forward. The build
directory is cached under $PCVR_CACHE_DIR (default ~/.cache/pcvr) by source hash and GPU architecture,
so later processes only load it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

from .. import compile_log

SOURCE = Path(__file__).with_name("cuembed.cu")
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LOCK = threading.Lock()
_LIB: dict[int, ctypes.CDLL] = {}  # device capability as 10*major+minor -> loaded library
_DEVICE_LIB: dict[int, object] = {}  # device index -> the library's launch function (per-call lookup)


def unavailable_reason() -> str | None:
    """Why cuembed cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "cuembed: no CUDA device"
    if torch.version.cuda is None:
        return "cuembed: this torch build has no CUDA support"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "cuembed: no CUDA toolkit (nvcc not found, CUDA_HOME unset)"
    return None


def _cache_root() -> Path:
    root = os.environ.get("PCVR_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pcvr"


def _arch_flags(cc: int) -> list[str]:
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def _library(device: torch.device) -> ctypes.CDLL:
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    lib = _LIB.get(cc)
    if lib is not None:
        return lib
    with _LOCK:
        if cc in _LIB:
            return _LIB[cc]
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
        name = f"pcvr_cuembed_{digest}_sm{cc}"
        build_dir = _cache_root() / "cuembed" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        path = load(
            name=name,
            sources=[str(SOURCE)],
            extra_cuda_cflags=["-O3", "-lineinfo", *_arch_flags(cc)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        compile_log.record("cuembed", ("embedding_bag_mean.build", cc), time.perf_counter() - t0)
        lib = ctypes.CDLL(str(path))
        lib.pcvr_embag_mean_fwd.restype = ctypes.c_int
        lib.pcvr_embag_mean_fwd.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
        ]
        lib.pcvr_embag_error_string.restype = ctypes.c_char_p
        lib.pcvr_embag_error_string.argtypes = [ctypes.c_int]
        _LIB[cc] = lib
        return lib


def forward(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    num_rows, dim = weight.shape
    batch, bag = ids.shape
    dev = weight.get_device()
    launch = _DEVICE_LIB.get(dev)
    if launch is None:
        launch = _DEVICE_LIB[dev] = _library(weight.device).pcvr_embag_mean_fwd
    out = weight.new_empty((batch, dim))
    wp, op = weight.data_ptr(), out.data_ptr()
    vec16 = (dim * weight.element_size()) % 16 == 0 and wp % 16 == 0 and op % 16 == 0
    rc = launch(_DTYPE_CODE[weight.dtype], ids.dtype == torch.int64, vec16, wp, ids.data_ptr(), op, batch, bag,
                num_rows, dim, torch._C._cuda_getCurrentRawStream(dev))
    if rc != 0:
        lib = _LIB[10 * torch.cuda.get_device_capability(dev)[0] + torch.cuda.get_device_capability(dev)[1]]
        raise RuntimeError(f"cuembed: kernel launch failed: {lib.pcvr_embag_error_string(rc).decode()}")
    return out


def compile_for_sm90(out_dir: Path) -> float:
    """Compile cuembed.cu to an sm_90 object with nvcc (no GPU needed); returns the seconds it took.

    Used by the CPU tests to prove the source builds for the H200 without a device."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("cuembed: nvcc not found")
    t0 = time.perf_counter()
    subprocess.run([nvcc, "-c", "-O3", *_arch_flags(90), str(SOURCE), "-o", str(Path(out_dir) / "cuembed.o")],
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - t0
