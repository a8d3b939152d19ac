"""The TileLang kernel variants the seven models use in the model-level benchmark, recorded on CPU.

TileLang compiles a variant (op, kind, width / head size, dtype, mask, tile config) in 30-80 s on the H200
host, so the benchmark must find every one in the carried disk cache. `record(...)` runs each model on
CPU with every operator switch on "tilelang" while the four kernel entry points are replaced by
recorders: each call notes the variant keys the TileLang backend would compile (in the format of the
ops' workload manifests, `pcvr_lib.precompile.tilelang_jobs`) and computes the result on the torch backend.
Keys do not depend on the batch size; the sequence lengths enter attention only through their bucket.

`MODEL_VARIANTS` below is the committed result (the precompile manifest adds it); the test
`smoke_tests/test_model_kernel_variants.py` re-records it and fails when a model's calls change.
Regenerate: `python3 -m pcvr_lib.workloads.model_kernels`.
"""

from __future__ import annotations

import contextlib

import torch

from pcvr_lib import kernels
from pcvr_lib.kernels.attention import PADDED_HEAD_DIMS
from pcvr_lib.kernels.attention.config import TILELANG_BWD_CONFIGS, TILELANG_FWD_CONFIGS
from pcvr_lib.kernels.attention.masks import MODE_CODE, length_bucket, mode_name
from pcvr_lib.kernels.embedding_bag.config import vector_width
from pcvr_lib.models import model_names
from pcvr_lib.models.step import ModelStep
from pcvr_lib.schema import load_schema
from pcvr_lib.workloads.models import DEMO_SCHEMA, random_batch

