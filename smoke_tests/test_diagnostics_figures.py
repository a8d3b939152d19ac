"""plot-diagnostics on synthetic run directories: figures, summary fields, grouping, refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pcvr_lib.cli import main as cli_main
from pcvr_lib.diagnostics import FIGURES, SUMMARY_FILE, group_key, parse_run_spec, plot_diagnostics, spearman

N = 60


def _write_run(path, experiment, seed, *, shift=0.0, with_eval=True, with_inference=True, auc=0.7):
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    target = (np.arange(N) % 4 == 0).astype(float)
    score = np.clip(0.1 + 0.3 * target + shift + 0.05 * rng.standard_normal(N), 0.001, 0.999)
    tel = {"elapsed_sec": 2.0 + seed / 100, "rows_per_sec": 500.0, "cpu_peak_rss_mb": 800.0,
           "cuda_peak_allocated_mb": None, "model_parameters": {"total": 1000}}
    (path / "training_summary.json").write_text(json.dumps({
        "experiment_name": experiment, "validation_metrics": {"auc": auc + seed / 1000, "logloss": 0.3}}))
    (path / "training_telemetry.json").write_text(json.dumps(tel))
    if with_eval:
        (path / "evaluation.json").write_text(json.dumps({"experiment_name": experiment, "metrics": {"auc": 0.5}}))
        (path / "evaluation_telemetry.json").write_text(json.dumps(tel))
        with (path / "validation_predictions.jsonl").open("w") as f:
            for i in range(N):
                f.write(json.dumps({"sample_index": 1000 + i, "user_id": i // 3, "score": float(score[i]),
                                    "target": float(target[i]), "timestamp": i}) + "\n")
    if with_inference:
        (path / "inference_telemetry.json").write_text(json.dumps(tel))


@pytest.fixture
def runs(tmp_path):
    specs = []
    for model, shift in (("alpha", 0.0), ("beta", 0.05)):
        for seed in (17, 42, 97):
            d = tmp_path / f"{model}_seed{seed}"
            _write_run(d, model, seed, shift=shift)
            specs.append(f"{model}_seed{seed}={d}")
    return specs


def test_figures_and_summary(runs, tmp_path):
    out = tmp_path / "figs"
    summary = plot_diagnostics(runs, out, group_by="experiment")
    for name in FIGURES:
        png = out / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    saved = json.loads((out / SUMMARY_FILE).read_text())
    assert saved["group_by"] == "experiment" and set(saved["groups"]) == {"alpha", "beta"}
    alpha = saved["groups"]["alpha"]
    aucs = [0.717, 0.742, 0.797]
    assert alpha["metrics"]["auc"]["mean"] == pytest.approx(np.mean(aucs))
    assert alpha["metrics"]["auc"]["sd"] == pytest.approx(np.std(aucs, ddof=1))  # sample SD
    assert alpha["metrics"]["auc"]["min"] == pytest.approx(0.717)
    assert alpha["metrics"]["auc"]["max"] == pytest.approx(0.797)
    assert alpha["metric_source"] == "training_validation"
    assert alpha["prediction_seed_drift"] > 0 and alpha["seed_spearman"]["n"] == 3
    assert alpha["mean_gap"] == pytest.approx(0.3, abs=0.05)
    assert saved["inference_complete"] is True
    between = saved["correlation"]["between_groups"]
    assert saved["correlation"]["method"] == "spearman" and between["samples"] == N
    assert 0.5 < between["matrix"][0][1] <= 1.0
    assert len(saved["disagreement"]["top"]) == 15
    assert summary["figures"]["stability"].endswith("stability.png")


def test_grouping_modes(runs, tmp_path):
    by_label = plot_diagnostics(runs, tmp_path / "a", group_by="label", figures=False)
    assert len(by_label["groups"]) == 6
    by_prefix = plot_diagnostics(runs, tmp_path / "b", group_by="label-prefix", figures=False)
    assert set(by_prefix["groups"]) == {"alpha", "beta"}
    assert parse_run_spec("x=some/dir") == ("x", __import__("pathlib").Path("some/dir"))
    assert parse_run_spec("runs/global_step3.AUC=0.5")[0] is None

    class R:
        label = "tokenformer_seed42"
    assert group_key(R, "label-prefix") == "tokenformer"


def test_refuses_without_evaluation_artifacts(tmp_path, capsys):
    d = tmp_path / "gamma_seed1"
    _write_run(d, "gamma", 1, with_eval=False)
    code = cli_main(["plot-diagnostics", "--run", str(d), "--output-dir", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "evaluation.json" in err and "validation_predictions.jsonl" in err
    assert f"pcvr val --run-dir {d}" in err
    assert not (tmp_path / "o").exists()
    # --allow-partial previews with placeholders instead
    assert cli_main(["plot-diagnostics", "--run", str(d), "--output-dir", str(tmp_path / "o"),
                     "--allow-partial", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["partial"] is True and out["warnings"]
    assert all((tmp_path / "o" / f"{n}.png").is_file() for n in FIGURES)


def test_inference_columns_only_when_every_group_has_them(tmp_path):
    a, b = tmp_path / "a_seed1", tmp_path / "b_seed1"
    _write_run(a, "a", 1)
    _write_run(b, "b", 1, with_inference=False)
    summary = plot_diagnostics([str(a), str(b)], tmp_path / "o", figures=False)
    assert summary["inference_complete"] is False


def test_spearman_is_rank_based():
    x = np.arange(10.0)
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -np.exp(x)) == pytest.approx(-1.0)
    assert spearman(x, np.ones(10)) is None
