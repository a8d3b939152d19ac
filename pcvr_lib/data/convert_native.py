"""The converter's native kernels: build and load convert_native.c (the "native" backend).

numpy needs ~6 passes over every [B, L] block (gather, clamp, cast, pad mask, OOB compare, fix) plus
Python work per column; the C loops do one fused pass per sequence column (gather, token rules, int32
store, padding), reading the Arrow buffers directly, one call per batch (pcvr_convert_batch: the
RecordBatch exported through the Arrow C data interface, no Python per column; the list-order check fused
into each domain's row loop). The source is convert_native.c beside this file; it is compiled on first use
with the system C compiler into the data cache directory (keyed by source, flags and CPU) and loaded with
ctypes. backend="numpy" never uses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pcvr_lib.data.generate import default_cache_dir

NATIVE_SOURCE = Path(__file__).with_name("convert_native.c")
_NATIVE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
_native_state: dict = {}
ArrowArrayStruct = ctypes.c_byte * 80  # sizeof(struct ArrowArray) of the Arrow C data interface


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _cpu_id() -> str:
    """The CPU model and feature flags (part of the build key: -march=native code is CPU specific)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))  # first model name and flags lines, once each
    except OSError:
        return platform.processor()


def native_library():
    """The compiled kernels (ctypes.CDLL), building them on first use; raises NativeUnavailable."""
    if "lib" in _native_state:
        return _native_state["lib"]
    if "error" in _native_state:
        raise NativeUnavailable(_native_state["error"])
    folder = default_cache_dir() / "native"  # a bad PCVR_CACHE_DIR is the user's error, not a reason to fall back
    try:
        _native_state["lib"] = _build_native(folder)
    except Exception as exc:  # no compiler, failed build, unloadable library
        _native_state["error"] = f"{type(exc).__name__}: {exc}"
        raise NativeUnavailable(_native_state["error"]) from exc
    return _native_state["lib"]


def _build_native(folder: Path):
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc/gcc) on PATH")
    source_text = NATIVE_SOURCE.read_text()
    key = hashlib.sha256(
        "\n".join([source_text, " ".join(_NATIVE_FLAGS), compiler, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pcvr_convert_{key}.so"
    if not path.exists():
        source = folder / f"pcvr_convert_{key}.c"
        source.write_text(source_text)  # the exact text hashed, beside the library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *_NATIVE_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120
            )
            if done.returncode:
                raise NativeUnavailable(f"{compiler} failed: {done.stderr.strip()[:500]}")
            os.replace(tmp, path)  # atomic: concurrent builders (DataLoader workers) agree
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pcvr_list_order.argtypes = [i64, p, p, i64, p, p]
    lib.pcvr_list_order.restype = None
    lib.pcvr_convert_batch.argtypes = [p, p, p, p, p, i64, i64, i64, p, p, p, p]
    lib.pcvr_convert_batch.restype = i64
    lib.pcvr_release.argtypes = [p]
    lib.pcvr_release.restype = None
    return lib