_float32, _bfloat16, _int64 = torch.float32, torch.bfloat16, torch.int64
# op -> variant tuples in the manifests' format (sorted)
MODEL_VARIANTS: dict[str, list[tuple]] = {  # generated: python3 -m pcvr_lib.workloads.model_kernels
    "rms_norm": [
        ('bwd', 24, _float32),
        ('bwd', 256, _float32),
        ('bwd', 64, _float32),
        ('bwd', 768, _float32),
        ('fwd_infer', 24, _float32),
        ('fwd_infer', 256, _float32),
        ('fwd_infer', 64, _float32),
        ('fwd_infer', 768, _float32),
        ('fwd_train', 24, _float32),
        ('fwd_train', 256, _float32),
        ('fwd_train', 64, _float32),
        ('fwd_train', 768, _float32),
    ],
    "layer_norm": [
        ('bwd', 128, _float32),
        ('bwd', 192, _float32),
        ('bwd', 256, _float32),
        ('bwd', 512, _float32),
        ('bwd', 54, _float32),
        ('bwd', 576, _float32),
        ('bwd', 64, _float32),
        ('bwd', 8, _float32),
        ('fwd_infer', 128, _float32),
        ('fwd_infer', 192, _float32),
        ('fwd_infer', 256, _float32),
        ('fwd_infer', 512, _float32),
        ('fwd_infer', 54, _float32),
        ('fwd_infer', 576, _float32),
        ('fwd_infer', 64, _float32),
        ('fwd_infer', 8, _float32),
        ('fwd_train', 128, _float32),
        ('fwd_train', 192, _float32),
        ('fwd_train', 256, _float32),
        ('fwd_train', 512, _float32),
        ('fwd_train', 54, _float32),
        ('fwd_train', 576, _float32),
        ('fwd_train', 64, _float32),
        ('fwd_train', 8, _float32),
    ],
    "embedding_bag_mean": [
        ('bwd_dense', 256, _float32, _int64, 1),
        ('bwd_dense', 64, _float32, _int64, 1),
        ('bwd_sparse', 16, _float32, _int64, 4),
        ('bwd_sparse', 256, _float32, _int64, 4),
        ('bwd_sparse', 32, _float32, _int64, 4),
        ('bwd_sparse', 4, _float32, _int64, 4),
        ('bwd_sparse', 64, _float32, _int64, 4),
        ('bwd_sparse', 8, _float32, _int64, 4),
        ('fwd', 16, _float32, _int64, 4),
        ('fwd', 256, _float32, _int64, 4),
        ('fwd', 32, _float32, _int64, 4),
        ('fwd', 4, _float32, _int64, 4),
        ('fwd', 64, _float32, _int64, 4),
        ('fwd', 8, _float32, _int64, 4),
        ('fwd_train', 16, _float32, _int64, 4),
        ('fwd_train', 256, _float32, _int64, 4),
        ('fwd_train', 32, _float32, _int64, 4),
        ('fwd_train', 4, _float32, _int64, 4),
        ('fwd_train', 64, _float32, _int64, 4),
        ('fwd_train', 8, _float32, _int64, 4),
    ],
    "flash_attention": [
        ('dkdv', 16, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dkdv', 16, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('dkdv', 16, _bfloat16, 1, True, False, (64, 64, 128, 2)),
        ('dkdv', 16, _bfloat16, 3, True, False, (64, 64, 128, 1)),
        ('dkdv', 16, _bfloat16, 3, True, False, (64, 64, 128, 2)),
        ('dkdv', 16, _bfloat16, 4, True, False, (64, 64, 128, 2)),
        ('dkdv', 32, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dkdv', 32, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('dkdv', 32, _bfloat16, 5, False, False, (64, 64, 128, 1)),
        ('dkdv', 64, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dkdv', 64, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('dq', 16, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dq', 16, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('dq', 16, _bfloat16, 1, True, False, (64, 64, 128, 2)),
        ('dq', 16, _bfloat16, 3, True, False, (64, 64, 128, 1)),
        ('dq', 16, _bfloat16, 3, True, False, (64, 64, 128, 2)),
        ('dq', 16, _bfloat16, 4, True, False, (64, 64, 128, 2)),
        ('dq', 32, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dq', 32, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('dq', 32, _bfloat16, 5, False, False, (64, 64, 128, 1)),
        ('dq', 64, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('dq', 64, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('fwd', 16, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('fwd', 16, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('fwd', 16, _bfloat16, 1, True, False, (64, 64, 128, 2)),
        ('fwd', 16, _bfloat16, 3, True, False, (64, 64, 128, 1)),
        ('fwd', 16, _bfloat16, 3, True, False, (64, 64, 128, 2)),
        ('fwd', 16, _bfloat16, 4, True, False, (64, 64, 128, 2)),
        ('fwd', 32, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('fwd', 32, _bfloat16, 1, True, False, (64, 64, 128, 1)),
        ('fwd', 32, _bfloat16, 5, False, False, (64, 64, 128, 1)),
        ('fwd', 64, _bfloat16, 1, False, False, (64, 64, 128, 1)),
        ('fwd', 64, _bfloat16, 1, True, False, (64, 64, 128, 1)),
    ],
}


class Recorder:
    """Context manager: while active, the kernel entry points record TileLang variant keys and run torch."""

    def __init__(self):
        self.variants: dict[str, set] = {"rms_norm": set(), "layer_norm": set(), "embedding_bag_mean": set(),
                                         "flash_attention": set()}

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        originals = {name: getattr(kernels, name) for name in self.variants}
        for name, wrapper in (("flash_attention", self._attention), ("rms_norm", self._norm("rms_norm")),
                              ("layer_norm", self._norm("layer_norm")), ("embedding_bag_mean", self._bag)):
            setattr(kernels, name, wrapper(originals[name]))
            self._stack.callback(setattr, kernels, name, originals[name])
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _attention(self, original):
        def run(q, k, v, *, key_lengths=None, causal=False, causal_valid=False, window=None, global_queries=0,
                role_mask=None, dropout_p=0.0, training=False, backend="torch", **rest):
            if backend == "tilelang":
                dtype = torch.bfloat16 if q.dtype == torch.float32 else q.dtype  # fp32 runs in bf16
                D = PADDED_HEAD_DIMS.get(q.shape[3], q.shape[3])
                code = MODE_CODE[mode_name(key_lengths, causal, causal_valid, window, role_mask)]
                bucket = length_bucket(q.shape[2])
                common = (D, dtype, code, key_lengths is not None, bool(training and dropout_p > 0))
                self.variants["flash_attention"].add(("fwd", *common, TILELANG_FWD_CONFIGS[(D, bucket)]))
                if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                    for kind in ("dq", "dkdv"):
                        self.variants["flash_attention"].add((kind, *common, TILELANG_BWD_CONFIGS[(D, bucket)]))
            return original(q, k, v, key_lengths=key_lengths, causal=causal, causal_valid=causal_valid,
                            window=window, global_queries=global_queries, role_mask=role_mask,
                            dropout_p=dropout_p, training=training, backend="torch", **rest)
        return run

    def _norm(self, op):
        def wrap(original):
            def run(x, weight, *args, backend="torch", **kw):
                if backend == "tilelang":
                    n, dt = x.shape[-1], x.dtype
                    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                        self.variants[op].update({("fwd_train", n, dt), ("bwd", n, dt)})
                    else:
                        self.variants[op].add(("fwd_infer", n, dt))
                return original(x, weight, *args, backend="torch", **kw)
            return run
        return wrap

    def _bag(self, original):
        def run(weight, ids, *, backend="torch", sparse_grad=False):
            if backend == "tilelang":
                dim, wdt, idt = weight.shape[1], weight.dtype, ids.dtype
                vec = vector_width(dim, weight.element_size(), 0)  # the manifest's form: aligned pointers
                if weight.requires_grad and torch.is_grad_enabled():
                    self.variants["embedding_bag_mean"].add(("fwd_train", dim, wdt, idt, vec))
                    self.variants["embedding_bag_mean"].add(
                        ("bwd_sparse", dim, wdt, idt, vec) if sparse_grad else ("bwd_dense", dim, wdt, idt, 1))
                else:
                    self.variants["embedding_bag_mean"].add(("fwd", dim, wdt, idt, vec))
            return original(weight, ids, backend="torch", sparse_grad=sparse_grad)
        return run


def record(names=None, batch_size: int = 2) -> dict[str, list[tuple]]:
    """Run each model (default: all) as perf_tests/test_models.py does on the GPU (its config and schema;
    a small batch: the keys do not depend on it; random_batch fills one row to the full lengths, so the
    length buckets are the benchmark's) through one inference pass and one training step on CPU, every
    switch on tilelang. Returns op -> sorted variant tuples."""
    schema = load_schema(DEMO_SCHEMA)
    batch = random_batch(schema, batch=batch_size, seed=3)
    with Recorder() as rec:
        for name in names or model_names():
            step = ModelStep(name, schema, batch, "tilelang", config={"vocab_cap": 64})
            step.infer()
            step.train_step()
    return {op: sorted(v, key=str) for op, v in rec.variants.items()}


def _source(variants: dict[str, list[tuple]]) -> str:
    """The MODEL_VARIANTS block for this file."""
    names = {torch.float32: "_float32", torch.bfloat16: "_bfloat16", torch.int64: "_int64"}
    lines = ["MODEL_VARIANTS: dict[str, list[tuple]] = {  # generated: python3 -m pcvr_lib.workloads.model_kernels"]
    for op, vs in variants.items():
        lines.append(f'    "{op}": [')
        lines += ["        (" + ", ".join(names.get(x, repr(x)) for x in v) + ")," for v in vs]
        lines.append("    ],")
    return "\n".join(lines + ["}"])


if __name__ == "__main__":
    print(_source(record()))
