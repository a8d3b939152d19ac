"""Every model at the reference settings (its default config), built on the meta device: the parameter
count within 1% of the reference's, and `pcvr models` printing the same table."""

from __future__ import annotations

import json

import pytest

from pcvr_lib.cli import main as cli_main
from pcvr_lib.model_counts import REFERENCE_PARAMETERS, format_table, parameter_rows
from pcvr_lib.models import model_names


@pytest.fixture(scope="module")
def reference_rows():
    return parameter_rows(reference_settings=True)


def test_all_seven_reference_models_are_registered():
    assert set(REFERENCE_PARAMETERS) <= set(model_names())
    assert model_names()[:7] == list(REFERENCE_PARAMETERS)


def test_parameter_counts_within_one_percent_of_the_reference(reference_rows):
    print("\n" + format_table(reference_rows))  # shown with -s: total, tables, dense, reference, difference
    off = {r["model"]: f"{100 * r['relative_difference']:+.2f}%" for r in reference_rows
           if abs(r["relative_difference"]) > 0.01}
    assert not off, f"parameter counts more than 1% off the reference:\n{format_table(reference_rows)}"
    assert {r["model"] for r in reference_rows} >= set(REFERENCE_PARAMETERS)
    for r in reference_rows:
        assert r["total"] == r["tables"] + r["dense"] and r["tables"] > r["dense"] > 0


def test_smoke_settings_bound_the_tables_only(reference_rows):
    smoke = {r["model"]: r for r in parameter_rows(reference_settings=False)}
    for r in reference_rows:
        assert smoke[r["model"]]["dense"] == r["dense"]  # widths and depths untouched
        assert smoke[r["model"]]["tables"] < r["tables"]


def test_models_command_table_and_json(capsys):
    assert cli_main(["models", "--reference-settings"]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "queryformer" in text and "2190." in text
    assert cli_main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == model_names() and rows[0]["settings"] == "smoke"
    assert cli_main(["models", "--schema", "/nonexistent.json"]) == 2
    assert "no such file" in capsys.readouterr().err
