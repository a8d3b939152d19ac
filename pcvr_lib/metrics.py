"""Binary-classification metrics of the smoke: AUC by ranks, LogLoss, Brier, bootstrap AUC CI, and the
score diagnostics written into the run artifacts.

Rules: AUC gives tied scores half credit (average ranks); a single-class input has no AUC (NaN from `auc`,
null in `classification_metrics`, "undefined" in text: never 0.5, which would read as a chance model); non-finite
scores (and their targets) are dropped before any metric, and the count dropped is reported by
`score_diagnostics`. LogLoss clips probabilities to [1e-7, 1 - 1e-7].
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-7


def _clean(targets, scores) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(targets, dtype=np.float64).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"targets and scores differ in length: {y.shape[0]} vs {s.shape[0]}")
    keep = np.isfinite(s) & np.isfinite(y)
    return y[keep], s[keep]


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    # start index of each run of equal values
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    mean_rank = (starts + ends + 1) / 2.0  # ranks starts+1 .. ends, averaged
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def auc(targets, scores) -> float:
    """Area under the ROC curve (Mann-Whitney U / (n_pos * n_neg)); NaN (undefined) when one class is absent."""
    y, s = _clean(targets, scores)
    positive = y > 0.5
    n_pos = int(positive.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(s)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(targets, probabilities) -> float:
    y, p = _clean(targets, probabilities)
    if len(y) == 0:
        return float("nan")
    p = np.clip(p, EPS, 1 - EPS)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def brier(targets, probabilities) -> float:
    y, p = _clean(targets, probabilities)
    if len(y) == 0:
        return float("nan")
    return float(np.mean((p - y) ** 2))


def bootstrap_auc_ci(
    targets, scores, resamples: int = 200, seed: int = 42, level: float = 0.95
) -> dict[str, float | int]:
    """Percentile bootstrap CI of the AUC: `resamples` draws of n rows with replacement (numpy
    Generator seeded with `seed`), over the draws that hold both classes (`defined` of them; low and high are
    None when none does)."""
    y, s = _clean(targets, scores)
    rng = np.random.default_rng(seed)
    values = np.empty(resamples)
    n = len(y)
    for i in range(resamples):  # one AUC per resample; n log n each, fine for holdout sizes
        idx = rng.integers(0, n, n) if n else np.zeros(0, dtype=int)
        values[i] = auc(y[idx], s[idx])
    alpha = (1 - level) / 2
    values = values[np.isfinite(values)]
    return {
        "low": float(np.quantile(values, alpha)) if len(values) else None,
        "high": float(np.quantile(values, 1 - alpha)) if len(values) else None,
        "defined": int(len(values)),
        "level": level,
        "resamples": resamples,
        "seed": seed,
    }


def auc_text(value: float | None, digits: int = 4) -> str:
    """An AUC as printed: the number, or "undefined" (one class only: no AUC exists)."""
    return "undefined" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def undefined_auc_reason(metrics: dict) -> str | None:
    """Why a metrics dict has no AUC (its rows hold one class only), or None when it has one."""
    if metrics.get("auc") is not None:
        return None
    d = metrics["score_diagnostics"]
    kind = "negative (no positive label)" if d["positive_count"] == 0 else "positive (no negative label)"
    return f"AUC is undefined: all {d['count']:,} scored rows are {kind}"


def sigmoid(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def score_diagnostics(targets, probabilities) -> dict:
    """Counts, positive rate, score mean/std, class means and their margin, p10/p50/p90 per class."""
    y_all = np.asarray(targets, dtype=np.float64).ravel()
    y, p = _clean(targets, probabilities)
    pos, neg = p[y > 0.5], p[y <= 0.5]

    def quantiles(values):
        if len(values) == 0:
            return {"p10": None, "p50": None, "p90": None}
        q = np.quantile(values, [0.1, 0.5, 0.9])
        return {"p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}

    def mean(values):
        return float(values.mean()) if len(values) else None

    pos_mean, neg_mean = mean(pos), mean(neg)
    return {
        "count": int(len(y)),
        "dropped_non_finite": int(len(y_all) - len(y)),
        "positive_count": int(len(pos)),
        "negative_count": int(len(neg)),
        "positive_rate": float(len(pos) / len(y)) if len(y) else None,
        "score_mean": mean(p),
        "score_std": float(p.std(ddof=1)) if len(p) > 1 else None,
        "positive_mean": pos_mean,
        "negative_mean": neg_mean,
        "margin": (pos_mean - neg_mean) if pos_mean is not None and neg_mean is not None else None,
        "positive_quantiles": quantiles(pos),
        "negative_quantiles": quantiles(neg),
    }


def classification_metrics(targets, probabilities, *, ci: bool = True) -> dict:
    """auc, logloss, brier (+ auc_ci, score_diagnostics, sample_count) from probabilities."""
    out = {
        "auc": auc(targets, probabilities),
        "logloss": logloss(targets, probabilities),
        "brier": brier(targets, probabilities),
        "sample_count": int(np.asarray(targets).size),
        "score_diagnostics": score_diagnostics(targets, probabilities),
    }
    if ci:
        out["auc_ci"] = bootstrap_auc_ci(targets, probabilities)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}
