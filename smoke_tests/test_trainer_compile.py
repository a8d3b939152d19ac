"""`pcvr train --compile / --graph`: the compiled model trains as the eager one does (captured table
gradients handed to the optimizers), a model that fails to compile falls back to eager with a warning and
the reason in the telemetry, and --graph without a CUDA device is refused before any work.

Compiled with "aot_eager" here (the traced forward and backward graphs, without inductor's minute of code
generation per model on a CPU); smoke_tests/test_model_compile.py checks every model."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pcvr_lib.cli import main as cli_main
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.models.compiled import CompiledModel
from pcvr_lib.train import TrainConfig, loop, train
from pcvr_lib.workloads.models import DEMO_SCHEMA

MAX_LENS = "seq_a:6,seq_b:6,seq_c:6,seq_d:6"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_dataset(DEMO_SCHEMA, rows=96, seed=5, out=tmp_path_factory.mktemp("data") / "d.parquet",
                            progress=False)


def _config(data, run_dir, **kw):
    return TrainConfig(**{**dict(model="baseline", data=str(data), run_dir=str(run_dir), max_lens=MAX_LENS,
                                 steps=3, batch_size=32, eval_batch_size=96, model_config={"vocab_cap": 64},
                                 seed=1), **kw})


def test_the_compiled_model_trains_as_the_eager_one(data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "CompiledModel", functools.partial(CompiledModel, compiler="aot_eager"))
    torch._dynamo.reset()
    eager = train(_config(data, tmp_path / "eager"))
    compiled = train(_config(data, tmp_path / "compiled", compile="compile"))
    meta = compiled["telemetry"]["metadata"]
    assert meta["compile_mode"] == "compile" and meta["compile_active"] is True, meta
    assert "compile_fallback_reason" not in meta
    # the first loss is the same forward; later ones follow the same updates up to rounding (which sparse
    # Adagrad can magnify on rows of near-zero gradient: smoke_tests/test_model_compile.py)
    assert compiled["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-6)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    assert compiled["validation_metrics"]["auc"] == pytest.approx(eager["validation_metrics"]["auc"], abs=0.02)


def test_a_model_that_fails_to_compile_trains_eagerly_with_a_warning(data, tmp_path, monkeypatch, capsys):
    def refuses(graph_module, example_inputs):
        raise RuntimeError("this compiler refuses every graph")

    monkeypatch.setattr(loop, "CompiledModel", functools.partial(CompiledModel, compiler=refuses))
    torch._dynamo.reset()
    summary = train(_config(data, tmp_path / "fallback", compile="compile", steps=2))
    meta = summary["telemetry"]["metadata"]
    assert meta["compile_active"] is False and "this compiler refuses every graph" in meta["compile_fallback_reason"]
    assert "--compile: torch.compile failed on the first step" in capsys.readouterr().err
    assert len(summary["losses"]) == 2 and summary["skipped_steps"] == 0


def test_a_backward_that_fails_to_compile_trains_eagerly_with_a_warning(data, tmp_path, monkeypatch, capsys):
    """AOTAutograd compiles the backward graph at the first backward, after the forward compiled and ran:
    the fallback covers that too (the half-done step's gradients dropped, the step run again eagerly)."""
    from torch._dynamo.backends.common import aot_autograd

    def refuses(graph_module, example_inputs):
        raise RuntimeError("this compiler refuses every backward graph")

    backend = aot_autograd(fw_compiler=lambda graph_module, example_inputs: graph_module, bw_compiler=refuses)
    monkeypatch.setattr(loop, "CompiledModel", functools.partial(CompiledModel, compiler=backend))
    torch._dynamo.reset()
    summary = train(_config(data, tmp_path / "fallback_bw", compile="compile", steps=2))
    meta = summary["telemetry"]["metadata"]
    assert meta["compile_active"] is False, meta
    assert "this compiler refuses every backward graph" in meta["compile_fallback_reason"]
    assert "--compile: torch.compile failed on the first step" in capsys.readouterr().err
    assert len(summary["losses"]) == 2 and summary["skipped_steps"] == 0
    assert all(loss is not None for loss in summary["losses"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
@pytest.mark.parametrize("mode", ["graph", "captured"])
def test_cuda_graph_modes_need_a_cuda_device(mode, data, tmp_path, capsys):
    code = cli_main(["train", "--model", "baseline", "--data", str(data), "--run-dir", str(tmp_path / "g"),
                     f"--{mode}", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"--{mode}: mode '{mode}' replays CUDA graphs and needs a CUDA device" in err, err
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())


# ------------------------------------------------------------------ mode captured (the default on CUDA)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the CPU")
def test_the_default_mode_trains_eagerly_on_the_cpu(data, tmp_path):
    summary = train(_config(data, tmp_path / "auto", steps=1))
    assert summary["train_config"]["compile"] == "auto"
    assert summary["telemetry"]["metadata"]["compile_mode"] == "eager"


@pytest.mark.parametrize("dense, mode, expected", [
    ("adamw", "auto", ("captured", None)),
    ("fused_adamw", "captured", ("captured", None)),
    ("muon", "auto",
     ("eager", "--dense-optimizer muon cannot be captured in a CUDA graph (adamw and fused_adamw can)")),
    ("adamw", "graph", ("graph", None)),
])
def test_which_mode_a_cuda_run_trains_in(dense, mode, expected, data, tmp_path):
    config = _config(data, tmp_path, dense_optimizer=dense, compile=mode, device="cuda")
    assert loop._training_mode(config, torch.device("cuda")) == expected


def test_an_explicit_capture_that_cannot_be_is_refused(data, tmp_path):
    config = _config(data, tmp_path, dense_optimizer="muon", compile="captured", device="cuda")
    with pytest.raises(loop.TrainError, match="--captured: --dense-optimizer muon cannot be captured"):
        loop._training_mode(config, torch.device("cuda"))


def _captured_on_the_cpu(monkeypatch, fail=False):
    """The trainer's captured path on the CPU: the mode forced, the graph replaced by a stand-in that runs
    the step on the captured batch at every replay (smoke_tests/test_model_captured.py)."""
    from pcvr_lib.models import captured
    from smoke_tests.test_model_captured import _ReplayByRunning

    monkeypatch.setattr(loop, "_training_mode", lambda config, device: ("captured", None))
    monkeypatch.setattr(captured, "StepGraph", type("Graph", (_ReplayByRunning,), {"fail_at_warmup": fail}))


def test_the_captured_trainer_trains_as_the_eager_one_and_skips_a_non_finite_step_on_the_device(
        data, tmp_path, monkeypatch):
    eager = train(_config(data, tmp_path / "eager", dense_optimizer="fused_adamw", steps=5))
    real = loop.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def poisoned(logits, target, *a, **k):  # a call after the warm-ups and the capture: a replay or eager step
        calls["n"] += 1
        loss = real(logits, target, *a, **k)
        return loss * float("nan") if calls["n"] == 7 else loss

    _captured_on_the_cpu(monkeypatch)
    captured = train(_config(data, tmp_path / "captured", steps=5))
    meta = captured["telemetry"]["metadata"]
    assert meta["compile_mode"] == "captured" and meta["dense_optimizer"] == "fused_adamw", meta
    # this data's row groups end in 13-row batches: those run eagerly, the 32-row ones replay the graph
    assert 0 <= meta["captured_eager_steps"] < 5
    assert captured["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    monkeypatch.setattr(loop.F, "binary_cross_entropy_with_logits", poisoned)
    skipping = train(_config(data, tmp_path / "nan", steps=5))
    losses = skipping["losses"]
    assert skipping["skipped_steps"] == 1 and losses.count(None) == 1, losses
    skipped = losses.index(None)
    assert 0 < skipped < 4 and losses[:skipped] == pytest.approx(eager["losses"][:skipped], rel=1e-5)
    # the skip changed nothing: the steps after it are finite and train on
    assert all(math.isfinite(x) for x in losses[skipped + 1:] + skipping["grad_norms"][skipped + 1:])


def test_the_captured_trainer_reads_its_steps_back_in_batches_in_step_order(data, tmp_path, monkeypatch):
    eager = train(_config(data, tmp_path / "eager", dense_optimizer="fused_adamw", steps=5))
    _captured_on_the_cpu(monkeypatch)
    monkeypatch.setattr(loop, "READ_EVERY", 2)
    reads, seen = [], []
    real_read = loop._read_steps

    def counted(unread, *args):
        reads.append([step for step, _, _ in unread])
        real_read(unread, *args)

    monkeypatch.setattr(loop, "_read_steps", counted)
    summary = train(_config(data, tmp_path / "captured", steps=5), progress=lambda step, *_: seen.append(step))
    assert seen == [1, 2, 3, 4, 5]
    assert summary["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    # an eagerly run step (the first, the short batches) is read at once; replays wait for READ_EVERY or the end
    replayed = [steps for steps in reads if len(steps) > 1]
    assert replayed and all(len(steps) <= 2 for steps in reads), reads
    assert [step for steps in reads for step in steps] == [1, 2, 3, 4, 5]


def test_a_kept_captured_step_trains_the_next_seed_as_its_own_capture_would(data, tmp_path, monkeypatch):
    from pcvr_lib.models import captured

    _captured_on_the_cpu(monkeypatch)
    alone = train(_config(data, tmp_path / "alone", steps=4, seed=7))
    captures = []
    graph = captured.StepGraph
    monkeypatch.setattr(captured, "StepGraph", lambda *a, **k: captures.append(1) or graph(*a, **k))
    with loop.keeping_captured_steps():
        first = train(_config(data, tmp_path / "first", steps=4, seed=3))
        second = train(_config(data, tmp_path / "second", steps=4, seed=7))
        other_lr = train(_config(data, tmp_path / "lr", steps=4, seed=7, dense_lr=3e-4))
    assert len(captures) == 2  # the first run and the run with another learning rate
    meta = second["telemetry"]["metadata"]
    assert meta["capture_reused"] is True and meta["compile_mode"] == "captured", meta
    assert "capture_reused" not in first["telemetry"]["metadata"] | other_lr["telemetry"]["metadata"]
    assert second["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    assert second["validation_metrics"]["auc"] == pytest.approx(alone["validation_metrics"]["auc"], abs=1e-6)
    assert first["losses"] != pytest.approx(alone["losses"], rel=1e-5)  # another seed trains otherwise
    assert loop._KEPT_STEPS is None  # the scope released what it kept


def test_a_failed_capture_trains_eagerly_with_a_warning(data, tmp_path, monkeypatch, capsys):
    eager = train(_config(data, tmp_path / "eager", dense_optimizer="fused_adamw", steps=2))
    _captured_on_the_cpu(monkeypatch, fail=True)
    summary = train(_config(data, tmp_path / "fallback", steps=2))
    meta = summary["telemetry"]["metadata"]
    assert meta["compile_active"] is False and "stream is capturing" in meta["compile_fallback_reason"]
    assert "--captured: the CUDA graph capture failed on the first step" in capsys.readouterr().err
    # the warm-up's steps were undone: the eager steps start from the same weights
    assert summary["losses"] == pytest.approx(eager["losses"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="mode captured: no CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_on_cuda_the_default_mode_captures_and_trains_as_eager(data, tmp_path, backend):
    switches = {} if backend == "torch" else {"rms_norm_backend": backend, "embedding_backend": backend,
                                              "attention_backend": backend}
    model_config = {"vocab_cap": 64, **switches}
    eager = train(_config(data, tmp_path / "eager", device="cuda", compile="eager", dense_optimizer="fused_adamw",
                          model_config=model_config, steps=4))
    captured = train(_config(data, tmp_path / "auto", device="cuda", model_config=model_config, steps=4))
    meta = captured["telemetry"]["metadata"]
    assert meta["compile_mode"] == "captured" and meta["compile_active"] is True, meta
    assert "compile_fallback_reason" not in meta
    assert captured["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-5)
    assert captured["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    assert captured["validation_metrics"]["auc"] == pytest.approx(eager["validation_metrics"]["auc"], abs=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="mode captured: no CUDA device")
def test_on_cuda_a_kept_captured_step_trains_the_next_seed_as_its_own_capture(data, tmp_path):
    model_config = {"vocab_cap": 64, "rms_norm_backend": "triton", "embedding_backend": "triton",
                    "attention_backend": "triton"}
    alone = train(_config(data, tmp_path / "alone", device="cuda", model_config=model_config, steps=4, seed=7))
    with loop.keeping_captured_steps():
        train(_config(data, tmp_path / "first", device="cuda", model_config=model_config, steps=4, seed=3))
        second = train(_config(data, tmp_path / "second", device="cuda", model_config=model_config, steps=4,
                               seed=7))
    assert second["telemetry"]["metadata"]["capture_reused"] is True
    # the same replayed kernels from the same weights and random state; atomics may add in another order
    assert second["losses"] == pytest.approx(alone["losses"], rel=1e-4)
    assert second["validation_metrics"]["auc"] == pytest.approx(alone["validation_metrics"]["auc"], abs=1e-3)
