"""The carried TileLang cache must hold every variant the model-level benchmark uses: on the H200 a
missing one compiles inside the test for 30-80 s (a model case can then run out of its time).

The models' calls are recorded on CPU (pcvr_lib.workloads.model_kernels: every switch on tilelang, the
kernel entry points replaced by recorders that run torch) and compared with the committed list the
precompile manifest adds."""

from __future__ import annotations

import torch

from pcvr_lib.precompile import OPS, tilelang_jobs
from pcvr_lib.workloads.model_kernels import MODEL_VARIANTS, Recorder, record


def test_the_committed_model_variants_are_what_the_models_call():
    recorded = record()
    for op in OPS:
        missing = sorted(set(recorded[op]) - set(MODEL_VARIANTS[op]), key=str)
        unused = sorted(set(MODEL_VARIANTS[op]) - set(recorded[op]), key=str)
        assert not missing and not unused, (
            f"{op}: the models now call TileLang variants {missing} not in MODEL_VARIANTS, and no longer "
            f"{unused}; regenerate with `python3 -m pcvr_lib.workloads.model_kernels` and rebuild the pack")


def test_the_precompile_manifest_holds_every_model_variant():
    jobs = {(op, variant) for op, variant, _ in tilelang_jobs(OPS, "sm_90a")}
    assert {(op, v) for op in OPS for v in MODEL_VARIANTS[op]} <= jobs
    assert {(op, v) for op, v, _ in tilelang_jobs(OPS, "sm_90a", models_only=True)} == {
        (op, v) for op in OPS for v in MODEL_VARIANTS[op]}


def test_the_recorder_notes_the_keys_of_each_kind_of_call():
    """Inference and training calls give the kernels' kinds (fp32 attention runs in bf16, head size 48
    padded to 64, a sparse table's backward), and the result is torch's."""
    from pcvr_lib import kernels
    from pcvr_lib.kernels.attention.config import TILELANG_BWD_CONFIGS, TILELANG_FWD_CONFIGS

    x = torch.randn(3, 5, 24, requires_grad=True)
    w = torch.ones(24, requires_grad=True)
    q = torch.randn(2, 2, 130, 48, requires_grad=True)
    table = torch.randn(10, 8, requires_grad=True)
    ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
    with Recorder() as rec:
        y = kernels.rms_norm(x, w, 1e-6, backend="tilelang")
        with torch.no_grad():
            kernels.layer_norm(x, w, torch.zeros(24), 1e-5, backend="tilelang")
        o = kernels.flash_attention(q, q, q, key_lengths=torch.tensor([130, 7]), causal=True, causal_valid=True,
                                    backend="tilelang")
        e = kernels.embedding_bag_mean(table, ids, backend="tilelang", sparse_grad=True)
    assert torch.equal(y, kernels.rms_norm(x, w, 1e-6))
    assert torch.equal(o, kernels.flash_attention(q, q, q, key_lengths=torch.tensor([130, 7]), causal=True,
                                                  causal_valid=True))
    assert torch.equal(e, kernels.embedding_bag_mean(table, ids))
    assert rec.variants["rms_norm"] == {("fwd_train", 24, torch.float32), ("bwd", 24, torch.float32)}
    assert rec.variants["layer_norm"] == {("fwd_infer", 24, torch.float32)}
    common = (64, torch.bfloat16, 3, True, False)  # causal_valid with key lengths, bucket 1 (130 > 128)
    assert rec.variants["flash_attention"] == {("fwd", *common, TILELANG_FWD_CONFIGS[(64, 1)]),
                                               ("dq", *common, TILELANG_BWD_CONFIGS[(64, 1)]),
                                               ("dkdv", *common, TILELANG_BWD_CONFIGS[(64, 1)])}
    assert rec.variants["embedding_bag_mean"] == {("fwd_train", 8, torch.float32, torch.int64, 4),
                                                  ("bwd_sparse", 8, torch.float32, torch.int64, 4)}
    assert kernels.rms_norm.__module__ != Recorder.__module__  # the entry points are restored
