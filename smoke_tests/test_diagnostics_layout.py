"""The diagnostic figures as a reader sees them: every title inside the figure with one to seven groups,
bars that start at zero, a visible mark on a partial preview, and empty predictions refused."""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
from matplotlib.container import BarContainer

import pcvr_lib.diagnostics as diagnostics
from pcvr_lib.cli import main as cli_main

matplotlib.use("Agg")
N = 40


def _write_run(path, experiment, seed, *, with_eval=True):
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    target = (np.arange(N) % 4 == 0).astype(float)
    score = np.clip(0.2 + 0.3 * target + 0.05 * rng.standard_normal(N), 0.001, 0.999)
    tel = {"elapsed_sec": 2.0, "rows_per_sec": 500.0, "cpu_peak_rss_mb": 800.0, "cuda_peak_allocated_mb": None}
    (path / "training_summary.json").write_text(json.dumps(
        {"experiment_name": experiment, "validation_metrics": {"auc": 0.7 + seed / 1000, "logloss": 0.3}}))
    (path / "training_telemetry.json").write_text(json.dumps(tel))
    if with_eval:
        (path / "evaluation.json").write_text(json.dumps({"experiment_name": experiment, "metrics": {"auc": 0.5}}))
        (path / "evaluation_telemetry.json").write_text(json.dumps(tel))
        (path / "validation_predictions.jsonl").write_text("".join(
            json.dumps({"sample_index": i, "user_id": i, "score": float(score[i]), "target": float(target[i]),
                        "timestamp": i}) + "\n" for i in range(N)))


@pytest.fixture
def captured(monkeypatch):
    """The figures plot_diagnostics makes, kept open for inspection instead of closed after saving."""
    real = diagnostics._plt
    figures = []

    class KeepOpen:
        def __getattr__(self, name):
            return getattr(real(), name)

        def close(self, fig):
            figures.append(fig)

    monkeypatch.setattr(diagnostics, "_plt", lambda: KeepOpen())
    yield figures
    for fig in figures:
        real().close(fig)


def _runs(tmp_path, groups, seeds=(1, 2), **kw):
    specs = []
    for g in range(groups):
        for seed in seeds:
            d = tmp_path / f"model_with_a_rather_long_name_{g}_seed{seed}"
            _write_run(d, f"model_with_a_rather_long_name_{g}", seed, **kw)
            specs.append(str(d))
    return specs


@pytest.mark.parametrize("groups", [1, 2, 7])
def test_titles_fit_and_bars_start_at_zero(tmp_path, captured, groups):
    diagnostics.plot_diagnostics(_runs(tmp_path, groups), tmp_path / "out")
    assert len(captured) == len(diagnostics.FIGURES)
    for fig in captured:
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        titles = [fig._suptitle] + [ax.title for ax in fig.axes if ax.get_visible()]
        for text in titles:
            if text is None or not text.get_text():
                continue
            ext = text.get_window_extent(renderer)
            assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1 and ext.y1 <= box.y1 + 1, text.get_text()
        for ax in fig.axes:
            for bars in ax.containers:
                if not isinstance(bars, BarContainer):
                    continue
                low = ax.get_xlim()[0] if bars.orientation == "horizontal" else ax.get_ylim()[0]
                assert low <= 0, f"{fig._suptitle.get_text()}: {ax.get_title()}: bars do not start at zero"


def test_partial_preview_is_marked(tmp_path, captured):
    specs = _runs(tmp_path, 2) + [str(p) for p in [tmp_path / "lonely_seed1"]]
    _write_run(tmp_path / "lonely_seed1", "lonely", 1, with_eval=False)
    summary = diagnostics.plot_diagnostics(specs, tmp_path / "out", allow_partial=True)
    assert summary["partial"] is True
    for fig in captured:
        texts = [fig._suptitle.get_text()] + [t.get_text() for t in fig.texts]
        assert any("PARTIAL" in t for t in texts)


def test_complete_run_is_not_marked(tmp_path, captured):
    diagnostics.plot_diagnostics(_runs(tmp_path, 1), tmp_path / "out")
    assert not any("PARTIAL" in t.get_text() for fig in captured for t in [fig._suptitle, *fig.texts])


@pytest.mark.parametrize("content, expected", [
    ("", "holds no predictions"),
    ("\n\n", "holds no predictions"),
    ('{"sample_index": 1, "user_id": 1, "score": null, "target": 0, "timestamp": 1}\n', "not a prediction record"),
    ('{"sample_index": 1, "user_id": 1, "score": NaN, "target": 0, "timestamp": 1}\n', "not a finite number"),
])
def test_empty_or_non_finite_predictions_are_refused(tmp_path, capsys, content, expected):
    run = tmp_path / "r_seed1"
    _write_run(run, "r", 1)
    (run / "validation_predictions.jsonl").write_text(content)
    code = cli_main(["plot-diagnostics", "--run", str(run), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and err.startswith("pcvr plot-diagnostics: error: ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "stability.png").exists()
