"""`pcvr train --compile / --graph`: the compiled model trains as the eager one does (captured table
gradients handed to the optimizers), a model that fails to compile falls back to eager with a warning and
the reason in the telemetry, and --graph without a CUDA device is refused before any work.

Compiled with "aot_eager" here (the traced forward and backward graphs, without inductor's minute of code
generation per model on a CPU); smoke_tests/test_model_compile.py checks every model."""

from __future__ import annotations

import functools

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
def test_graph_mode_needs_a_cuda_device(data, tmp_path, capsys):
    code = cli_main(["train", "--model", "baseline", "--data", str(data), "--run-dir", str(tmp_path / "g"),
                     "--graph", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--graph: mode 'graph' replays CUDA graphs and needs a CUDA device" in err, err
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())
