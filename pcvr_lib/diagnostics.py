"""Smoke diagnostics: five figures and a machine-readable summary over several run directories.

`pcvr plot-diagnostics --run [label=]DIR ... --group-by experiment|label|label-prefix --output-dir DIR`

Per run dir: evaluation.json and validation_predictions.jsonl are required (written by `pcvr val`); the
training summary and the three telemetry files are read when present. Runs are grouped by the
evaluation's experiment name (default), by label, or by label prefix (`baseline_seed17` -> `baseline`);
the grouping drives every figure. Within a group, predictions are aligned by sample key and averaged over
seeds before groups are compared, so model differences are not mixed with seed noise.

Figures: runtime_resources (cost scorecard + quality vs cost; inference columns only when every group has
inference telemetry), prediction_distribution (seed-mean probabilities, positives vs negatives, mean
gap), prediction_correlation (Spearman between groups; Spearman across seeds within a group),
sample_disagreement (per-sample spread across groups, the most disputed samples), stability (metric mean
with sample SD and min-max whiskers; prediction seed drift = per-sample sample SD across seeds, averaged).
Quality metrics come from training_summary.json's validation_metrics (metric_source
"training_validation") and fall back to evaluation.json's metrics ("evaluation").

Where this differs from the reference: sample SD (ddof=1) where it computes the population SD, and
Spearman where it computes Pearson (its documentation says Spearman).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pcvr_lib.metrics import _average_ranks

REQUIRED_FILES = ("evaluation.json", "validation_predictions.jsonl")
OPTIONAL_FILES = ("training_summary.json", "training_telemetry.json", "evaluation_telemetry.json",
                  "inference_telemetry.json")
FIGURES = ("runtime_resources", "prediction_distribution", "prediction_correlation", "sample_disagreement",
           "stability")
SUMMARY_FILE = "pcvr_diagnostics_summary.json"
GROUP_MODES = ("experiment", "label", "label-prefix")
PREFIX_RE = re.compile(r"^(.*?)(?:[_-]seed[_-]?\d+|[_-]\d+)$")
TOP_N = 15


class DiagnosticsError(ValueError):
    """Runs cannot be plotted; exit code 2."""


@dataclass
class Run:
    label: str
    path: Path
    evaluation: dict | None = None
    summary: dict | None = None
    telemetry: dict[str, dict] = field(default_factory=dict)  # train / evaluation / inference
    keys: np.ndarray | None = None  # sample keys (int64)
    scores: np.ndarray | None = None
    targets: np.ndarray | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def experiment(self) -> str:
        for source in (self.evaluation, self.summary):
            if source and source.get("experiment_name"):
                return str(source["experiment_name"])
        return self.label

    def metrics(self) -> tuple[dict, str | None]:
        if self.summary and self.summary.get("validation_metrics"):
            return self.summary["validation_metrics"], "training_validation"
        if self.evaluation and self.evaluation.get("metrics"):
            return self.evaluation["metrics"], "evaluation"
        return {}, None


def parse_run_spec(spec: str) -> tuple[str | None, Path]:
    """`label=DIR` or `DIR`; a '=' inside a path (e.g. a checkpoint name) is not a label separator."""
    label, sep, rest = spec.partition("=")
    if sep and label and "/" not in label and rest:
        return label, Path(rest)
    return None, Path(spec)


def group_key(run: Run, mode: str) -> str:
    if mode == "experiment":
        return run.experiment
    if mode == "label":
        return run.label
    m = PREFIX_RE.match(run.label)
    return m.group(1) if m and m.group(1) else run.label


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DiagnosticsError(f"{path}: not valid JSON ({exc})") from exc


def load_run(label: str | None, path: Path) -> Run:
    if not path.is_dir():
        raise DiagnosticsError(f"run directory not found: {path}")
    run = Run(label=label or path.name, path=path)
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            run.missing.append(name)
    if (path / "evaluation.json").is_file():
        run.evaluation = _read_json(path / "evaluation.json")
    if (path / "training_summary.json").is_file():
        run.summary = _read_json(path / "training_summary.json")
    for kind, name in (("train", "training_telemetry.json"), ("evaluation", "evaluation_telemetry.json"),
                       ("inference", "inference_telemetry.json")):
        if (path / name).is_file():
            run.telemetry[kind] = _read_json(path / name)
    preds = path / "validation_predictions.jsonl"
    if preds.is_file():
        keys, scores, targets = [], [], []
        for i, line in enumerate(preds.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                keys.append(int(row["sample_index"]))
                scores.append(float(row["score"]))
                targets.append(float(row["target"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise DiagnosticsError(f"{preds}: line {i} is not a prediction record ({exc})") from exc
            if not np.isfinite(scores[-1]):
                raise DiagnosticsError(f"{preds}: line {i}: score {scores[-1]} is not a finite number; rerun "
                                       f"pcvr val --run-dir {path}")
        if not keys:
            raise DiagnosticsError(f"{preds} holds no predictions (empty file); rerun pcvr val --run-dir {path}")
        run.keys = np.asarray(keys, dtype=np.int64)
        run.scores = np.asarray(scores, dtype=np.float64)
        run.targets = np.asarray(targets, dtype=np.float64)
        if len(np.unique(run.keys)) != len(run.keys):
            raise DiagnosticsError(f"{preds}: duplicate sample_index values; predictions must be keyed per sample")
    return run


def refusal_message(runs: list[Run]) -> str:
    lines = ["cannot plot diagnostics: some runs lack evaluation artifacts"]
    for run in runs:
        if run.missing:
            lines.append(f"  {run.label} ({run.path}): missing {', '.join(run.missing)}")
            lines.append(f"    make them with: pcvr val --run-dir {run.path}")
    lines.append("(or pass --allow-partial to preview the figures without them; not for analysis)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ statistics
def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if len(a) < 3:
        return None
    ra, rb = _average_ranks(a), _average_ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _stats(values: list[float]) -> dict[str, Any]:
    vals = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if len(vals) == 0:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "mean": float(vals.mean()),
        "sd": float(vals.std(ddof=1)) if len(vals) > 1 else None,  # sample SD
        "min": float(vals.min()),
        "max": float(vals.max()),
        "n": int(len(vals)),
        "values": [float(v) for v in vals],
    }


@dataclass
class Group:
    name: str
    runs: list[Run]
    keys: np.ndarray | None = None  # aligned sample keys (intersection within the group)
    mean_scores: np.ndarray | None = None
    targets: np.ndarray | None = None
    seed_matrix: np.ndarray | None = None  # [runs with predictions, keys]


def _align(runs: list[Run], keys: np.ndarray | None = None):
    """Score matrix of runs over common sample keys (the intersection, or the given keys)."""
    with_preds = [r for r in runs if r.keys is not None]
    if not with_preds:
        return None, None, None
    if keys is None:
        keys = with_preds[0].keys
        for r in with_preds[1:]:
            keys = np.intersect1d(keys, r.keys)
        keys = np.sort(keys)
    matrix, targets = [], None
    for r in with_preds:
        order = np.argsort(r.keys)
        pos = order[np.searchsorted(r.keys[order], keys)]
        matrix.append(r.scores[pos])
        if targets is None:
            targets = r.targets[pos]
    return keys, np.vstack(matrix), targets


def build_groups(runs: list[Run], mode: str) -> list[Group]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(group_key(run, mode), []).append(run)
    out = []
    for name, members in groups.items():
        keys, matrix, targets = _align(members)
        g = Group(name, members, keys, None if matrix is None else np.nanmean(matrix, axis=0), targets, matrix)
        out.append(g)
    return out


def _telemetry_value(run: Run, kind: str, key: str):
    value = run.telemetry.get(kind, {}).get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def summarise(runs: list[Run], groups: list[Group], mode: str, warnings: list[str]) -> dict[str, Any]:
    has_inference = all(any("inference" in r.telemetry for r in g.runs) for g in groups)
    summary_groups = {}
    for g in groups:
        metric_values: dict[str, list] = {"auc": [], "logloss": [], "brier": []}
        sources = set()
        for r in g.runs:
            m, source = r.metrics()
            if source:
                sources.add(source)
            for k in metric_values:
                metric_values[k].append(m.get(k))
        resources = {}
        for kind in ("train", "evaluation", "inference"):
            for key in ("elapsed_sec", "rows_per_sec", "cpu_peak_rss_mb", "cuda_peak_allocated_mb"):
                resources[f"{kind}_{key}"] = _stats([_telemetry_value(r, kind, key) for r in g.runs])
        params = next((r.telemetry[k].get("model_parameters") for r in g.runs for k in r.telemetry
                       if r.telemetry[k].get("model_parameters")), None)
        drift = None
        if g.seed_matrix is not None and g.seed_matrix.shape[0] > 1:
            drift = float(np.nanmean(np.nanstd(g.seed_matrix, axis=0, ddof=1)))
        gap = None
        if g.mean_scores is not None and g.targets is not None:
            pos, neg = g.mean_scores[g.targets > 0.5], g.mean_scores[g.targets <= 0.5]
            if len(pos) and len(neg):
                gap = float(np.nanmean(pos) - np.nanmean(neg))
        within = []
        if g.seed_matrix is not None:
            n = g.seed_matrix.shape[0]
            within = [spearman(g.seed_matrix[i], g.seed_matrix[j]) for i in range(n) for j in range(i + 1, n)]
            within = [w for w in within if w is not None]
        summary_groups[g.name] = {
            "runs": [{"label": r.label, "path": str(r.path), "missing": r.missing} for r in g.runs],
            "metric_source": sorted(sources)[0] if len(sources) == 1 else (sorted(sources) or None),
            "metrics": {k: _stats(v) for k, v in metric_values.items()},
            "resources": resources,
            "model_parameters": params,
            "prediction_seed_drift": drift,
            "seed_spearman": _stats(within),
            "mean_gap": gap,
            "aligned_samples": None if g.keys is None else int(len(g.keys)),
        }
    # between groups: seed-mean predictions on the samples every group has
    usable = [g for g in groups if g.keys is not None]
    common = None
    for g in usable:
        common = g.keys if common is None else np.intersect1d(common, g.keys)
    between = {"groups": [g.name for g in usable], "matrix": [], "samples": 0 if common is None else len(common)}
    disagreement: dict[str, Any] = {"samples": 0, "top": []}
    if usable and common is not None and len(common):
        for g in usable:
            if len(g.keys) != len(common):
                warnings.append(f"group {g.name}: {len(g.keys) - len(common)} sample(s) not shared by every "
                                "group were left out of the comparisons")
        aligned = np.vstack([_on_keys(g, common) for g in usable])
        between["matrix"] = [[spearman(aligned[i], aligned[j]) if i != j else 1.0 for j in range(len(usable))]
                             for i in range(len(usable))]
        targets = _targets_on_keys(usable[0], common)
        if len(usable) > 1:
            spread = np.nanstd(aligned, axis=0, ddof=1)
            order = np.argsort(-np.nan_to_num(spread, nan=-1.0))[:TOP_N]
            disagreement = {
                "samples": int(len(common)),
                "mean_spread": float(np.nanmean(spread)),
                "top": [{"sample_index": int(common[i]), "target": float(targets[i]), "spread": float(spread[i]),
                         "scores": {g.name: float(aligned[k, i]) for k, g in enumerate(usable)}} for i in order],
            }
    return {
        "group_by": mode,
        "runs": len(runs),
        "groups": summary_groups,
        "inference_complete": has_inference,
        "correlation": {"method": "spearman", "between_groups": between},
        "disagreement": disagreement,
        "sd": "sample (ddof=1)",
        "warnings": warnings,
    }


def _on_keys(g: Group, keys: np.ndarray) -> np.ndarray:
    pos = np.searchsorted(g.keys, keys)
    return g.mean_scores[pos]


def _targets_on_keys(g: Group, keys: np.ndarray) -> np.ndarray:
    return g.targets[np.searchsorted(g.keys, keys)]


# ---------------------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold",
                         "figure.titlesize": 13, "figure.titleweight": "bold"})
    return plt


def _no_data(ax, text="no data"):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _colors(n: int):
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _wrap(text: str, width_inches: float, fontsize: float) -> str:
    """Wrap a title to the width it has: at most about 0.7 em per character of a bold proportional font."""
    import textwrap

    chars = max(12, int(width_inches * 72 / (fontsize * 0.7)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _finish(plt, fig, title: str, out: Path, partial: bool = False) -> None:
    """Title, lay out, save at 110 dpi and close a figure (every figure ends the same way). Titles are
    wrapped to their width, so they fit with one group as with seven; a partial preview says so on the
    figure itself, in red, where nobody can miss it."""
    width = fig.get_figwidth()
    for ax in fig.axes:
        if ax.get_title():
            ax_width = width * ax.get_position().width
            ax.set_title(_wrap(ax.get_title(), ax_width, plt.rcParams["axes.titlesize"]))
    if partial:
        title = f"PARTIAL PREVIEW (runs lack evaluation artifacts; not for analysis)\n{title}"
    fig.suptitle(_wrap(title, width * 0.95, plt.rcParams["figure.titlesize"]), color="#C00000" if partial else None)
    if partial:
        fig.text(0.5, 0.5, "PARTIAL", fontsize=72, color="#C00000", alpha=0.15, ha="center", va="center",
                 rotation=30, transform=fig.transFigure, zorder=0)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _fmt(value, digits=3):
    return "n/a" if value is None else f"{value:.{digits}f}"


def fig_runtime(summary: dict, out: Path) -> None:
    plt = _plt()
    groups = list(summary["groups"])
    g = summary["groups"]
    phases = ["train", "evaluation"] + (["inference"] if summary["inference_complete"] else [])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    x = np.arange(len(groups))
    width = 0.8 / len(phases)
    colors = {"train": "#4C72B0", "evaluation": "#55A868", "inference": "#C44E52"}
    for panel, key, title, ylabel in ((axes[0, 0], "elapsed_sec", "Wall time per phase (group mean)", "seconds"),
                                      (axes[0, 1], "rows_per_sec", "Throughput per phase (group mean)", "rows / s")):
        any_bar = False
        for i, phase in enumerate(phases):
            vals = [g[name]["resources"][f"{phase}_{key}"]["mean"] for name in groups]
            heights = [v if v is not None else 0.0 for v in vals]
            bars = panel.bar(x + (i - (len(phases) - 1) / 2) * width, heights, width, label=phase,
                             color=colors[phase])
            for bar, v in zip(bars, vals, strict=True):
                if v is not None:
                    any_bar = True
                    panel.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                   ha="center", va="bottom", fontsize=8)
        if not any_bar:
            _no_data(panel, "no telemetry")
            continue
        panel.set_xticks(x, groups, rotation=20, ha="right")
        panel.set_title(title)
        panel.set_ylabel(ylabel)
        panel.legend(fontsize=8)
        panel.margins(y=0.15)
    ax = axes[1, 0]
    mem_keys = [("train_cpu_peak_rss_mb", "CPU peak RSS, train"), ("inference_cpu_peak_rss_mb", "CPU peak RSS, infer"),
                ("train_cuda_peak_allocated_mb", "CUDA peak alloc, train")]
    mem_keys = [(k, lab) for k, lab in mem_keys if any(g[n]["resources"][k]["mean"] is not None for n in groups)]
    if mem_keys:
        w = 0.8 / len(mem_keys)
        for i, (k, lab) in enumerate(mem_keys):
            vals = [g[n]["resources"][k]["mean"] or 0.0 for n in groups]
            bars = ax.bar(x + (i - (len(mem_keys) - 1) / 2) * w, vals, w, label=lab)
            for bar, v in zip(bars, vals, strict=True):
                ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, groups, rotation=20, ha="right")
        ax.set_ylabel("MiB")
        ax.set_title("Peak memory (group mean)")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    else:
        _no_data(ax, "no memory telemetry")
    ax = axes[1, 1]
    cost_phase = "inference" if summary["inference_complete"] else "evaluation"
    cost_key = f"{cost_phase}_rows_per_sec"
    pts = [(n, g[n]["resources"][cost_key]["mean"], g[n]["metrics"]["auc"]["mean"]) for n in groups]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if pts:
        for (name, cost, auc), color in zip(pts, _colors(len(pts)), strict=True):
            ax.scatter(cost, auc, s=90, color=color, edgecolor="black", zorder=3)
            ax.annotate(name, (cost, auc), textcoords="offset points", xytext=(6, 6), fontsize=9)
        ax.set_xlabel(f"{cost_phase} rows / s (higher is cheaper)")
        ax.set_ylabel("AUC (group mean)")
        ax.set_title(f"Quality vs cost ({'inference' if cost_phase == 'inference' else 'evaluation'} efficiency)")
        ax.grid(alpha=0.3)
        ax.margins(0.2)
    else:
        _no_data(ax, "no AUC / telemetry")
    _finish(plt, fig, "Runtime and resources", out, summary["partial"])


def fig_distribution(groups: list[Group], summary: dict, out: Path) -> None:
    plt = _plt()
    n = max(len(groups), 1)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    bins = np.linspace(0, 1, 41)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, g in zip(axes.flat, groups, strict=False):
        if g.mean_scores is None:
            _no_data(ax, f"{g.name}: no predictions")
            continue
        pos = g.mean_scores[(g.targets > 0.5) & np.isfinite(g.mean_scores)]
        neg = g.mean_scores[(g.targets <= 0.5) & np.isfinite(g.mean_scores)]
        hi = float(np.nanmax(g.mean_scores)) if len(g.mean_scores) else 1.0
        edges = np.linspace(0, min(1.0, hi * 1.1 + 1e-3), 31) if hi < 0.5 else bins
        ax.hist(neg, bins=edges, alpha=0.6, density=True, label=f"negatives (n={len(neg)})", color="#4C72B0")
        ax.hist(pos, bins=edges, alpha=0.6, density=True, label=f"positives (n={len(pos)})", color="#DD8452")
        gap = summary["groups"][g.name]["mean_gap"]
        ax.set_title(f"{g.name}: mean gap {_fmt(gap)}")
        ax.set_xlabel(f"seed-mean probability ({len(g.runs)} run(s))")
        ax.set_ylabel("density")
        ax.legend(fontsize=8)
    if not groups:
        _no_data(axes[0, 0])
    _finish(plt, fig, "Prediction distribution: positives vs negatives", out, summary["partial"])


def fig_correlation(groups: list[Group], summary: dict, out: Path) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    between = summary["correlation"]["between_groups"]
    names = between["groups"]
    if len(names) >= 2:
        m = np.array([[np.nan if v is None else v for v in row] for row in between["matrix"]])
        im = ax1.imshow(m, vmin=-1, vmax=1, cmap="RdBu_r")
        ax1.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax1.set_yticks(range(len(names)), names)
        for i in range(len(names)):
            for j in range(len(names)):
                ax1.text(j, i, _fmt(None if np.isnan(m[i, j]) else m[i, j], 2), ha="center", va="center",
                         fontsize=10, color="white" if abs(np.nan_to_num(m[i, j])) > 0.6 else "black")
        fig.colorbar(im, ax=ax1, fraction=0.046, pad=0.04)
        ax1.set_title(f"Between groups: Spearman of seed-mean predictions\n({between['samples']} shared samples)")
    else:
        _no_data(ax1, "needs two groups with predictions")
        ax1.set_title("Between groups (Spearman)")
    vals = [(g.name, summary["groups"][g.name]["seed_spearman"]) for g in groups]
    vals = [(n, s) for n, s in vals if s["n"] > 0]
    if vals:
        x = np.arange(len(vals))
        means = [s["mean"] for _, s in vals]
        lows = [s["mean"] - s["min"] for _, s in vals]
        highs = [s["max"] - s["mean"] for _, s in vals]
        ax2.bar(x, means, color=_colors(len(vals)), edgecolor="black")
        ax2.errorbar(x, means, yerr=[lows, highs], fmt="none", ecolor="black", capsize=5)
        for i, (_, s) in enumerate(vals):
            ax2.annotate(f"{s['mean']:.3f}\n({s['n']} pairs)", (i, s["max"]), textcoords="offset points",
                         xytext=(0, 4), ha="center", fontsize=8)
        ax2.set_xticks(x, [n for n, _ in vals], rotation=20, ha="right")
        ax2.set_ylim(min(0.0, min(s["min"] for _, s in vals) - 0.05), 1.12)
        ax2.set_ylabel("Spearman between seeds")
        ax2.set_title("Within group: Spearman across seeds\n(bar = mean over seed pairs, whiskers = min-max)")
    else:
        _no_data(ax2, "needs a group with two or more seeds")
        ax2.set_title("Within group (Spearman across seeds)")
    _finish(plt, fig, "Prediction correlation (Spearman rank correlation)", out, summary["partial"])


def fig_disagreement(summary: dict, out: Path) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.8), gridspec_kw={"width_ratios": [1, 1.4]})
    dis = summary["disagreement"]
    names = summary["correlation"]["between_groups"]["groups"]
    if dis.get("top"):
        spreads = [t["spread"] for t in dis["top"]]
        ax1.barh(range(len(spreads))[::-1], spreads, color="#8172B2")
        labels = [f"#{t['sample_index']} (y={int(t['target'])})" for t in dis["top"]]
        ax1.set_yticks(range(len(spreads))[::-1], labels, fontsize=8)
        ax1.set_xlabel("SD of seed-mean probability across groups")
        ax1.set_title(f"Top {len(spreads)} disputed samples\n(mean spread over {dis['samples']} samples: "
                      f"{dis['mean_spread']:.4f})")
        colors = _colors(len(names))
        for k, name in enumerate(names):
            xs = [t["scores"][name] for t in dis["top"]]
            ax2.scatter(xs, range(len(xs))[::-1], color=colors[k], label=name, s=45, edgecolor="black", zorder=3)
        ax2.set_yticks(range(len(labels))[::-1], labels, fontsize=8)
        ax2.set_xlabel("seed-mean probability")
        ax2.set_title("Each group's score on the disputed samples")
        ax2.grid(axis="x", alpha=0.3)
        ax2.legend(fontsize=8, loc="best")
    else:
        _no_data(ax1, "needs two groups with predictions")
        _no_data(ax2, "needs two groups with predictions")
    _finish(plt, fig, "Sample disagreement between groups", out, summary["partial"])


def fig_stability(summary: dict, out: Path) -> None:
    plt = _plt()
    names = list(summary["groups"])
    g = summary["groups"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    colors = _colors(len(names))
    for ax, metric in ((axes[0], "auc"), (axes[1], "logloss")):
        stats = [g[n]["metrics"][metric] for n in names]
        idx = [i for i, s in enumerate(stats) if s["n"] > 0]
        if not idx:
            _no_data(ax, f"no {metric}")
            continue
        x = np.arange(len(idx))
        means = [stats[i]["mean"] for i in idx]
        ax.bar(x, means, color=[colors[i] for i in idx], edgecolor="black", alpha=0.85)
        ax.errorbar(x, means, yerr=[[stats[i]["mean"] - stats[i]["min"] for i in idx],
                                    [stats[i]["max"] - stats[i]["mean"] for i in idx]],
                    fmt="none", ecolor="black", capsize=6, label="min-max")
        for xi, i in zip(x, idx, strict=True):
            s = stats[i]
            for v in s["values"]:
                ax.scatter(xi, v, color="black", s=12, zorder=3)
            sd = f" ± {s['sd']:.4f}" if s["sd"] is not None else ""
            ax.annotate(f"{s['mean']:.4f}{sd}\n(n={s['n']})", (xi, s["max"]), textcoords="offset points",
                        xytext=(0, 5), ha="center", fontsize=8)
        hi = max(stats[i]["max"] for i in idx)
        ax.set_ylim(0, hi * 1.2 if hi > 0 else 1.0)  # bars start at zero: their heights compare honestly
        ax.set_xticks(x, [names[i] for i in idx], rotation=20, ha="right")
        source = {g[names[i]]["metric_source"] if isinstance(g[names[i]]["metric_source"], str) else "mixed"
                  for i in idx}
        ax.set_title(f"{metric.upper() if metric == 'auc' else 'LogLoss'}: mean ± sample SD, whiskers min-max\n"
                     f"(source: {', '.join(sorted(map(str, source)))})")
        ax.legend(fontsize=8, loc="lower right")
    ax = axes[2]
    drift = [(n, g[n]["prediction_seed_drift"]) for n in names]
    idx = [i for i, (_, d) in enumerate(drift) if d is not None]
    if idx:
        x = np.arange(len(idx))
        vals = [drift[i][1] for i in idx]
        ax.bar(x, vals, color=[colors[i] for i in idx], edgecolor="black")
        for xi, v in zip(x, vals, strict=True):
            ax.annotate(f"{v:.4f}", (xi, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
        ax.set_xticks(x, [names[i] for i in idx], rotation=20, ha="right")
        ax.set_ylabel("mean per-sample SD across seeds")
        ax.set_title("Prediction seed drift\n(per-sample sample SD across seeds, averaged)")
        ax.margins(y=0.15)
    else:
        _no_data(ax, "needs a group with two or more seeds")
        ax.set_title("Prediction seed drift")
    _finish(plt, fig, "Stability across seeds", out, summary["partial"])


# ---------------------------------------------------------------------------------------------- driver
def plot_diagnostics(
    run_specs: list[str],
    output_dir: str | Path,
    group_by: str = "experiment",
    allow_partial: bool = False,
    figures: bool = True,
) -> dict[str, Any]:
    """Load the runs, write the five figures (unless figures=False) and the summary JSON; returns the
    summary."""
    if group_by not in GROUP_MODES:
        raise DiagnosticsError(f"--group-by must be one of {', '.join(GROUP_MODES)}, got {group_by!r}")
    if not run_specs:
        raise DiagnosticsError("no --run given")
    runs = [load_run(*parse_run_spec(spec)) for spec in run_specs]
    labels = [r.label for r in runs]
    duplicates = sorted({lab for lab in labels if labels.count(lab) > 1})
    if duplicates:
        raise DiagnosticsError(f"duplicate run labels {duplicates}: give each run a distinct label=DIR")
    warnings: list[str] = []
    if any(r.missing for r in runs):
        if not allow_partial:
            raise DiagnosticsError(refusal_message(runs))
        for r in runs:
            if r.missing:
                warnings.append(f"{r.label}: missing {', '.join(r.missing)} (partial preview, not for analysis)")
    groups = build_groups(runs, group_by)
    summary = summarise(runs, groups, group_by, warnings)
    summary["partial"] = bool(warnings and allow_partial)
    out = Path(output_dir)
    from pcvr_lib.errors import check_writable

    check_writable(out, "--output-dir")
    if figures:
        fig_runtime(summary, out / "runtime_resources.png")
        fig_distribution(groups, summary, out / "prediction_distribution.png")
        fig_correlation(groups, summary, out / "prediction_correlation.png")
        fig_disagreement(summary, out / "sample_disagreement.png")
        fig_stability(summary, out / "stability.png")
    summary["figures"] = {name: str(out / f"{name}.png") for name in FIGURES} if figures else {}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, allow_nan=False, default=_nan_safe) + "\n")
    return summary


def _nan_safe(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(type(obj).__name__)


def report(summary: dict) -> str:
    """The short terminal report: one line per group."""
    head = (f"{'group':<18} {'runs':>4} {'AUC mean ± sd':>18} {'LogLoss':>8} {'drift':>8} {'train s':>8} "
            f"{'infer rows/s':>12}")
    lines = [head, "-" * len(head)]
    for name, g in summary["groups"].items():
        auc, ll = g["metrics"]["auc"], g["metrics"]["logloss"]
        auc_text = "n/a" if auc["mean"] is None else f"{auc['mean']:.4f} ± {_fmt(auc['sd'], 4)}"
        lines.append(
            f"{name:<18} {len(g['runs']):>4} {auc_text:>18} {_fmt(ll['mean'], 4):>8} "
            f"{_fmt(g['prediction_seed_drift'], 4):>8} {_fmt(g['resources']['train_elapsed_sec']['mean'], 1):>8} "
            f"{_fmt(g['resources']['inference_rows_per_sec']['mean'], 0):>12}"
        )
    for w in summary["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", action="append", default=[], metavar="[LABEL=]DIR", required=True,
                        help="a run directory (repeat); LABEL defaults to the directory name")
    parser.add_argument("--group-by", choices=GROUP_MODES, default="experiment",
                        help="group runs by experiment name (default), label, or label prefix (baseline_seed17 -> "
                             "baseline)")
    parser.add_argument("--output-dir", required=True, help="where the five PNG figures and the summary JSON go")
    parser.add_argument("--allow-partial", action="store_true",
                        help="plot even when runs lack evaluation artifacts (preview only, not for analysis)")
    parser.add_argument("--json", action="store_true", help="print the full summary JSON to stdout")


def run(args: argparse.Namespace) -> int:
    summary = plot_diagnostics(args.run, args.output_dir, args.group_by, args.allow_partial)
    if args.json:
        print(json.dumps(summary, indent=2, default=_nan_safe))
    else:
        print(report(summary))
        print(f"figures and {SUMMARY_FILE} in {args.output_dir}")
    return 0
