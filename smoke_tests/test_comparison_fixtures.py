"""`pcvr diff` on recorded real runs (fixtures/comparison/<machine>/, made by tools/validate_comparison.py,
notes/comparison.md): A/A pairs must pass, pairs with a planted slowdown must fail, with the machine's
committed noise file."""

import json
from pathlib import Path

import pytest

from pcvr_lib import compare
from pcvr_lib.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "comparison"
MANIFESTS = sorted(FIXTURES.glob("*/expected.json"))
PAIRS = [pytest.param(m.parent, pair, id=f"{m.parent.name}:{pair['new']}")
         for m in MANIFESTS for pair in json.loads(m.read_text())["pairs"]]


def test_the_cpu_fixtures_are_committed():
    assert (FIXTURES / "cpu" / "expected.json") in MANIFESTS


@pytest.mark.parametrize(("folder", "pair"), PAIRS)
def test_recorded_pair(folder, pair, capsys):
    noise = ROOT / json.loads((folder / "expected.json").read_text())["noise"]
    code = main(["diff", str(folder / pair["base"]), str(folder / pair["new"]), "--noise", str(noise)])
    out = capsys.readouterr().out
    if pair["expect"] == "pass":
        assert code == compare.EXIT_OK, out
        return
    assert code == compare.EXIT_REGRESSED, out
    rows = compare.diff_runs(json.loads((folder / pair["base"]).read_text()),
                             json.loads((folder / pair["new"]).read_text()), compare.load_noise(noise))
    flagged = {r.case for r in rows if r.verdict == "REGRESSED"}
    planted = {cid for cid in pair["planted_cases"]}
    assert planted <= flagged, f"planted but not flagged: {sorted(planted - flagged)}\n{out}"
