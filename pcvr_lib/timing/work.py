"""Counted work per call of a GPU case: exact numbers that gate host regressions at zero tolerance.

Host time moves by tens of percent between two processes on a shared host (31-94% per group between two
runs minutes apart on the lent H200 host, notes/comparison.md), so a stored-run comparison cannot gate on
it. What a call does on the host can be counted instead, once per case, outside the timed loop, after
warm-up calls (caches filled, lazy imports done, autotuning over):

  python_calls  Python functions entered and C functions called from Python during one call (sys.setprofile's
                "call" and "c_call" events; on Python >= 3.12 in every thread but those Python's threading
                module started, so the autograd engine's device thread, which runs a CUDA backward, is
                counted too; on 3.11 the calling thread only)
  torch_ops     aten ops dispatched during one call (a TorchDispatchMode; the autograd engine carries it into
                the backward). Code compiled with torch.compile runs eagerly for this count
                (`torch.compiler.set_stance("force_eager")`): a dispatch mode cannot run inside a compiled graph,
                and without the stance dynamo drops the function's compiled code for good (torch 2.11 silently, so
                every later call ran eagerly; 2.13 raises on the next call). So for a compiled call this counts
                the ops of its eager form: exact and stable, which is what the gate needs, but not what the
                compiled call dispatches
  host_reads    those of them that read device values back to the host: on CUDA each one is a sync
                (kernels.testing.host_read: .item(), nonzero, unique, boolean-mask indexing, copies to the CPU)
  launches      CUDA only: kernels, copies and memsets the GPU ran per call (the profiler's device events
                over `calls` calls, divided by `calls`)

Each count is taken for `calls` calls separately (launches: over all of them); a count that differs between
them is not a count of the call's work and is recorded under "unstable" instead (never gated). The garbage
collector is off while counting (its finalizers would run at arbitrary calls).
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
from collections.abc import Callable

COUNTS = ("python_calls", "torch_ops", "host_reads", "launches")
WORK_CALLS = 2  # calls counted one by one (their counts must agree)
WORK_WARMUP = 1  # calls before counting (the case has been called many times by its timing already)
_CALL_EVENTS = frozenset({"call", "c_call"})
_SET_PROFILE_ALL = getattr(threading, "setprofile_all_threads", None)  # Python >= 3.12
PYTHON_CALLS_SCOPE = "all threads" if _SET_PROFILE_ALL is not None else "calling thread"


def _noop() -> None:
    return None


def _other_python_threads() -> frozenset[int]:
    """Idents of the threads Python's threading module started, this one excepted (a test runner's I/O thread, a
    timer): their work is no part of the call. Threads started in C++ (the autograd engine's) are not among them."""
    here = threading.get_ident()
    return frozenset(t.ident for t in threading.enumerate()
                     if t.ident is not None and t.ident != here and not isinstance(t, threading._DummyThread))


def _raw_python_calls(fn: Callable[[], object]) -> int:
    counter = itertools.count()  # next() is one C call: no Python frame of its own, safe across threads
    others = _other_python_threads()
    ident = threading.get_ident

    def on_event(frame, event, arg):
        if event in _CALL_EVENTS and ident() not in others:
            next(counter)

    set_profile = _SET_PROFILE_ALL or sys.setprofile
    set_profile(on_event)
    try:
        fn()
    finally:
        set_profile(None)
    return next(counter)


def python_calls(fn: Callable[[], object]) -> int:
    """Python and C function calls made during one call of `fn` (those of an empty call subtracted, so the
    profiler's own switching cancels out)."""
    if sys.getprofile() is not None:
        raise RuntimeError("another profiler (sys.setprofile) is active: Python calls cannot be counted")
    return _raw_python_calls(fn) - _raw_python_calls(_noop)


def torch_ops(fn: Callable[[], object]) -> tuple[int, int]:
    """(aten ops dispatched, host reads among them) during one call of `fn`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pcvr_lib.kernels.testing import host_read

    counts = [0, 0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            counts[0] += 1
            if host_read(func, args, kwargs) is not None:
                counts[1] += 1
            return func(*args, **kwargs)

    import torch

    with torch.compiler.set_stance("force_eager"), _Count():
        fn()
    return counts[0], counts[1]


def device_launches(fn: Callable[[], object], calls: int) -> int:
    """Kernels, copies and memsets the GPU ran over `calls` calls of `fn` (the profiler's device events; GPU-side
    user annotations left out, as in the device-time kernel sums)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pcvr_lib.timing.clocks import is_kernel_event

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(1 for evt in prof.events() if is_kernel_event(evt))


def count_work(fn: Callable[[], object], *, cuda: bool, calls: int = WORK_CALLS, warmup: int = WORK_WARMUP) -> dict:
    """The counted work of one call of `fn` (module docstring): {count: per call, ..., "calls_counted",
    "python_calls_scope", "unstable": {count: per-call values} when some count differed between the calls}.
    `cuda`: also count the device's launches (the calls run on the current CUDA device)."""
    for _ in range(warmup):
        fn()
    if cuda:
        import torch

        torch.cuda.synchronize()
    seen: dict[str, list[int]] = {"python_calls": [], "torch_ops": [], "host_reads": []}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(calls):
            seen["python_calls"].append(python_calls(fn))
            ops, reads = torch_ops(fn)
            seen["torch_ops"].append(ops)
            seen["host_reads"].append(reads)
        launches = device_launches(fn, calls) if cuda else None
    finally:
        if collecting:
            gc.enable()
    work: dict = {"calls_counted": calls, "python_calls_scope": PYTHON_CALLS_SCOPE}
    unstable = {name: values for name, values in seen.items() if len(set(values)) > 1}
    work.update({name: values[0] for name, values in seen.items() if name not in unstable})
    if launches is not None:
        if launches % calls:
            unstable["launches"] = [launches / calls]
        else:
            work["launches"] = launches // calls
    if unstable:
        work["unstable"] = unstable
    return work
