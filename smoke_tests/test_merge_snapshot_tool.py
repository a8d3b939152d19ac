"""tools/merge_snapshot.py: a run of some cases merged into a snapshot built from several device calls keeps
every other case with its own tree, moves cases between timed and failed, and refuses runs of another machine
or files without cases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from smoke_tests.tool_loader import load_tool

TOOL = load_tool("merge_snapshot")
GPU = {"name": "NVIDIA H200", "capability": "9.0"}
CASE = "perf_tests/test_models.py::"


def case(name: str, median: float, tree: str | None = None) -> dict:
    extra = {"sources": f"model:{name}", "sources_digest": "abc"}
    if tree:
        extra["measured_tree"] = tree
    return {"name": f"test_model[{name}]", "stats": {"median": median}, "extra_info": extra}


def run(cases, failed=None, gpu=GPU, files=None) -> dict:
    return {"machine_info": {"cpu": {"brand_raw": "Xeon"}, "gpu": gpu}, "benchmarks": cases,
            "failed": failed or {}, "source_files": files or {}, "datetime": "2026-12-05T00:00:00"}


def test_skip_reasons_carry_over_until_the_case_is_timed():
    base = run([case("a", 1.0, "old")])
    base["skipped"] = {f"{CASE}test_model[p]": "p: package not installed", f"{CASE}test_model[q]": "q: no CUDA"}
    new = run([case("q", 2.0)])
    new["skipped"] = {f"{CASE}test_model[r]": "r: package not installed"}
    merged = TOOL.merge(base, new, tree="new", command="cmd")
    assert merged["skipped"] == {f"{CASE}test_model[p]": "p: package not installed",
                                 f"{CASE}test_model[r]": "r: package not installed"}


def test_new_cases_replace_theirs_and_the_rest_keep_their_tree():
    base = run([case("a", 1.0, "old1"), case("b", 2.0, "old1"), case("c", 3.0, "old2")],
               failed={f"{CASE}test_model[d]": "check failed"}, files={"x.py": "1", "y.py": "1"})
    new = run([case("b", 2.5), case("d", 4.0)], failed={f"{CASE}test_model[c]": "check failed now"},
              files={"y.py": "2"})
    merged = TOOL.merge(base, new, tree="new", command="cmd")
    by_name = {b["name"]: b for b in merged["benchmarks"]}
    assert set(by_name) == {"test_model[a]", "test_model[b]", "test_model[d]"}
    assert by_name["test_model[a]"]["extra_info"]["measured_tree"] == "old1"
    assert by_name["test_model[b]"]["stats"]["median"] == 2.5
    assert by_name["test_model[b]"]["extra_info"]["measured_tree"] == "new"
    assert merged["failed"] == {f"{CASE}test_model[c]": "check failed now"}  # d timed now, c fails now
    assert merged["source_files"] == {"x.py": "1", "y.py": "2"}
    assert merged["merged_runs"][-1] == {"command": "cmd", "tree": "new", "finished": 2, "failed": 1,
                                         "kept": "all", "datetime": "2026-12-05T00:00:00"}
    assert base["benchmarks"][1]["stats"]["median"] == 2.0  # the input is not modified


@pytest.mark.parametrize("new, why", [
    (run([case("a", 1.0)], gpu={"name": "NVIDIA H100 80GB HBM3"}), "different machines"),
    (run([]), "no case"),
])
def test_refused(new, why):
    with pytest.raises(TOOL.MergeError, match=why):
        TOOL.merge(run([case("a", 1.0)]), new, tree="t", command="c")


def test_command_line_writes_the_merge_and_refuses_with_exit_2(tmp_path):
    base, new, bad = tmp_path / "base.json", tmp_path / "new.json", tmp_path / "bad.json"
    base.write_text(json.dumps(run([case("a", 1.0, "old")])))
    new.write_text(json.dumps(run([case("a", 0.5)])))
    bad.write_text(json.dumps({"error": "refused"}))
    tool = [sys.executable, str(TOOL.__file__)]
    done = subprocess.run([*tool, str(base), str(new), "--tree", "t1", "--command", "c"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(base.read_text())["benchmarks"][0]["stats"]["median"] == 0.5
    refused = subprocess.run([*tool, str(base), str(bad), "--tree", "t1", "--command", "c"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "no 'benchmarks' list" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_stale_cases_retire_into_an_archive_and_the_rest_stay(tmp_path):
    from pcvr_lib import sources

    subject = "model:baseline:torch"
    fresh = {"name": "test_model[fresh]", "stats": {"median": 1.0}, "extra_info": sources.stamp(subject)}
    stale = {"name": "test_model[stale]", "stats": {"median": 2.0},
             "extra_info": {"sources": subject, "sources_digest": "0" * 12, "measured_tree": "old"}}
    peer = {"name": "test_model[peer]", "stats": {"median": 3.0}, "extra_info": sources.stamp("peer:liger")}
    snapshot, archive = tmp_path / "models.json", tmp_path / "retired.json"
    snapshot.write_text(json.dumps(run([fresh, stale, peer])))
    assert TOOL.main([str(snapshot), "--retire-stale", str(archive)]) == 0
    assert [b["name"] for b in json.loads(snapshot.read_text())["benchmarks"]] == ["test_model[fresh]",
                                                                                   "test_model[peer]"]
    kept = json.loads(archive.read_text())
    assert [b["name"] for b in kept["benchmarks"]] == ["test_model[stale]"]
    assert kept["benchmarks"][0]["extra_info"]["measured_tree"] == "old" and "retired" in kept["note"]
    stale_again = {**stale, "stats": {"median": 2.5}}  # a later retirement replaces the archive's case
    snapshot.write_text(json.dumps(run([fresh, stale_again])))
    assert TOOL.main([str(snapshot), "--retire-stale", str(archive)]) == 0
    assert [b["stats"]["median"] for b in json.loads(archive.read_text())["benchmarks"]] == [2.5]
    other = tmp_path / "h100.json"
    other.write_text(json.dumps(run([stale], gpu={"name": "NVIDIA H100 80GB HBM3"})))
    assert TOOL.main([str(other), "--retire-stale", str(archive)]) == 2  # an archive of another machine
    with pytest.raises(SystemExit):
        TOOL.main([str(snapshot)])  # neither a run nor --retire-stale


def test_cases_found_wrong_retire_with_the_reason():
    base = run([case("a", 1.0, "t"), case("b", 2.0, "t")])
    kept, archive, moved = TOOL.retire(base, None, lambda b: b["name"] == "test_model[b]", "measured eager code")
    assert moved == 1 and [b["name"] for b in kept["benchmarks"]] == ["test_model[a]"]
    assert [(b["name"], b["extra_info"]["retired_why"]) for b in archive["benchmarks"]] == [
        ("test_model[b]", "measured eager code")]
    assert "retired_why" not in base["benchmarks"][1]["extra_info"]  # the input is not modified
