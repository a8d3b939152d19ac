"""Mode "captured" (models.captured): the whole training step, optimizers included, and inference as one
CUDA graph each. On a GPU: the captured steps take the eager steps' updates and give the eager scores
(same seeds, same dropout draws). Everywhere: what cannot be captured is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from pcvr_lib.kernels.tolerance import Tolerance, assert_close
from pcvr_lib.models import model_names
from pcvr_lib.models.captured import capture_problem
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.models.step import ModelStep
from pcvr_lib.optim import build_optimizer_set
from pcvr_lib.workloads.models import demo_schema, random_batch

TINY = {"vocab_cap": 64, "d_model": 64, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}  # head dim 32: a kernel one
SIZES = {"dualq": {"d_model": 96, "num_heads": 3}}  # RankMixer's mixing needs d_model divisible by its 6 queries
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
    return [ModelStep(name, schema, batch, "torch", config={**TINY, **SIZES.get(name, {}), **switches}, device="cuda",
                      mode=mode)
            for mode in ("eager", "captured")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="mode captured: no CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", model_names())
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


class _ReplayByRunning:
    """A CPU stand-in for StepGraph with its contract: `warmup` runs, `restore()`, then the "capture" (one
    run whose outputs are the replay's), and every replay runs the step again on the memory it was captured
    on. `fail_at_warmup` raises in the last warm-up run, as a sync in the step would fail there or in the
    capture (after earlier runs changed the weights and the optimizer state)."""

    fail_at_warmup = False

    def __init__(self, run, restore=None, warmup=3):
        for i in range(warmup):
            run()
            if self.fail_at_warmup and i == warmup - 1:
                raise RuntimeError("operation not permitted when stream is capturing")
        if restore is not None:
            restore()
        self.run = run
        self.output = run()
        self.first = True

    def replay(self):
        if not self.first:
            self.output = self.run()
        self.first = False
        return self.output


def _captured_training(monkeypatch, fail=False):
    from pcvr_lib.models import captured
    from pcvr_lib.optim import train_step

    monkeypatch.setattr(captured, "StepGraph", type("Graph", (_ReplayByRunning,), {"fail_at_warmup": fail}))
    schema = demo_schema()
    torch.manual_seed(0)
    step = ModelStep("baseline", schema, random_batch(schema, batch=8, seed=1), "torch", config=TINY)
    step.optimizers = build_optimizer_set(step.model.dense_parameters(), step.model.sparse_parameters(),
                                          dense="fused_adamw", dense_options={"capturable": True})
    seen = []

    def one_step(batch):
        seen.append(batch)
        with at_static_lengths():
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                step.model(batch).float().squeeze(-1), batch.label.float())
            return train_step(loss, step.optimizers, skip_nonfinite=True, read=False)

    return step, captured.CapturedTraining(step.model, step.optimizers, one_step), seen, schema


def test_captured_training_copies_each_batch_into_the_captured_one_and_runs_other_shapes_eagerly(monkeypatch):
    step, training, seen, schema = _captured_training(monkeypatch)
    first, second = (random_batch(schema, batch=8, seed=s) for s in (1, 2))
    training(first)
    static = seen[-1]
    assert static is not first and all(torch.equal(a, b) for a, b in zip(static.tensors(), first.tensors(),
                                                                          strict=True))
    training(second)  # replayed: the captured batch now holds the second one
    assert seen[-1] is static and all(torch.equal(a, b) for a, b in zip(static.tensors(), second.tensors(),
                                                                        strict=True))
    short = random_batch(schema, batch=5, seed=3)
    training(short)
    assert seen[-1] is short and training.eager_steps == 1


def test_a_failed_capture_leaves_the_model_and_the_optimizers_as_they_were(monkeypatch):
    step, training, _, schema = _captured_training(monkeypatch, fail=True)
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    with pytest.raises(RuntimeError, match="stream is capturing"):
        training(random_batch(schema, batch=8, seed=1))
    for name, tensor in step.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for opt in step.optimizers.optimizers:
        for state in opt.state.values():
            for key, value in state.items():
                fresh = 0.0
                assert (value == fresh).all() if torch.is_tensor(value) else value == 0, key
    assert all(p.grad is None for p in step.optimizers.parameters())


def test_a_capture_from_a_running_optimizer_continues_its_state(monkeypatch):
    """Captured after steps were taken (a resumed run, or a first batch too short to capture on), the first
    replay continues the optimizers' state instead of starting it afresh: it equals the eager step."""
    step, training, _, schema = _captured_training(monkeypatch)
    twin, _, _, _ = _captured_training(monkeypatch)
    twin.model.load_state_dict(step.model.state_dict())
    first, second = (random_batch(schema, batch=8, seed=s) for s in (1, 2))
    for run in (step, twin):  # one eager step each: every optimizer now has state
        with at_static_lengths():
            run.batch = first
            run.train_step()
    eager = twin._train_step.__func__  # the same step, eagerly, on the twin
    with at_static_lengths():
        twin.batch = second
        expected = float(eager(twin)["loss"])
    got = float(training(second)["loss"])
    assert got == pytest.approx(expected, rel=1e-6)
    for (name, a), b in zip(step.model.state_dict().items(), twin.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
