"""tools/noise_holdout.py on the committed H200 A/A runs and fixtures: the figures notes/comparison.md quotes for
the noise file's K ("A noise floor that holds out") are what the tool computes from them."""

from __future__ import annotations

import pathlib

from pcvr_lib.compare.noise import K
from smoke_tests.tool_loader import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "comparison" / "h200"


def test_held_out_runs_and_the_planted_fixture_at_the_noise_files_k(capsys):
    names = ["aa_lease1_run1", "aa_lease1_run2", "aa_lease2_run2", "aa_lease3_run1", "aa_lease3_run2",
             "aa_lease4_run1", "aa_lease4_run2"]  # lease 4 ran other norm and embedding sources: those cases
    # count only between its own two runs
    runs = [str(ROOT / ".benchmarks" / "h200" / f"{name}.json.gz") for name in names]
    tool = load_tool("noise_holdout")
    assert tool.main([*runs, "--k", "2", str(K), "--planted", str(FIXTURES / "planted10_base.json"),
                      str(FIXTURES / "planted10_new.json")]) == 0
    out = capsys.readouterr().out
    assert "K=2: 11 false alarm(s) over 84 held-out pairs, 3 distinct case(s)" in out
    assert f"K={K:g}: 5 false alarm(s) over 84 held-out pairs, 1 distinct case(s)" in out
    assert f"planted planted10_new K={K:g}: 5 of 8 gated case(s) caught" in out
