"""Mode "captured" (models.captured): the whole training step, optimizers included, and inference as one
CUDA graph each. On a GPU: the captured steps take the eager steps' updates and give the eager scores
(same seeds, same dropout draws). Everywhere: what cannot be captured is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels.tolerance import Tolerance, assert_close
from pcvr_lib.models.captured import capture_problem
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.models.step import ModelStep
from pcvr_lib.optim import build_optimizer_set
from pcvr_lib.workloads.models import demo_schema, random_batch

TINY = {"vocab_cap": 64, "d_model": 64, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}  # head dim 32: a kernel one
STEPS = 3
# after a few steps only loosely: Adagrad scales a row's step by 1 / |its gradient so far|, so rounding in a
# near-zero gradient moves that row by up to the learning rate
AFTER_STEPS = Tolerance(atol=1e-3, rtol=1e-3)


def test_captured_mode_needs_a_gpu():
    schema = demo_schema()
    with pytest.raises(ValueError, match="'captured' replays CUDA graphs and needs a CUDA device"):
        ModelStep("baseline", schema, random_batch(schema, batch=2, seed=1), "torch", config=TINY,
                  mode="captured")


@pytest.mark.parametrize("dense, options, problem", [
    ("adamw", {}, "AdamW is not capturable: use fused_adamw with capturable=True"),
    ("fused_adamw", {}, "AdamW is not capturable: use fused_adamw with capturable=True"),
    ("muon", {}, "Muon is not capturable"),
    ("fused_adamw", {"capturable": True}, None),
])
def test_only_optimizers_whose_step_a_graph_can_hold_are_captured(dense, options, problem):
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    opts = build_optimizer_set(params, [torch.nn.Parameter(torch.randn(6, 2))], dense=dense, dense_options=options)
    found = capture_problem(opts)
    assert (found is None) if problem is None else (problem in found), found


def _pair(name: str, backend: str):
    schema = demo_schema()
    batch = random_batch(schema, batch=64, seed=3)
    switches = {} if backend == "torch" else {"rms_norm_backend": backend, "embedding_backend": backend,
                                              "attention_backend": backend}
    return [ModelStep(name, schema, batch, "torch", config={**TINY, **switches}, device="cuda", mode=mode)
            for mode in ("eager", "captured")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="mode captured: no CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["baseline", "tokenformer", "interformer"])
def test_the_captured_step_trains_and_scores_as_eager(name, backend):
    eager, captured = _pair(name, backend)
    with at_static_lengths():  # the captured step runs at the static lengths: the same dropout shapes
        assert_close(captured.infer().clone(), eager.infer().double(), torch.float32,
                     what=f"{name} {backend}: captured vs eager scores at init")
        for step in range(STEPS):
            results = []
            for run in (eager, captured):
                torch.manual_seed(100 + step)
                results.append({k: float(v) for k, v in run.train_step().items() if torch.is_tensor(v)})
            assert_close(torch.tensor(results[1]["loss"]), torch.tensor(results[0]["loss"], dtype=torch.float64),
                         torch.float32, what=f"{name} {backend}: loss of step {step}, captured vs eager")
        assert_close(captured.infer().clone(), eager.infer().double(), torch.float32, tol=AFTER_STEPS,
                     what=f"{name} {backend}: captured vs eager scores after {STEPS} steps")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="mode captured: no CUDA device")
def test_a_new_batch_is_copied_into_the_captured_one():
    """Assigning `step.batch` after a capture copies it into the memory the graph reads (the loader-fed
    benchmark does that): the captured step then trains on the new batch as eager does; another shape is
    refused."""
    eager, captured = _pair("baseline", "triton")
    schema = demo_schema()
    with at_static_lengths():
        for seed in (3, 4, 5):
            batch = random_batch(schema, batch=64, seed=seed).to("cuda")
            losses = []
            for run in (eager, captured):
                run.batch = batch
                torch.manual_seed(seed)
                losses.append(float(run.train_step()["loss"]))
            assert_close(torch.tensor(losses[1]), torch.tensor(losses[0], dtype=torch.float64), torch.float32,
                         what=f"captured vs eager loss on batch seed {seed}")
    with pytest.raises(ValueError, match="every batch must have the shapes and dtypes"):
        captured.batch = random_batch(schema, batch=32, seed=6).to("cuda")
