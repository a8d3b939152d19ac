"""`pcvr report` and `pcvr compare`: the summary table and the refusals of the regression gate."""

import json

import pytest

from pcvr_lib import report
from pcvr_lib.cli import main


def _run_json(path, gpu_name=None, names=("test_x[a=1]",)):
    data = {
        "machine_info": {"node": "n", "cpu": {"brand_raw": "cpu"}, "gpu": {"name": gpu_name} if gpu_name else None},
        "commit_info": {"id": "abcdef1234567"},
        "benchmarks": [
            {
                "group": "g",
                "name": name,
                "fullname": f"perf_tests/test_x.py::{name}",
                "param": name.split("[")[1][:-1],
                "stats": {"median": 0.00125},
                "extra_info": {"rows_per_sec": 1234.5, "cache_stats": {"hit_rate": 0.25}},
            }
            for name in names
        ],
    }
    path.write_text(json.dumps(data))
    return path


def test_report_prints_the_summary_table(tmp_path, capsys):
    path = _run_json(tmp_path / "run.json")
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1.25 ms" in out and "1,234" in out and "25.0%" in out  # nested extra_info is found too
    assert "commit abcdef1234" in out


@pytest.mark.parametrize("content", [None, "not json", '{"no": "benchmarks"}'])
def test_report_refuses_a_missing_or_foreign_file(tmp_path, capsys, content):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == report.EXIT_REFUSED
    assert str(path) in capsys.readouterr().err


def test_compare_refuses_when_nothing_is_stored(tmp_path, capsys):
    assert main(["compare", "--storage", str(tmp_path / "empty")]) == report.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "nothing to compare with" in err and "make bench" in err


def test_compare_refuses_another_accelerator(tmp_path, capsys, monkeypatch):
    baseline = _run_json(tmp_path / "h200.json", gpu_name="NVIDIA H200")
    monkeypatch.setattr(report, "current_gpu_name", lambda: None)
    assert main(["compare", "--with", str(baseline)]) == report.EXIT_REFUSED
    assert "NVIDIA H200" in capsys.readouterr().err


def test_compare_picks_the_newest_stored_run_or_the_one_asked_for(tmp_path):
    folder = tmp_path / report.machine_id()
    folder.mkdir()
    for name in ("0001_aaa_2026.json", "0002_bbb_2026.json"):
        _run_json(folder / name)
    assert report.resolve_baseline(tmp_path, None).name == "0002_bbb_2026.json"
    assert report.resolve_baseline(tmp_path, "0001").name == "0001_aaa_2026.json"
    with pytest.raises(report.ReportError, match="no stored run matches"):
        report.resolve_baseline(tmp_path, "0007")


def test_summary_names_the_measured_tree_over_the_git_metadata():
    data = {"machine_info": {}, "commit_info": {"id": "156d42173729a750", "dirty": True}}
    assert report.machine_summary(data).endswith("| commit 156d421737")
    data["commit_info"]["measured_tree"] = "740bbe9: the device copies the working tree ..."
    assert report.machine_summary(data).endswith("| commit 740bbe9")
