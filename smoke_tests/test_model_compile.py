"""Every model traces into one torch.compile graph (fullgraph: no graph break) for a training step and for
inference, on the torch backend and with our Triton kernels; the compiled step takes the eager step's
gradients and updates and the compiled model gives the eager model's scores; and neither reads anything
back from the device (no host sync) in forward, backward or the optimizers.

CPU, Triton's interpreter; compiled with "aot_eager" (the same forward and backward graphs AOTAutograd
traces for inductor, run without a minute of code generation per model). Attention stays on torch here:
the interpreter cannot run the bf16 the fp32 models' attention runs in (accuracy_tests/test_compile.py
traces the attention op on every backend); perf_tests/test_models.py times the compiled models."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels.testing import count_host_reads, graph_host_reads
from pcvr_lib.kernels.tolerance import Tolerance, assert_close
from pcvr_lib.models import model_names
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.models.step import ModelStep
from pcvr_lib.optim import train_step
from pcvr_lib.workloads.models import demo_schema, random_batch

TINY = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}
SWITCHES = {"torch": {}, "triton": {"rms_norm_backend": "triton", "embedding_backend": "triton"}}
STEPS = 2
AFTER_STEPS = Tolerance(atol=1e-3, rtol=1e-3)  # the scores after STEPS steps (see the test)


class RecordingCompiler:
    """torch.compile's "aot_eager" that keeps every forward and backward graph it runs."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.graphs = []

        def keep(graph_module, example_inputs):
            self.graphs.append(graph_module)
            return make_boxed_func(graph_module.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def host_reads(self) -> list[str]:
        return [read for graph in self.graphs for read in graph_host_reads(graph)]


def _build(name: str, backend: str, mode: str, compiler: RecordingCompiler) -> ModelStep:
    schema = demo_schema()
    return ModelStep(name, schema, random_batch(schema, batch=4, seed=3), "torch",
                     config={**TINY, **SWITCHES[backend]}, mode=mode, compiler=compiler.backend)


def _gradients(step: ModelStep) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient (dense; a table's with its pieces summed) of one backward."""
    step.model.train()
    torch.manual_seed(1)
    loss = step.loss()
    loss.backward()
    if step.mode != "eager":
        step.forward.after_backward()
    grads = {k: (p.grad.to_dense() if p.grad.is_sparse else p.grad) for k, p in step.model.named_parameters()
             if p.grad is not None}
    step.optimizers.zero_grad()
    return float(loss), grads


def _steps(step: ModelStep) -> list[str]:
    """STEPS training steps; the host reads they made outside compiled code."""
    reads = []
    for _ in range(STEPS):
        torch.manual_seed(1)
        step.model.train()
        if step.mode == "eager":
            # eagerly the forward trims each sequence to the batch's longest row (a host read, on purpose);
            # at the static lengths the whole eager step shows that it reads nothing else
            with at_static_lengths(), count_host_reads() as seen:
                step.train_step()
        else:  # dynamo refuses to run under a dispatch mode: the compiled graphs are read instead
            loss = step.loss()
            with count_host_reads() as seen:  # backward (compiled), gradients handed over, optimizers
                train_step(loss, step.optimizers, max_grad_norm=step.max_grad_norm, skip_nonfinite=False,
                           after_backward=step.forward.after_backward, read=False)
        reads += seen
    return reads


@pytest.mark.parametrize("backend", sorted(SWITCHES))
@pytest.mark.parametrize("name", model_names())
def test_the_compiled_model_trains_and_scores_as_eager_without_host_reads(name, backend, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU check; on a GPU perf_tests/test_models.py times the compiled models")
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    compiler = RecordingCompiler()
    eager, compiled = _build(name, backend, "eager", compiler), _build(name, backend, "compile", compiler)
    with at_static_lengths():
        eager_loss, eager_grads = _gradients(eager)
    compiled_loss, compiled_grads = _gradients(compiled)
    assert len(compiler.graphs) == 2, f"{name} on {backend}: {len(compiler.graphs)} graphs (forward + backward)"
    assert_close(torch.tensor(compiled_loss), torch.tensor(eager_loss, dtype=torch.float64), torch.float32,
                 what=f"{name} on {backend}: compiled loss vs eager")
    assert compiled_grads.keys() == eager_grads.keys()
    # each gradient at its own scale or the model's (the RMS of all its gradients), whichever is larger: a
    # gradient that is 0 up to rounding (dualq's pooling and score biases, which a softmax does not see) is
    # the rounding of sums of terms of the model's scale, not of its own
    overall = float(torch.cat([g.double().flatten() for g in eager_grads.values()]).square().mean().sqrt())
    for key, grad in compiled_grads.items():
        expected = eager_grads[key].double()
        assert_close(grad, expected, torch.float32, scale=max(float(expected.square().mean().sqrt()), overall),
                     what=f"{name} on {backend}: gradient of {key}, compiled vs eager")
    eager_reads, compiled_reads = _steps(eager), _steps(compiled)
    assert eager_reads == [], f"{name} on {backend}: the eager step read back {eager_reads}"
    assert compiled_reads == [], f"{name} on {backend}: the compiled step read back {compiled_reads}"
    scores = compiled.infer()
    assert len(compiler.graphs) == 3, f"{name} on {backend}: inference compiled as {len(compiler.graphs) - 2} graphs"
    assert compiler.host_reads() == [], f"{name} on {backend}: the compiled graphs read back {compiler.host_reads()}"
    # after the steps only loosely: Adagrad scales a row's step by 1 / |its gradient so far|, so rounding in a
    # near-zero gradient moves that row by up to the learning rate (the gradients above are the tight check)
    assert_close(scores, eager.infer().double(), torch.float32, what=f"{name} on {backend}: compiled vs eager "
                 f"scores after {STEPS} steps", tol=AFTER_STEPS)


@pytest.mark.parametrize("name", model_names())
def test_the_compiled_model_traces_one_graph_under_bf16_autocast(name):
    """The step `pcvr train --amp` and the benchmark's bf16 cases run: under bf16 autocast each model still
    traces as one forward and one backward graph, and trains and scores as it does eagerly under autocast
    (torch backend: the interpreter cannot run bf16)."""
    if torch.cuda.is_available():
        pytest.skip("CPU check; on a GPU perf_tests/test_models.py times the compiled models in bf16")
    torch._dynamo.reset()
    compiler = RecordingCompiler()
    eager, compiled = _build(name, "torch", "eager", compiler), _build(name, "torch", "compile", compiler)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with at_static_lengths():
            eager_loss, _ = _gradients(eager)
        compiled_loss, _ = _gradients(compiled)
        assert len(compiler.graphs) == 2, f"{name}: {len(compiler.graphs)} graphs under autocast (forward + backward)"
        scores, expected = compiled.infer(), eager.infer()
    assert len(compiler.graphs) == 3, f"{name}: inference under autocast compiled as {len(compiler.graphs) - 2} graphs"
    assert scores.dtype == torch.bfloat16, f"{name}: scores in {scores.dtype} under bf16 autocast"
    assert_close(torch.tensor(compiled_loss), torch.tensor(eager_loss, dtype=torch.float64), torch.bfloat16,
                 what=f"{name}: compiled loss vs eager under bf16 autocast")
    assert_close(scores, expected.double(), torch.bfloat16, what=f"{name}: compiled vs eager scores under autocast")


def test_a_graph_break_fails_the_compiled_step():
    """fullgraph=True: a model that cannot trace as one graph is an error, not a silently slower step."""
    from pcvr_lib.models.compiled import CompiledModel

    class Breaks(torch.nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x * 2

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        CompiledModel(Breaks().eval(), compiler="aot_eager")(torch.ones(3))
