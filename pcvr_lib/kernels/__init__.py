"""GPU operators with explicit backends ("torch", "triton", "tilelang", "cuembed").

Each operator lives in its own package; the names below are imported lazily so that importing one
operator never requires the others (or triton / tilelang) to be importable.
"""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "rms_norm": "pcvr_lib.kernels.rms_norm",
    "layer_norm": "pcvr_lib.kernels.layer_norm",
    "embedding_bag_mean": "pcvr_lib.kernels.embedding_bag",
    "flash_attention": "pcvr_lib.kernels.attention",
    "key_lengths_from_mask": "pcvr_lib.kernels.attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


def make_module_callable(module_name: str, fn) -> None:
    """Importing the subpackage `pcvr_lib.kernels.<op>` binds that name on `pcvr_lib.kernels` to the module,
    shadowing the function of the same name; after this, calling the module calls `fn`, so
    `from pcvr_lib.kernels import <op>` works whichever of the two it finds."""

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
