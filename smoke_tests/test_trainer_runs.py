"""Trainer: artifacts, checkpoints rebuilt from files, non-finite steps skipped, clipping, bad inputs."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import pcvr_lib.train as trainer
from pcvr_lib.cli import main as cli_main
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.metrics import auc
from pcvr_lib.train import TrainConfig, TrainError, infer, loop, train, validate
from pcvr_lib.workloads.models import DEMO_SCHEMA

ROWS = 120
MAX_LENS = "seq_a:6,seq_b:6,seq_c:6,seq_d:6"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_dataset(DEMO_SCHEMA, rows=ROWS, seed=5, out=tmp_path_factory.mktemp("data") / "d.parquet",
                            progress=False)


def _config(data, run_dir, **kw):
    base = dict(model="onetrans", data=str(data), run_dir=str(run_dir), max_lens=MAX_LENS, steps=3, batch_size=32,
                eval_batch_size=64, model_config={"vocab_cap": 128}, seed=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "onetrans_seed1"
    summary = train(_config(data, run_dir))
    evaluation = validate(run_dir)
    telemetry = infer(run_dir)
    return run_dir, summary, evaluation, telemetry


TELEMETRY_FIELDS = {"label", "started_at", "ended_at", "elapsed_sec", "cpu_peak_rss_mb", "device",
                    "cuda_peak_allocated_mb", "cuda_peak_reserved_mb", "rows", "rows_per_sec", "batches_per_sec",
                    "steps_per_sec", "model_parameters", "metadata"}


def test_artifacts_complete_and_well_formed(finished_run):
    run_dir, summary, evaluation, _ = finished_run
    names = {p.name for p in run_dir.iterdir()}
    for name in ("training_summary.json", "training_telemetry.json", "evaluation.json",
                 "validation_predictions.jsonl", "evaluation_telemetry.json", "predictions.json",
                 "inference_telemetry.json"):
        assert name in names, name
    checkpoints = [n for n in names if n.startswith("global_step")]
    assert len(checkpoints) == 1 and re.fullmatch(r"global_step3\.AUC=\d\.\d{6}", checkpoints[0])

    s = json.loads((run_dir / "training_summary.json").read_text())
    assert s["split"]["method"] == "timestamp_auto" and s["split"]["valid_ratio"] == 0.2
    assert s["split"]["train_rows"] + s["split"]["valid_rows"] == ROWS
    assert set(s["validation_metrics"]) >= {"auc", "logloss", "metric_source"}
    assert set(s["validation_score_diagnostics"]) >= {"count", "positive_rate", "score_mean", "score_std",
                                                        "positive_mean", "negative_mean", "margin",
                                                        "positive_quantiles", "negative_quantiles"}
    assert s["steps"] == 3 and len(s["losses"]) == 3
    assert 0.0 < s["telemetry"]["metadata"]["train_positive_rate"] < 0.5  # the logit bias started there
    for name in ("training_telemetry.json", "evaluation_telemetry.json", "inference_telemetry.json"):
        t = json.loads((run_dir / name).read_text())
        assert TELEMETRY_FIELDS <= set(t), name
        assert t["elapsed_sec"] > 0 and t["rows"] > 0 and t["model_parameters"]["total"] > 0

    e = json.loads((run_dir / "evaluation.json").read_text())
    assert set(e) >= {"experiment_name", "checkpoint_path", "metrics", "validation_predictions_path", "telemetry"}
    assert set(e["metrics"]) >= {"auc", "auc_ci", "logloss", "brier", "score_diagnostics", "sample_count"}
    lines = [json.loads(x) for x in (run_dir / "validation_predictions.jsonl").read_text().splitlines()]
    assert len(lines) == s["split"]["valid_rows"] == e["metrics"]["sample_count"]
    assert all(set(x) == {"sample_index", "user_id", "score", "target", "timestamp"} for x in lines)
    # val rebuilt from the checkpoint files scores the holdout exactly like the end of training
    assert e["metrics"]["auc"] == pytest.approx(s["validation_metrics"]["auc"], abs=1e-12)
    assert auc([x["target"] for x in lines], [x["score"] for x in lines]) == pytest.approx(e["metrics"]["auc"])

    p = json.loads((run_dir / "predictions.json").read_text())
    assert len(p["predictions"]) == ROWS  # keyed by sample: rows sharing a user id all survive
    assert sorted(map(int, p["predictions"])) == list(range(ROWS))
    assert all(0.0 <= v <= 1.0 for v in p["predictions"].values())


def test_same_seed_same_training(data, tmp_path, finished_run):
    _, first, _, _ = finished_run
    again = train(_config(data, tmp_path / "again"))
    assert again["losses"] == first["losses"]
    assert again["validation_metrics"]["auc"] == first["validation_metrics"]["auc"]


def test_non_finite_loss_skips_the_step(data, tmp_path, monkeypatch):
    real = loop.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def poisoned(logits, target, *a, **k):
        calls["n"] += 1
        loss = real(logits, target, *a, **k)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(loop.F, "binary_cross_entropy_with_logits", poisoned)
    summary = train(_config(data, tmp_path / "nan", steps=3))
    assert summary["skipped_steps"] == 1
    assert summary["losses"][1] is None and summary["losses"][0] is not None
    assert np.isfinite(summary["validation_metrics"]["logloss"])


def test_clipping_clips(data, tmp_path):
    loose = train(_config(data, tmp_path / "loose", steps=2, max_grad_norm=1e6))
    tight = train(_config(data, tmp_path / "tight", steps=2, max_grad_norm=1e-4))
    assert loose["clipped_steps"] == 0
    assert tight["clipped_steps"] == 2 and all(n > 1e-4 for n in tight["grad_norms"])
    # the clipped run barely moves: its second loss stays closer to its first
    assert abs(tight["losses"][1] - tight["losses"][0]) <= abs(loose["losses"][1] - loose["losses"][0]) + 1e-6


def test_checkpoint_loads_without_pickles(finished_run, monkeypatch):
    run_dir, *_ = finished_run
    assert not any(p.suffix in (".pt", ".pth", ".pkl", ".bin") for p in run_dir.rglob("*"))

    def refuse(*args, **kwargs):
        raise AssertionError("loading a checkpoint unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    model, _, config, folder = trainer.load_checkpoint(run_dir)
    monkeypatch.undo()
    assert config.model == "onetrans" and folder.parent == run_dir
    saved = load_file(str(folder / trainer.MODEL_FILE))
    state = model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())


def test_clear_errors_for_bad_paths_and_options(data, tmp_path, capsys):
    with pytest.raises(TrainError, match="data file not found"):
        train(_config(tmp_path / "missing.parquet", tmp_path / "x"))
    with pytest.raises(TrainError, match="no complete checkpoint under"):
        validate(tmp_path)
    with pytest.raises(TrainError, match="steps must be >= 1"):
        train(_config(data, tmp_path / "y", steps=0))
    with pytest.raises(TrainError, match="CUDA is not available|not a torch device"):
        train(_config(data, tmp_path / "z", device="cuda:7" if not torch.cuda.is_available() else "tpu"))
    assert cli_main(["val", "--run-dir", str(tmp_path)]) == 2
    assert "no complete checkpoint under" in capsys.readouterr().err
    assert cli_main(["train", "--model", "nope", "--data", str(data), "--run-dir", str(tmp_path / "n")]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_cli_train_val_infer(data, tmp_path, capsys):
    run_dir = tmp_path / "cli_run"
    assert cli_main(["train", "--model", "baseline", "--data", str(data), "--run-dir", str(run_dir),
                     "--max-lens", MAX_LENS, "--steps", "1", "--batch-size", "16",
                     "--model-config", '{"vocab_cap": 64}', "--log-every", "0"]) == 0
    assert cli_main(["val", "--run-dir", str(run_dir), "--rows", "all"]) == 0
    assert cli_main(["infer", "--checkpoint", str(run_dir), "--result-dir", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "holdout AUC" in out and "scored 120 rows" in out
    assert json.loads((run_dir / "evaluation.json").read_text())["metrics"]["sample_count"] == ROWS
    assert (tmp_path / "res" / "predictions.json").is_file()


def test_bf16_amp_training_and_deterministic_switch_restored(data, tmp_path):
    before = torch.are_deterministic_algorithms_enabled()
    summary = train(_config(data, tmp_path / "amp", steps=2, amp=True, model="tokenformer"))
    assert torch.are_deterministic_algorithms_enabled() == before
    assert summary["skipped_steps"] == 0 and all(np.isfinite(x) for x in summary["losses"])
    tel = summary["telemetry"]
    assert tel["metadata"]["amp"] is True and tel["wall_sec"] >= tel["elapsed_sec"] > 0


def test_a_file_is_hashed_again_once_it_changes_and_not_while_it_stays_the_same(tmp_path, monkeypatch):
    from pathlib import Path

    from pcvr_lib.train import checkpoint

    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 5000)
    fresh = checkpoint.file_sha256(path)  # written just now: not remembered (its times may not have settled)
    time.sleep(checkpoint.SETTLED_NS / 1e9 + 0.02)
    assert checkpoint.file_sha256(path) == fresh
    opened = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: opened.append(self) or real_open(self, *a, **k))
    assert checkpoint.file_sha256(path) == fresh and opened == []  # settled and unchanged: not read again
    with real_open(path, "r+b") as f:  # damaged in place, same size
        f.seek(100)
        f.write(b"b")
    damaged = checkpoint.file_sha256(path)
    assert opened == [path]
    assert damaged != fresh and damaged == hashlib.sha256(path.read_bytes()).hexdigest()
    names = ["x.bin", "y.bin", "z.bin"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * (3000 + i))
    assert checkpoint.files_sha256(tmp_path, names) == {
        name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in names}
