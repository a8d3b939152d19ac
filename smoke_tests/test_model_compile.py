"""Every model traces into one torch.compile graph (fullgraph: no graph break) for inference, on the torch
backend and with our Triton kernels, and the compiled model gives the eager model's scores (CPU, Triton's
interpreter; attention stays on torch there: the interpreter cannot run the bf16 the fp32 models' attention
runs in, and accuracy_tests/test_compile.py traces the attention op on every backend)."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels.tolerance import assert_close
from pcvr_lib.models import model_names
from pcvr_lib.models.step import ModelStep
from pcvr_lib.workloads.models import demo_schema, random_batch

TINY = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}
SWITCHES = {"torch": {}, "triton": {"rms_norm_backend": "triton", "embedding_backend": "triton"}}


@pytest.mark.parametrize("backend", sorted(SWITCHES))
@pytest.mark.parametrize("name", model_names())
def test_the_model_compiles_fullgraph_and_scores_as_eager(name, backend, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU check; on a GPU perf_tests/test_models.py times the compiled models")
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    schema = demo_schema()
    batch = random_batch(schema, batch=4, seed=3)
    step = ModelStep(name, schema, batch, "torch", config={**TINY, **SWITCHES[backend]})
    model = step.model.eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = model(batch)
        got = compiled(batch)
    assert_close(got, expected.double(), torch.float32, what=f"{name} on {backend}: compiled vs eager scores")
