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


# ---------------------------------------------------------------- interleaved A/B (`pcvr compare`), recorded

INTERLEAVED = FIXTURES / "cpu" / "interleaved"
AB_MANIFEST = json.loads((INTERLEAVED / "expected.json").read_text())
AB_CASES = [pytest.param(c, id=f"cpu-interleaved:{c['name']}") for c in AB_MANIFEST["comparisons"]]


@pytest.mark.parametrize("comparison", AB_CASES)
def test_recorded_interleaved_comparison(comparison, capsys):
    """Real `pcvr compare` runs on the 2-core machine (tools/validate_comparison.py --interleaved wrote them:
    the pairs `--until-clear` used, compacted): the A/A comparisons flag nothing; with a planted slowdown on the
    candidate side the comparison fails and no case passes as ok; the replay gives the recorded verdicts."""
    noise = ROOT / AB_MANIFEST["noise"]
    runs: dict[str, list] = {"base": [], "new": []}
    for folder in comparison["folders"]:  # a comparison may join the pairs of several folders, in order
        part, _ = compare.replay_runs(INTERLEAVED / folder)
        for side in runs:
            runs[side] += part[side]
    runs = {side: runs[side][: comparison["pairs_used"]] for side in runs}
    assert len(runs["base"]) == len(runs["new"]) == comparison["pairs_used"]
    rows, missing = compare.ab_compare(runs["base"], runs["new"], compare.load_noise(noise))
    out = compare.ab_table(rows, missing, everything=True)
    code = compare.ab_exit_code(rows, missing)
    if len(comparison["folders"]) == 1 and len(part["base"]) == comparison["pairs_used"]:  # so says the CLI
        assert main(["compare", "--replay", str(INTERLEAVED / comparison["folders"][0]), "--noise", str(noise)]) == code
        capsys.readouterr()
    gated = {compare.short_id(r.case): r.verdict for r in rows if r.metric == "cpu"}
    assert not missing, out
    assert gated == {case: v[3] for case, v in comparison["verdicts"].items()}, out
    if comparison["planted"]:  # flagged; no planted case passes as ok (unclear ones would get more pairs)
        assert code == compare.EXIT_REGRESSED and set(gated.values()) <= {"REGRESSED", "unclear"}, out
    else:
        assert code in (compare.EXIT_OK, compare.EXIT_INCONCLUSIVE) and "REGRESSED" not in gated.values(), out
