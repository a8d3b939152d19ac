"""Verdicts refuse what they cannot judge: broken statistics, base cases with no comparison, noise floors from one
run; counted work (timing.work) gates host regressions exactly, and says where it cannot."""

import json
import math
import shutil

import pytest

from pcvr_lib import compare, timing
from pcvr_lib.cli import main
from pcvr_lib.report import ReportError

GPU = "NVIDIA H200"
CPU = {"brand_raw": "AMD EPYC"}
WORK = {"python_calls": 120, "torch_ops": 4, "host_reads": 0, "launches": 2, "calls_counted": 2}


def _case(name, device_us=20.0, host_us=12.0, **extra):
    extra_info = {"stat": "device", "op": "rms_norm", "dir": "fwd", "host_us": host_us,
                  "per_call_us": device_us + host_us, **extra}
    return {"group": "g", "name": name, "fullname": f"perf_tests/test_k.py::{name}",
            "stats": {"median": device_us / 1e6}, "extra_info": extra_info}


def _write(path, cases, *, when="2026-12-02T10:00:00", torch_version="2.11.0", **info):
    data = {"machine_info": {"cpu": CPU, "cpu_count": 16, "gpu": {"name": GPU}, "python_version": "3.12.3",
                             "libraries": {"torch": torch_version, "triton": "3.6.0"}, **info},
            "commit_info": {"id": "abc123"}, "datetime": when, "benchmarks": cases}
    path.write_text(json.dumps(data))
    return path


def _diff(tmp_path, base_cases, new_cases, **new_info):
    base = _write(tmp_path / "base.json", base_cases)
    new = _write(tmp_path / "new.json", new_cases, when="2026-12-02T11:00:00", **new_info)
    return main(["diff", str(base), str(new), "--all"]), compare.diff_runs(json.loads(base.read_text()),
                                                                           json.loads(new.read_text()), None)


# ---------------------------------------------------------------- broken statistics are refused


@pytest.mark.parametrize(("edit", "what"), [
    (lambda b: b["stats"].update(median=float("nan")), "stats.median is nan"),
    (lambda b: b.pop("stats"), "stats.median is None"),
    (lambda b: b["stats"].update(median=0.0), "stats.median is 0.0"),
    (lambda b: b["stats"].update(median=-1e-6), "stats.median is -1e-06"),
    (lambda b: b["stats"].update(median="fast"), "stats.median is 'fast'"),
    (lambda b: b["extra_info"].update(host_us=float("nan")), "extra_info.host_us is nan"),
    (lambda b: b["extra_info"].update(per_call_us=0), "extra_info.per_call_us is 0"),
    (lambda b: b["extra_info"].update(work={**WORK, "python_calls": 1.5}), "extra_info.work.python_calls is 1.5"),
])
@pytest.mark.parametrize("side", ["base", "new"])
def test_a_broken_statistic_is_one_line_naming_the_case_and_exit_2(tmp_path, capsys, edit, what, side):
    cases = {s: [_case("test_k[a=1]"), _case("test_k[a=2]")] for s in ("base", "new")}
    edit(cases[side][1])
    base = _write(tmp_path / "base.json", cases["base"])
    new = _write(tmp_path / "new.json", cases["new"], when="2026-12-02T11:00:00")
    assert main(["diff", str(base), str(new)]) == compare.EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pcvr diff: error: ")
    assert f"{side}.json: case test_k[a=2]: {what}" in err, err


def test_a_cpu_case_with_a_nan_minimum_is_refused(tmp_path, capsys):
    good = {"group": "data", "name": "test_x[a=1]", "fullname": "perf_tests/test_x.py::test_x[a=1]",
            "stats": {"median": 1.0, "min": 0.9}, "extra_info": {"stat": "cpu"}}
    bad = json.loads(json.dumps(good))
    bad["stats"]["min"] = math.nan
    base, new = _write(tmp_path / "a.json", [good]), _write(tmp_path / "b.json", [bad], when="later")
    assert main(["diff", str(base), str(new)]) == compare.EXIT_REFUSED
    assert "case test_x[a=1]: stats.min" in capsys.readouterr().err


# ---------------------------------------------------------------- a base case without a comparison fails


def test_a_base_case_that_cannot_be_compared_counts_as_missing(tmp_path):
    code, rows = _diff(tmp_path, [_case("test_k[a=1]", fingerprint="f1"), _case("test_k[a=2]")],
                       [_case("test_k[a=1]", fingerprint="f2"), _case("test_k[a=2]")])
    assert code == compare.EXIT_REGRESSED
    (changed,) = [r for r in rows if r.verdict == "WORKLOAD CHANGED"]
    assert changed.case.endswith("[a=1]") and "counts as missing" in changed.why
    cpu_now = _case("test_k[a=1]")
    cpu_now["extra_info"]["stat"] = "cpu"
    cpu_now["stats"]["min"] = 1e-3
    code, rows = _diff(tmp_path, [_case("test_k[a=1]")], [cpu_now])
    assert code == compare.EXIT_REGRESSED and [r.verdict for r in rows] == ["STAT CHANGED"]
    code, rows = _diff(tmp_path, [_case("test_k[a=1]"), _case("test_k[a=2]")], [_case("test_k[a=2]")])
    assert code == compare.EXIT_REGRESSED and "MISSING" in {r.verdict for r in rows}


