"""flash_attention accuracy on a GPU: every backend against the fp64 reference, outputs poisoned first (the
rule and the CPU cases: test_attention.py). Every case skips with the reason on a machine without CUDA."""

import pytest
import torch

from accuracy_tests.attention_checks import (
    DT,
    check_case,
    inputs,
)
from accuracy_tests.skips import require_cuda_backend
from pcvr_lib.kernels import compile_log, flash_attention
from pcvr_lib.kernels.attention import config
from pcvr_lib.workloads import attention as workload

# -------------------------------------------------------------------------------------------------- GPU

GPU_BACKENDS = ["triton", "tilelang"]
GPU_CASES = workload.GPU_CASES
TILELANG_CASES = workload.TILELANG_CASES


def _gpu_case_id(c):
    return "B{}xH{}xSq{}xSkv{}xD{}-{}-{}-p{}".format(*c)


GPU_PARAMS = [pytest.param("triton", c, id=f"triton-{_gpu_case_id(c)}") for c in GPU_CASES] + [
    pytest.param("tilelang", c, id=f"tilelang-{_gpu_case_id(c)}") for c in TILELANG_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,case", GPU_PARAMS)
def test_gpu_accuracy(backend, case):
    require_cuda_backend("flash_attention", backend)
    B, H, Sq, Skv, D, dt, mode, p = case
    check_case(backend, B, H, Sq, Skv, D, DT[dt], mode, p=p, device="cuda")


def test_every_one_tile_case_runs_in_the_gpu_accuracy_cases():
    """The one-tile backward's GPU cases reach it through test_gpu_accuracy: each is one of its cases and its
    head dim takes the one-tile kernel by default (a dim that did not would need the kernel routed, as the
    interpreter tests do with the fixture one_tile_routed)."""
    for case in workload.ONE_TILE_GPU_CASES:
        assert case in workload.GPU_CASES, case
        assert case[4] in config.TRITON_ONE_TILE_DEFAULT_DIMS, case


@pytest.mark.gpu
@pytest.mark.parametrize("case,fwd_config,bwd_config", workload.TILELANG_LONG_CASES,
                         ids=[_gpu_case_id(c) for c, _, _ in workload.TILELANG_LONG_CASES])
def test_gpu_tilelang_long_candidates(case, fwd_config, bwd_config, monkeypatch):
    """The long-sequence candidates (ordered forward pipeline, fused backward) against fp64, through the
    operator with the bucket's TileLang configs replaced."""
    require_cuda_backend("flash_attention", "tilelang")
    from pcvr_lib.kernels.attention.masks import length_bucket

    B, H, Sq, Skv, D, dt, mode, p = case
    monkeypatch.setitem(config.TILELANG_FWD_CONFIGS, (D, length_bucket(Sq)), fwd_config)
    monkeypatch.setitem(config.TILELANG_BWD_CONFIGS, (D, length_bucket(Sq)), bwd_config)
    check_case("tilelang", B, H, Sq, Skv, D, DT[dt], mode, p=p, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_no_recompile_within_bucket(backend):
    require_cuda_backend("flash_attention", backend)
    B, H, S, _, D, dt, _, _ = workload.RECOMPILE_CASE

    def call(s):
        q = torch.randn(B, H, s, D, device="cuda", dtype=DT[dt])
        flash_attention(q, q, q, key_lengths=torch.tensor([s, s - 1], device="cuda", dtype=torch.int32),
                        backend=backend)
        torch.cuda.synchronize()

    call(S)
    before = _compiled_count(backend)
    for s in (101, 117, 127, 128, 64, 33):
        call(s)
    assert _compiled_count(backend) == before, "a sequence length inside the bucket recompiled"


def _compiled_count(backend):
    count = compile_log.count(backend, "flash_attention")
    if backend == "triton":  # triton's own count too: a recompile the launcher's key missed would be stale
        from pcvr_lib.kernels import _triton

        count += _triton.compiled_variants("flash_attention")
    return count


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_dropout_same_mask_as_torch(backend):
    """The same seed drops the same weights on every backend: our kernels against the torch backend."""
    require_cuda_backend("flash_attention", backend)
    q, k, v, _ = inputs(3, 2, 40, 40, 64, torch.bfloat16, seed=7)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    kl = torch.tensor([40, 13, 0], device="cuda", dtype=torch.int32)
    outs = {}
    for name in ("torch", backend):
        outs[name] = flash_attention(q, k, v, key_lengths=kl, causal_valid=True, dropout_p=0.4, training=True,
                                     backend=name, generator=torch.Generator().manual_seed(11)).float()
    err = float((outs[backend] - outs["torch"]).abs().max())
    assert err < 0.05, f"{backend} dropout differs from torch's with the same seed by {err}"
