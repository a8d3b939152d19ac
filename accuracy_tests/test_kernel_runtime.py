"""The shared kernel runtime: the Triton launcher's hot path, the TileLang arch rule, compile_log, and the
precompile command's manifests. CPU only (fake kernels); the GPU paths are exercised by every kernel test.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pcvr_lib.kernels import _tilelang, _triton, compile_log, precompile


def _fake_launcher(monkeypatch):
    """A Launcher whose key (7,) is cached with a fake compiled kernel; returns (launcher, calls)."""
    calls = []

    def fake_run(*args):
        calls.append(args)

    launcher = _triton.Launcher(_triton.DualKernel(lambda: None), "fake.kernel")
    launcher.fast[(7,)] = (fake_run, "function", "packed", 0)
    monkeypatch.setattr(_triton, "_raw_stream", int)  # a C builtin like torch's raw-stream getter
    return launcher, calls


def _python_calls(fn) -> list[str]:
    """Names of the Python-level functions `fn()` enters (builtins and C methods are not counted)."""
    names = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names[1:]  # drop fn itself


def _old_embedding_launch(compiled, raw_run, stream, name, kernel, grid, args, key, num_warps):
    """The embedding's direct path before the shared launcher (baa6a65), for the call count comparison."""
    ck = compiled.get(key)
    if ck is not None:
        if raw_run[0]:
            try:
                ck.run(grid, 1, 1, stream(args[0].get_device()), ck.function, ck.packed_metadata, None, None,
                       None, *args)
                return
            except TypeError:
                raw_run[0] = False


def test_direct_launch_is_one_python_call(monkeypatch):
    """A cached key costs one Python frame (Launcher.__call__) besides the kernel's own launcher: no
    more than the embedding's old direct path (its function and a stream helper) or attention's (_launch)."""
    launcher, calls = _fake_launcher(monkeypatch)
    x = torch.zeros(4)
    names = _python_calls(lambda: launcher((7,), (3, 2, 1), (x, 5), 4))
    assert names == ["__call__", "fake_run"]
    assert calls[0][:6] == (3, 2, 1, 0, "function", "packed") and calls[0][9:] == (x, 5)

    class Compiled:
        function, packed_metadata = "function", "packed"

        def run(self, *args):
            calls.append(args)

    def stream(device):
        return 0

    old = _python_calls(lambda: _old_embedding_launch({(7,): Compiled()}, [True], stream, "fwd", None, 3, (x, 5),
                                                      (7,), 4))
    assert old == ["_old_embedding_launch", "stream", "run"]
    assert len(names) < len(old)


def test_launcher_falls_back_to_jit_on_a_foreign_launcher_signature(monkeypatch):
    launcher, _ = _fake_launcher(monkeypatch)
    jit_calls = []

    def refuse(*args):
        raise TypeError("takes 9 positional arguments")

    launcher.fast[(7,)] = (refuse, "function", "packed", 0)
    monkeypatch.setattr(launcher, "_first", lambda *a: jit_calls.append(a))
    launcher((7,), (1, 1, 1), (torch.zeros(1),), 4)
    assert jit_calls and launcher.fast == {} and "takes 9" in launcher.path()
    assert _triton.launch_paths()["fake.kernel"].startswith("TypeError")


def test_forget_compiled_empties_every_launcher(monkeypatch):
    launcher, _ = _fake_launcher(monkeypatch)
    _triton.forget_compiled()
    assert launcher.fast == {}


def test_tilelang_arch_rule():
    assert _tilelang.arch() == "sm_90"
    assert _tilelang.arch(arch_specific=True) == "sm_90a"
    assert _tilelang.arch(base="sm_90a") == "sm_90"  # the norms and the embedding: plain sm_90
    assert _tilelang.arch(base="sm_90a", arch_specific=True) == "sm_90a"
    assert _tilelang.arch(base="sm_80", arch_specific=True) == "sm_80"


def test_compile_log_counts_by_dsl_and_name(monkeypatch):
    monkeypatch.setattr(compile_log, "SECONDS", {})
    compile_log.record("triton", ("rms_norm.fwd", 1), 0.5)
    compile_log.record("tilelang", ("rms_norm.bwd", 2, "sm_90"), 2.0)
    compile_log.record("tilelang", ("layer_norm.bwd", 2, "sm_90"), 3.0)
    assert compile_log.count("tilelang", "rms_norm") == 1 and compile_log.total("tilelang") == 5.0
    assert compile_log.total("triton", "rms_norm") == 0.5 and compile_log.count("triton", "layer_norm") == 0


def test_precompile_manifests():
    """Every op has a manifest; the kernels named exist; the attention kernels compile for sm_90a."""
    jobs = precompile.tilelang_jobs(precompile.OPS, "sm_90a", tune=True)
    ops = {op for op, _, _ in jobs}
    assert ops == set(precompile.OPS)
    assert len(jobs) == len(set(jobs)), "a variant is listed twice"
    kinds = {(op, variant[0]) for op, variant, _ in jobs}
    assert ("embedding_bag_mean", "bwd_dense") in kinds and ("flash_attention", "dkdv") in kinds
    assert ("rms_norm", "fwd_infer") in kinds and ("layer_norm", "bwd") in kinds


def test_precompile_refuses_unknown_ops(capsys):
    with pytest.raises(SystemExit):
        precompile.main(["rms_norms"])
    assert "unknown operator(s) rms_norms" in capsys.readouterr().err


def test_no_launch_hook_by_default_so_keys_are_cached(monkeypatch):
    """With no tool's hook set, keys must be cacheable. Newer triton keeps an always-present, empty HookChain
    in knobs.runtime: taking that for a hook sent every launch through the JIT path (seen on the H200: Triton
    norm forward host time 17 -> 80 us per call at 8192x128)."""
    from triton import knobs

    assert not _triton._hooks_set()

    def hook(*args):
        return None

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain: tools add to it
        chain.add(hook)
        try:
            assert _triton._hooks_set()
        finally:
            chain.remove(hook)
        assert not _triton._hooks_set()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)  # older triton: the hook itself
    assert _triton._hooks_set()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not _triton._hooks_set()