def test_interleaved_comparison_counts_a_changed_workload_as_missing(tmp_path):
    base = json.loads(_write(tmp_path / "a.json", [_case("test_k[a=1]", fingerprint="f1"), _case("test_k[a=2]")])
                      .read_text())
    new = json.loads(_write(tmp_path / "b.json", [_case("test_k[a=1]", fingerprint="f2"), _case("test_k[a=2]")])
                     .read_text())
    rows, missing = compare.ab_compare([base, base], [new, new], None)
    assert [compare.short_id(c) for c in missing] == ["test_k[a=1]"]
    assert {compare.short_id(r.case) for r in rows} == {"test_k[a=2]"}
    assert compare.ab_exit_code(rows, missing) == compare.EXIT_REGRESSED
    assert "MISSING (absent from a run, or its workload or statistic changed): test_k[a=1]" in compare.ab_table(
        rows, missing)


# ---------------------------------------------------------------- a noise floor needs two distinct runs


def test_noise_refuses_one_run_given_twice(tmp_path, capsys):
    run = _write(tmp_path / "r1.json", [_case("test_k[a=1]")])
    out = tmp_path / "noise.json"
    assert main(["noise", "--from", str(run), str(run), "--out", str(out)]) == compare.EXIT_REFUSED
    assert "are the same run (file " in capsys.readouterr().err and not out.exists()
    copy = tmp_path / "copy.json"
    shutil.copy(run, copy)  # another file, the same session: its datetime and commit
    assert main(["noise", "--from", str(run), str(copy), "--out", str(out)]) == compare.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "are the same run (datetime 2026-12-02T10:00:00, commit abc123)" in err and len(err.splitlines()) == 1
    other = _write(tmp_path / "r2.json", [_case("test_k[a=1]", device_us=21.0)], when="2026-12-02T10:30:00")
    assert main(["noise", "--from", str(run), str(copy), str(other), "--out", str(out)]) == compare.EXIT_REFUSED
    capsys.readouterr()
    assert main(["noise", "--from", str(run), str(other), "--out", str(out)]) == compare.EXIT_OK
    assert json.loads(out.read_text())["cases"]["perf_tests/test_k.py::test_k[a=1]"]["device"]["spread"] == (
        pytest.approx(0.05))


def test_runs_without_a_session_time_are_told_apart_by_their_cases():
    a = {"benchmarks": [_case("test_k[a=1]")]}
    b = {"benchmarks": [_case("test_k[a=1]", device_us=21.0)]}
    with pytest.raises(ReportError, match="same run"):
        compare.check_distinct([a, json.loads(json.dumps(a))], ["x", "y"])
    compare.check_distinct([a, b], ["x", "y"])
    assert compare.run_identity(a).startswith("cases digest ")


# ---------------------------------------------------------------- counted work: exact, and says where it is not


def _work_verdicts(rows):
    return {(compare.short_id(r.case), r.metric): r.verdict for r in rows if r.unit == "per call"}


def test_counted_work_is_compared_exactly(tmp_path, capsys):
    base = [_case("test_k[a=1]", work=WORK), _case("test_k[a=2]", work=WORK), _case("test_k[a=3]", work=WORK)]
    new = [_case("test_k[a=1]", host_us=30.0, work=WORK),  # host time 2.5x: reported; the same work
           _case("test_k[a=2]", work={**WORK, "python_calls": 121}),  # one Python call more per call
           _case("test_k[a=3]", work={**WORK, "launches": 1, "torch_ops": 3})]  # less work
    code, rows = _diff(tmp_path, base, new)
    assert code == compare.EXIT_REGRESSED
    verdicts = _work_verdicts(rows)
    assert {m: v for (c, m), v in verdicts.items() if c == "test_k[a=1]"} == dict.fromkeys(timing.COUNTS, "ok")
    assert verdicts[("test_k[a=2]", "python_calls")] == "REGRESSED"
    assert [v for (c, m), v in verdicts.items() if c == "test_k[a=2]" and m != "python_calls"] == ["ok"] * 3
    assert verdicts[("test_k[a=3]", "launches")] == verdicts[("test_k[a=3]", "torch_ops")] == "improved"
    (more,) = [r for r in rows if r.verdict == "REGRESSED"]
    assert more.why == "+1 per call (counted, exact)" and more.threshold == 0.0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "REGRESSED" in line).split()
    assert row[:7] == ["test_k[a=2]", "python_calls", "120", "121", "+0.8%", "exact", "REGRESSED"], row
    assert "host work: 3 case(s) gated by counted work (exact)" in out
    code, _ = _diff(tmp_path, base, [_case("test_k[a=1]", work=WORK), _case("test_k[a=2]", work=WORK),
                                     _case("test_k[a=3]", work={**WORK, "launches": 1})])
    assert code == compare.EXIT_OK  # fewer launches: improved, not a failure


