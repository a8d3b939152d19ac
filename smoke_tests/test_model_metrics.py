"""AUC / LogLoss / Brier / bootstrap CI against brute-force fp64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcvr_lib.metrics import (
    auc,
    auc_text,
    bootstrap_auc_ci,
    brier,
    classification_metrics,
    logloss,
    score_diagnostics,
    undefined_auc_reason,
)


def _pairwise_auc(y, s):
    pos = [v for v, t in zip(s, y, strict=True) if t > 0.5]
    neg = [v for v, t in zip(s, y, strict=True) if t <= 0.5]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    y = rng.random(80) < 0.3
    s = np.round(rng.random(80), 1)  # many ties
    assert auc(y, s) == pytest.approx(_pairwise_auc(y, s), abs=1e-12)


def test_auc_edge_cases():
    assert math.isnan(auc([1, 1, 1], [0.1, 0.2, 0.3]))  # one class: no AUC, never a chance-looking 0.5
    assert math.isnan(auc([0, 0], [0.1, 0.2]))
    assert auc([0, 1], [0.3, 0.3]) == 0.5
    assert auc([0, 1, 1], [0.1, 0.9, float("nan")]) == 1.0  # the non-finite score is dropped
    assert auc([0, 1], [0.9, 0.1]) == 0.0


def test_logloss_and_brier():
    y = np.array([1, 0, 1, 0])
    p = np.array([0.9, 0.2, 0.6, 0.0])
    expect = -np.mean([math.log(0.9), math.log(0.8), math.log(0.6), math.log(1 - 1e-7)])
    assert logloss(y, p) == pytest.approx(expect)
    assert logloss([1], [0.0]) == pytest.approx(-math.log(1e-7))  # clipped, finite
    assert brier(y, p) == pytest.approx(np.mean((p - y) ** 2))


def test_bootstrap_ci_is_seeded_and_brackets_the_auc():
    rng = np.random.default_rng(3)
    y = rng.random(300) < 0.2
    s = y * 0.3 + rng.random(300)
    a = bootstrap_auc_ci(y, s)
    assert a == bootstrap_auc_ci(y, s)
    assert a["resamples"] == 200 and a["seed"] == 42
    assert a["low"] < auc(y, s) < a["high"]


def test_score_diagnostics_and_bundle():
    d = score_diagnostics([1, 0, 0, 1, 0], [0.8, 0.2, 0.4, 0.6, float("inf")])
    assert d["count"] == 4 and d["dropped_non_finite"] == 1
    assert d["positive_mean"] == pytest.approx(0.7) and d["margin"] == pytest.approx(0.4)
    m = classification_metrics([1, 0, 0, 1], [0.8, 0.2, 0.4, 0.6])
    assert m["auc"] == 1.0 and m["sample_count"] == 4 and "auc_ci" in m


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1]), st.sampled_from([0.0, 0.25, 0.5, 1.0, float("nan")])),
                min_size=1, max_size=30))
def test_auc_is_undefined_exactly_when_one_class_is_scored(pairs):
    """Label edge values: all negative, all positive, one row, ties, non-finite scores. The AUC is null (and
    said to be undefined) exactly when the finitely scored rows hold one class; else it is the pairwise count."""
    y = np.array([p[0] for p in pairs])
    s = np.array([p[1] for p in pairs])
    scored = y[np.isfinite(s)]
    one_class = len(set(scored.tolist())) < 2
    m = classification_metrics(y, s)
    assert (m["auc"] is None) == one_class
    if one_class:
        assert auc_text(m["auc"]) == "undefined"
        assert undefined_auc_reason(m).startswith(f"AUC is undefined: all {len(scored):,} scored rows are")
        kind = "negative" if not scored.any() else "positive"
        assert f"are {kind}" in undefined_auc_reason(m)
    else:
        keep = np.isfinite(s)
        assert m["auc"] == pytest.approx(_pairwise_auc(y[keep], s[keep]), abs=1e-12)
        assert undefined_auc_reason(m) is None
    ci = m["auc_ci"]
    assert (ci["low"] is None) == (ci["defined"] == 0)
    if ci["low"] is not None:
        assert 0.0 <= ci["low"] <= ci["high"] <= 1.0