def test_a_case_without_comparable_counts_is_not_gated_by_counts_and_says_why(tmp_path, capsys):
    base = [_case("test_k[a=1]"), _case("test_k[a=2]", work=WORK), _case("test_k[a=3]", work=WORK),
            _case("test_k[a=4]", work=WORK)]
    new = [_case("test_k[a=1]", work=WORK), _case("test_k[a=2]", work={"error": "RuntimeError: CUPTI busy"}),
           _case("test_k[a=3]", work={**{k: v for k, v in WORK.items() if k != "python_calls"},
                                      "unstable": {"python_calls": [120, 122]}}),
           _case("test_k[a=4]", work={k: v for k, v in WORK.items() if k != "launches"})]
    code, rows = _diff(tmp_path, base, new)
    assert code == compare.EXIT_OK
    why = {(compare.short_id(r.case), r.metric): r.why for r in rows if r.verdict == "not counted"}
    assert why[("test_k[a=1]", "work")].startswith("no work counts in the base run")
    assert why[("test_k[a=2]", "work")].startswith("counting failed in the new run (RuntimeError: CUPTI busy)")
    assert why[("test_k[a=3]", "python_calls")] == "differed between the counted calls of the new run [120, 122]"
    assert why[("test_k[a=4]", "launches")] == "counted in the base run only"
    assert _work_verdicts(rows)[("test_k[a=3]", "torch_ops")] == "ok"  # the steady counts still gate
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary == ("host work: 2 case(s) gated by counted work (exact); not counted: counted in the base run only "
                       "(1), counting failed in the new run (1), differed between the counted calls of the new run "
                       "(1), no work counts in the base run (1)"), summary
    code, rows = _diff(tmp_path, [_case("test_k[a=1]", work=WORK)], [_case("test_k[a=1]", work={**WORK,
                                                                                                "python_calls": 500})],
                       torch_version="2.13.0")
    assert code == compare.EXIT_OK  # another torch calls other functions: not comparable, not a regression
    (row,) = [r for r in rows if r.unit == "per call"]
    assert row.verdict == "not counted" and row.why == "counts not comparable: torch 2.11.0 -> 2.13.0"


def test_informational_cases_are_not_counted(tmp_path):
    code, rows = _diff(tmp_path, [_case("test_k[b=compile]", gated=False, work=WORK)],
                       [_case("test_k[b=compile]", gated=False, work={**WORK, "python_calls": 999})])
    assert code == compare.EXIT_OK and not [r for r in rows if r.unit == "per call"]


def test_diff_json_is_written_when_it_refuses(tmp_path, capsys):
    broken = _case("test_k[a=1]")
    broken["stats"]["median"] = math.nan
    base = _write(tmp_path / "base.json", [_case("test_k[a=1]")])
    new = _write(tmp_path / "new.json", [broken], when="2026-12-02T11:00:00")
    out = tmp_path / "diff.json"
    assert main(["diff", str(base), str(new), "--json", str(out)]) == compare.EXIT_REFUSED
    written = json.loads(out.read_text())
    assert written["failed"] is None and "case test_k[a=1]: stats.median is nan" in written["error"]
    assert written["error"] in capsys.readouterr().err


def test_cases_of_a_renamed_benchmark_file_are_matched_by_test_id(tmp_path):
    """The committed snapshots name perf_tests/test_kernels.py, today's runs test_norms.py: matched by the test
    id, unique on both sides, so a diff against the snapshot compares every case instead of failing them all as
    MISSING; the noise file's entry is found the same way."""
    def renamed(case):
        return {**case, "fullname": case["fullname"].replace("test_k.py", "test_norms.py")}

    base = [_case("test_k[a=1]", work=WORK), _case("test_k[a=2]")]
    code, rows = _diff(tmp_path, base, [renamed(_case("test_k[a=1]", device_us=30.0, work=WORK)),
                                        renamed(_case("test_k[a=2]"))])
    assert code == compare.EXIT_REGRESSED  # a=1 is 50% slower: compared, not missing
    verdicts = {(compare.short_id(r.case), r.metric): r.verdict for r in rows}
    assert verdicts[("test_k[a=1]", "device")] == "REGRESSED" and verdicts[("test_k[a=2]", "device")] == "ok"
    assert "MISSING" not in verdicts.values() and "new" not in verdicts.values()
    assert "matched by test id in perf_tests/test_norms.py" in next(r.why for r in rows if r.verdict == "REGRESSED")
    noise = {"cases": {"perf_tests/test_k.py::test_k[a=1]": {"device": {"spread": 0.3}}}}
    assert compare.noise_case(noise, "perf_tests/test_norms.py::test_k[a=1]") == {"device": {"spread": 0.3}}
    assert compare.noise_case(noise, "perf_tests/test_norms.py::test_k[a=9]") is None
