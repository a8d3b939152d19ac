"""`pcvr report`, `pcvr diff`, `pcvr noise` and `pcvr compare`: tables, thresholds, refusals, A-B-B-A."""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pcvr_lib import compare, report
from pcvr_lib.cli import main

ROOT = Path(__file__).resolve().parents[1]
CPU = {"brand_raw": "AMD EPYC"}


def _bench(name, median, *, stat="cpu", group="g", **extra):
    return {"group": group, "name": name, "fullname": f"perf_tests/test_x.py::{name}", "param": name.split("[")[1][:-1],
            "stats": {"median": median, "min": median * 0.98}, "extra_info": {"stat": stat, **extra}}


def _run(path, benches, gpu=None, cpu=CPU, cpus=2):
    data = {"machine_info": {"node": "n", "cpu": cpu, "cpu_count": cpus, "gpu": {"name": gpu} if gpu else None},
            "commit_info": {"id": "abcdef1234567"}, "benchmarks": benches}
    path.write_text(json.dumps(data))
    return path


def _gpu_case(name, device_us, host_us, **extra):
    return _bench(name, device_us / 1e6, stat="device", host_us=host_us, per_call_us=device_us + host_us, **extra)


# ---------------------------------------------------------------- report


def test_report_prints_the_summary_table(tmp_path, capsys):
    path = _run(tmp_path / "run.json", [_bench("test_x[a=1]", 0.00125, rows_per_sec=1234.5,
                                               cache_stats={"hit_rate": 0.25})])
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1.25 ms" in out and "1,234" in out and "25.0%" in out  # nested extra_info is found too
    assert "commit abcdef1234" in out and "cpu" in out


def test_report_names_the_skipped_cases_by_reason(tmp_path, capsys):
    path = _run(tmp_path / "run.json", [_bench("test_x[a=1]", 0.001)])
    data = json.loads(path.read_text())
    absent = "fbgemm: package not installed"
    data["skipped"] = {"t::x[fbgemm,1]": absent, "t::x[fbgemm,2]": absent, "t::x[fa4,1]": "fa4: no CUDA device"}
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped 3 case(s): 2 x fbgemm: package not installed; 1 x fa4: no CUDA device" in out


@pytest.mark.parametrize("content", [None, "not json", '{"no": "benchmarks"}'])
def test_report_refuses_a_missing_or_foreign_file(tmp_path, capsys, content):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == report.EXIT_REFUSED
    assert str(path) in capsys.readouterr().err


def test_report_views_of_the_committed_snapshots(capsys):
    assert main(["report", ".benchmarks/h200/kernels_norms.json", "--view", "cases"]) == 0
    out = capsys.readouterr().out
    assert "| rms_norm | 65536x1024 | fp16 |" in out and "torch_compile" in out and "fwd+bwd" in out
    assert main(["report", ".benchmarks/h200/attention_models.json", "--view", "cases"]) == 0
    out = capsys.readouterr().out  # the attention table: SDPA backends and flex as peers, speedups as recorded
    assert "| sdpa | sdpa_efficient | sdpa_cudnn | flex | triton | tilelang |" in out and "(flex) |" in out
    assert main(["report", ".benchmarks/h200/optim.json", "--view", "optim"]) == 0
    out = capsys.readouterr().out
    assert "orthogonal_adamw" in out and "pcvr_dense" in out
    assert main(["report", ".benchmarks/cpu/make-bench-2core.json", "--view", "data"]) == 0
    assert "preset=opt,mode=loader" in capsys.readouterr().out


def test_cases_view_shows_every_peer_and_the_recorded_speedups():
    """The attention table (formerly its own printer): SDPA backends and flex as peers, each of ours against
    torch and against the best peer as the benchmark recorded them, and TFLOP/s."""
    def case(backend, per_call, device, **extra):
        return {"name": f"test_attention_perf[{backend}]", "stats": {"median": device * 1e-6},
                "extra_info": {"op": "flash_attention", "backend": backend, "shape": "B8xH8xS128xD16,mask=roles",
                               "dtype": "bf16", "dir": "fwd", "stat": "device", "per_call_us": per_call,
                               "device_us": device, **extra}}

    data = {"benchmarks": [
        case("sdpa", 60.0, 20.0), case("flex", 40.0, 9.0),
        case("triton", 25.0, 6.0, speedup_vs_best_peer=1.6, best_peer="flex", tflops=12.5,
             fraction_of_copy_ceiling=0.05),
        case("tilelang", 50.0, 8.0, speedup_vs_best_peer=0.8, best_peer="flex", tflops=6.0,
             fraction_of_copy_ceiling=0.02)]}
    table = report.cases_view(data)
    header = next(line for line in table.splitlines() if line.startswith("| op |"))
    assert header.index("sdpa") < header.index("flex") < header.index("triton") < header.index("tilelang")
    row = next(line for line in table.splitlines() if "mask=roles" in line)
    assert "| 40.0 [9.0] |" in row and "5.0% (triton) | 12.5 |" in row
    assert "triton 1.60x, tilelang 0.80x (flex)" in row
    assert "triton/tilelang device" in header and "| 0.75 |" in row


def test_summary_names_the_measured_tree_over_the_git_metadata():
    data = {"machine_info": {}, "commit_info": {"id": "156d42173729a750", "dirty": True}}
    assert report.machine_summary(data).endswith("| commit 156d421737")
    data["commit_info"]["measured_tree"] = "740bbe9: the device copies the working tree ..."
    assert report.machine_summary(data).endswith("| commit 740bbe9")


# ---------------------------------------------------------------- diff


def test_diff_passes_an_identical_run_and_fails_a_regression(tmp_path, capsys):
    base = _run(tmp_path / "a.json", [_bench("test_x[a=1]", 1.0), _bench("test_x[a=2]", 2.0)])
    same = _run(tmp_path / "b.json", [_bench("test_x[a=1]", 1.02), _bench("test_x[a=2]", 1.97)])
    slow = _run(tmp_path / "c.json", [_bench("test_x[a=1]", 1.10), _bench("test_x[a=2]", 2.0)])
    assert main(["diff", str(base), str(same)]) == compare.EXIT_OK
    out_json = tmp_path / "diff.json"
    assert main(["diff", str(base), str(slow), "--json", str(out_json)]) == compare.EXIT_REGRESSED
    out = capsys.readouterr().out
    assert "test_x[a=1]" in out and "+10.0%" in out and "REGRESSED" in out and "5.0%" in out  # cpu floor 5%
    rows = json.loads(out_json.read_text())["rows"]
    assert json.loads(out_json.read_text())["failed"] is True
    assert {(r["case"].split("::")[1], r["verdict"]) for r in rows} == {("test_x[a=1]", "REGRESSED"),
                                                                        ("test_x[a=2]", "ok")}


def test_diff_gates_device_time_and_reports_host_time(tmp_path, capsys):
    """Across stored runs host and per-call time are reported with their change, never a failure: on the lent
    H200 host they moved 31-94% per group between two runs of one tree minutes apart."""
    base = _run(tmp_path / "a.json", [_gpu_case("test_k[op=n]", 100.0, 40.0)], gpu="NVIDIA H200")
    host = _run(tmp_path / "b.json", [_gpu_case("test_k[op=n]", 100.5, 92.0)], gpu="NVIDIA H200")
    device = _run(tmp_path / "c.json", [_gpu_case("test_k[op=n]", 110.0, 40.0)], gpu="NVIDIA H200")
    assert main(["diff", str(base), str(host)]) == compare.EXIT_OK
    out = capsys.readouterr().out
    shift_line = next(line for line in out.splitlines() if line.startswith("group g") and " host " in line)
    assert "+130.0%" in shift_line and "shift" in shift_line and "REGRESSED" not in out, out
    rows = compare.diff_runs(json.loads(base.read_text()), json.loads(host.read_text()), None)
    (host_row,) = [r for r in rows if r.metric == "host" and not r.case.startswith("group")]
    assert host_row.verdict == "reported" and host_row.change == pytest.approx(1.3)
    assert "beyond" in host_row.why and "not gated" in host_row.why
    rows = compare.diff_runs(json.loads(base.read_text()), json.loads(device.read_text()), None)
    assert [(r.metric, r.verdict) for r in rows if not r.case.startswith("group")] == [
        ("device", "REGRESSED"), ("host", "reported"), ("per_call", "reported"), ("work", "not counted")]


def _host_run(path, hosts, probe_us=None, device_us=20.0):
    run = _run(path, [_gpu_case(f"test_k[i={i}]", device_us, h, op="rms_norm", dir="fwd") for i, h in enumerate(hosts)],
               gpu="NVIDIA H200")
    if probe_us is not None:
        data = json.loads(run.read_text())
        data["machine_info"]["host_probe"] = {"us": probe_us}
        run.write_text(json.dumps(data))
    return json.loads(run.read_text())


def test_each_groups_host_shift_is_reported_with_the_host_probes(tmp_path):
    """Another host issues every call 2x slower: the group's shift row says +100% beside the probes, and nothing
    fails; one case 3x slower is reported on its own row, not a failure either."""
    hosts = [10.0, 12.0, 15.0, 20.0, 11.0, 14.0, 16.0, 18.0]
    base = _host_run(tmp_path / "a.json", hosts, probe_us=5.0)
    slower_host = _host_run(tmp_path / "b.json", [2 * h for h in hosts[:-1]] + [3 * hosts[-1]], probe_us=10.0)
    rows = compare.diff_runs(base, slower_host, None)
    assert not compare.failed(rows)
    shifts = {r.metric: r for r in rows if r.verdict == "shift"}
    assert shifts["host"].case == "group rms_norm fwd" and shifts["host"].change == pytest.approx(1.0)
    assert "host probe 5.00 -> 10.00 us (+100.0%)" in shifts["host"].why
    (odd,) = [r for r in rows if r.case.endswith("[i=7]") and r.metric == "host"]
    assert odd.verdict == "reported" and odd.change == pytest.approx(2.0)


def test_diff_missing_case_fails_and_changed_workload_is_flagged(tmp_path, capsys):
    base = _run(tmp_path / "a.json", [_bench("test_x[a=1]", 1.0, tensors=108), _bench("test_x[a=2]", 1.0)])
    new = _run(tmp_path / "b.json", [_bench("test_x[a=1]", 1.0, tensors=268), _bench("test_x[a=3]", 1.0)])
    assert main(["diff", str(base), str(new)]) == compare.EXIT_REGRESSED
    out = capsys.readouterr().out
    assert "MISSING" in out and "test_x[a=2]" in out
    assert "WORKLOAD CHANGED" in out and "not compared" in out
    rows = compare.diff_runs(json.loads(base.read_text()), json.loads(new.read_text()), None)
    assert {r.verdict for r in rows} == {"MISSING", "WORKLOAD CHANGED", "new"}


def test_diff_never_fails_on_an_informational_case(tmp_path):
    base = _run(tmp_path / "a.json", [_gpu_case("test_k[b=compile]", 4.6, 10.0, gated=False)], gpu="NVIDIA H200")
    new = _run(tmp_path / "b.json", [_gpu_case("test_k[b=compile]", 9.0, 10.0, gated=False)], gpu="NVIDIA H200")
    assert main(["diff", str(base), str(new)]) == compare.EXIT_OK
    rows = compare.diff_runs(json.loads(base.read_text()), json.loads(new.read_text()), None)
    assert {r.verdict for r in rows} == {"informational", "reported"}  # not counted either: never gated


@pytest.mark.parametrize(("other", "why"), [
    (dict(gpu="NVIDIA H100 80GB HBM3"), "gpu: 'NVIDIA H200' vs 'NVIDIA H100"),
    (dict(gpu="NVIDIA H200", cpu={"brand_raw": "Intel(R) Xeon(R) Processor"}), "cpu: 'AMD EPYC' vs 'Intel"),
    (dict(gpu="NVIDIA H200", cpus=16), "cpus: '2' vs '16'"),
])
def test_diff_refuses_runs_of_different_machines(tmp_path, capsys, other, why):
    base = _run(tmp_path / "a.json", [_bench("test_x[a=1]", 1.0)], gpu="NVIDIA H200")
    new = _run(tmp_path / "b.json", [_bench("test_x[a=1]", 1.0)], **other)
    assert main(["diff", str(base), str(new)]) == compare.EXIT_REFUSED
    assert why in capsys.readouterr().err


def test_diff_refuses_unreadable_files(tmp_path, capsys):
    good = _run(tmp_path / "a.json", [_bench("test_x[a=1]", 1.0)])
    (tmp_path / "bad.json").write_text("{")
    assert main(["diff", str(good), str(tmp_path / "bad.json")]) == compare.EXIT_REFUSED
    assert "not a pytest-benchmark JSON file" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "none.json"), str(good)]) == compare.EXIT_REFUSED
    assert "does not exist" in capsys.readouterr().err
    assert main(["diff", str(good)]) == compare.EXIT_REFUSED
    assert "--run" in capsys.readouterr().err


def test_base_resolution_latest_or_number(tmp_path):
    folder = tmp_path / "Linux-CPython-3.11-64bit"
    folder.mkdir()
    for name in ("0001_aaa_2026.json", "0002_bbb_2026.json"):
        _run(folder / name, [_bench("test_x[a=1]", 1.0)])
    assert compare.resolve_base("latest", tmp_path).name == "0002_bbb_2026.json"
    assert compare.resolve_base("0001", tmp_path).name == "0001_aaa_2026.json"
    with pytest.raises(report.ReportError, match="no stored run matches '0007'"):
        compare.resolve_base("0007", tmp_path)
    with pytest.raises(report.ReportError, match="make bench"):
        compare.resolve_base("latest", tmp_path / "empty")


# ---------------------------------------------------------------- noise and thresholds


def test_noise_file_drives_the_thresholds(tmp_path, capsys):
    runs = [_run(tmp_path / f"r{i}.json", [_bench("test_x[a=1]", v, group="data"), _bench("test_x[a=2]", 1.0,
                                                                                            group="data")])
            for i, v in enumerate((1.0, 1.08, 1.04))]
    out = tmp_path / "noise.json"
    assert main(["noise", "--from", *map(str, runs), "--out", str(out)]) == compare.EXIT_OK
    noise = json.loads(out.read_text())
    assert noise["runs"] == 3 and noise["machine"] == {"cpu": "AMD EPYC", "cpus": "2", "gpu": "no GPU"}
    assert noise["cases"]["perf_tests/test_x.py::test_x[a=1]"]["cpu"]["spread"] == pytest.approx(0.08)
    assert noise["groups"]["data"]["cpu"]["max"] == pytest.approx(0.08)
    case = compare.cases_of(json.loads(runs[0].read_text()))["perf_tests/test_x.py::test_x[a=2]"]
    limit, source = compare.threshold(noise, case, "cpu", 1.0)
    assert limit == pytest.approx(0.24) and source == "3x group p90"  # the group's 8% spread, tripled
    # a 12% slowdown is within the noise of this machine, 30% is not
    new = _run(tmp_path / "new.json", [_bench("test_x[a=1]", 1.12, group="data"), _bench("test_x[a=2]", 1.3,
                                                                                          group="data")])
    rows = compare.diff_runs(json.loads(runs[0].read_text()), json.loads(new.read_text()), noise)
    assert [r.verdict for r in rows] == ["ok", "REGRESSED"]
    assert main(["noise", "--from", str(runs[0])]) == compare.EXIT_REFUSED
    assert "at least 2 runs" in capsys.readouterr().err


def test_noise_keeps_a_case_that_one_run_lacks_and_drops_a_changed_workload(tmp_path):
    """A run cut before a case still lends its other cases: a case held by 2 of 3 runs gets its own spread
    (a bimodal case must not fall back to its group's); a value of another workload under the same id is
    not part of the case's spread, and a case left with one value has none."""
    a1, a2, b, c = "test_x[a=1]", "test_x[a=2]", "test_x[b=1]", "test_x[c=1]"
    runs = [
        _run(tmp_path / "r0.json", [_bench(a1, 1.0), _bench(c, 1.0, shape="8")]),  # cut: no a2, no b
        _run(tmp_path / "r1.json", [_bench(a1, 1.02), _bench(a2, 1.0), _bench(b, 1.0), _bench(c, 1.5, shape="9")]),
        _run(tmp_path / "r2.json", [_bench(a1, 1.01), _bench(a2, 1.12), _bench(c, 1.0, shape="8")]),
    ]
    noise = compare.build_noise([json.loads(r.read_text()) for r in runs], list(map(str, runs)))
    case = noise["cases"]
    assert case[f"perf_tests/test_x.py::{a2}"]["cpu"] == {"spread": pytest.approx(0.12),
                                                      "median_s": pytest.approx(1.06 * 0.98), "n": 2}  # CPU: the min
    assert case[f"perf_tests/test_x.py::{a1}"]["cpu"]["n"] == 3
    assert case[f"perf_tests/test_x.py::{c}"]["cpu"]["spread"] == 0.0  # r1's other workload left out
    assert f"perf_tests/test_x.py::{b}" not in case  # one run: no spread
    only_once = [_run(tmp_path / f"o{i}.json", [_bench(f"test_x[o={i}]", 1.0)]) for i in range(2)]
    with pytest.raises(report.ReportError, match="no case is in two of the runs"):
        compare.build_noise([json.loads(r.read_text()) for r in only_once], list(map(str, only_once)))


def test_noise_takes_a_case_only_from_runs_of_its_latest_sources(tmp_path):
    """Runs of several trees may build one noise file (A/A runs of several leases), but a case's values from
    runs whose library code for it differs from its latest run's are the change, not noise: they stay out;
    a peer's case (no digest of ours) enters from every run."""
    ours, peer = "test_x[b=ours]", "test_x[b=peer]"
    runs = [_run(tmp_path / f"r{i}.json", [_bench(ours, v, sources_digest=d), _bench(peer, v)])
            for i, (v, d) in enumerate(((1.5, "old"), (1.0, "new"), (1.02, "new")))]
    noise = compare.build_noise([json.loads(r.read_text()) for r in runs], list(map(str, runs)))
    assert noise["cases"][f"perf_tests/test_x.py::{ours}"]["cpu"]["n"] == 2
    assert noise["cases"][f"perf_tests/test_x.py::{ours}"]["cpu"]["spread"] == pytest.approx(0.02)
    assert noise["cases"][f"perf_tests/test_x.py::{peer}"]["cpu"]["n"] == 3


# ---------------------------------------------------------------- interleaved A/B


def test_abba_order_and_paired_interval():
    assert compare.abba_order(2) == ["base", "new", "new", "base"] * 2
    # four pairs, each run's rounds; the candidate 20% slower in every pair
    base = [[1.0, 1.01, 0.99], [1.05, 1.04, 1.06], [0.97, 0.98, 0.96], [1.0, 1.0, 1.01]]
    ratio, low, high = compare.paired_interval(base, [[1.2 * x for x in run] for run in base])
    assert ratio == low == high == pytest.approx(1.2)
    # the pairs' levels differ by 9% (1.0, 1.05, 0.97, 1.0): shared by both runs of a pair, that cancels
    assert compare.paired_interval(base, [list(run) for run in base]) == pytest.approx((1.0, 1.0, 1.0))
    # the pairs' disagreement (+2%, 0, -2%, 0): Student's t with 3 degrees of freedom (3.18 x sd / 2)
    shifted = [[1.02 * x for x in base[0]], base[1], [0.98 * x for x in base[2]], base[3]]
    ratio, low, high = compare.paired_interval(base, shifted)
    assert ratio == pytest.approx(1.0, abs=1e-3) and low == pytest.approx(0.974, abs=2e-3)
    assert high == pytest.approx(1.026, abs=2e-3)
    assert compare.paired_interval(base[:1], shifted[:1]) == (pytest.approx(1.02), 0.0, math.inf)  # one pair
    assert compare.t_quantile(0.975, 3) == pytest.approx(3.182, abs=0.02)
    assert compare.ab_verdict(1.10, 1.06, 1.14, 0.05, True) == "REGRESSED"
    assert compare.ab_verdict(1.07, 1.01, 1.13, 0.05, True) == "REGRESSED"  # above the floor, surely slower
    assert compare.ab_verdict(1.04, 1.01, 1.07, 0.05, True) == "ok"  # surely slower, but not by 10%
    assert compare.ab_verdict(1.04, 0.99, 1.12, 0.05, True) == "unclear"  # 10% slower is not excluded
    assert compare.ab_verdict(1.00, 0.97, 1.04, 0.05, True) == "ok"
    assert compare.ab_verdict(0.90, 0.86, 0.94, 0.05, True) == "faster"
    assert compare.ab_verdict(1.50, 1.40, 1.60, 0.05, False) == "informational"


def _tiny_project(path: Path, spin_ms: float) -> Path:
    (path / "perf_tests").mkdir(parents=True)
    (path / "perf_tests" / "test_tiny.py").write_text(textwrap.dedent(f"""
        import time
        import pytest

        def spin(seconds):
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass

        @pytest.mark.benchmark(timer=time.thread_time)
        @pytest.mark.parametrize("case", ["same", "planted"])
        def test_tiny(benchmark, case):
            benchmark.extra_info["stat"] = "cpu"
            benchmark.pedantic(spin, args=(0.02 if case == "same" else {spin_ms / 1e3},), rounds=5)
    """))
    return path


def test_compare_runs_base_and_candidate_alternately_and_flags_only_the_planted_case(tmp_path, capsys):
    base = _tiny_project(tmp_path / "base", 20.0)
    new = _tiny_project(tmp_path / "new", 30.0)
    code = main(["compare", "--base", str(base), "--new", str(new), "--rounds", "1", "--work", str(tmp_path / "w"),
                 "perf_tests"])
    out = capsys.readouterr().out
    assert code == compare.EXIT_REGRESSED, out
    result = json.loads((tmp_path / "w" / "compare.json").read_text())
    verdicts = {r["case"].split("[")[1]: r["verdict"] for r in result["rows"] if r["metric"] == "cpu"}
    assert verdicts["planted]"] == "REGRESSED" and verdicts["same]"] != "REGRESSED"
    assert [Path(f).name for f in result["files"]["base"]] == ["01_base.json", "04_base.json"]


def test_candidate_env_plants_on_the_candidate_side_only(tmp_path, capsys):
    """One tree on both sides; the variable slows the candidate's runs alone, so only they are flagged."""
    tree = tmp_path / "tree"
    (tree / "perf_tests").mkdir(parents=True)
    (tree / "perf_tests" / "test_env.py").write_text(textwrap.dedent("""
        import os
        import time
        import pytest

        def spin(seconds):
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass

        @pytest.mark.benchmark(timer=time.thread_time)
        def test_env(benchmark):
            benchmark.extra_info["stat"] = "cpu"
            benchmark.pedantic(spin, args=(0.02 * (1 + float(os.environ.get("TINY_SLOWER", "0"))),), rounds=5)
    """))
    code = main(["compare", "--base", str(tree), "--new", str(tree), "--rounds", "1", "--work", str(tmp_path / "w"),
                 "--candidate-env", "TINY_SLOWER=0.5", "perf_tests"])
    out = capsys.readouterr().out
    assert code == compare.EXIT_REGRESSED, out
    result = json.loads((tmp_path / "w" / "compare.json").read_text())
    assert result["candidate_env"] == {"TINY_SLOWER": "0.5"}
    (row,) = [r for r in result["rows"] if r["metric"] == "cpu"]
    assert row["verdict"] == "REGRESSED" and 1.4 < row["ratio"] < 1.6, row
    # the same tree without the variable: nothing to flag
    assert main(["compare", "--base", str(tree), "--new", str(tree), "--rounds", "1", "--work",
                 str(tmp_path / "aa"), "perf_tests"]) == compare.EXIT_OK, capsys.readouterr().out
    # --replay recomputes from the kept runs without running anything, and writes nothing there
    (tmp_path / "w" / "compare.json").unlink()
    assert main(["compare", "--replay", str(tmp_path / "w")]) == compare.EXIT_REGRESSED
    assert main(["compare", "--replay", str(tmp_path / "aa")]) == compare.EXIT_OK
    assert not (tmp_path / "w" / "compare.json").exists()
    capsys.readouterr()
    (tmp_path / "w" / "02_new.json").unlink()
    (tmp_path / "w" / "03_new.json").unlink()
    assert main(["compare", "--replay", str(tmp_path / "w")]) == compare.EXIT_REFUSED
    assert "found 2 base, 0 candidate" in capsys.readouterr().err
    assert main(["compare", "--replay", str(tmp_path / "nowhere")]) == compare.EXIT_REFUSED
    assert main(["compare", "--work", str(tmp_path)]) == compare.EXIT_REFUSED
    assert "--base REV_OR_DIR is needed" in capsys.readouterr().err


def test_side_by_side_pairs_run_every_round_alone_and_flag_the_planted_side(tmp_path, capsys, monkeypatch):
    """`--side-by-side`: per pair a base and a candidate process at once, their rounds exclusive (bench_cpu's
    rounds take the pair's lock, `exclusive_rounds` recorded); a planted 50% is flagged. A tree whose timing
    does not take part (plain pedantic rounds) is refused, not compared unfairly."""
    tree = tmp_path / "tree"
    (tree / "perf_tests").mkdir(parents=True)
    (tree / "perf_tests" / "test_sbs.py").write_text(textwrap.dedent("""
        import os
        import time
        from pcvr_lib import timing

        def spin():
            end = time.thread_time() + 0.01 * (1 + float(os.environ.get("TINY_SLOWER", "0")))
            while time.thread_time() < end:
                pass

        def test_sbs(benchmark):
            timing.bench_cpu(benchmark, spin, rounds=5, warmup_rounds=0, clock=time.thread_time)
    """))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = main(["compare", "--base", str(tree), "--new", str(tree), "--side-by-side", "--rounds", "3", "--work",
                 str(tmp_path / "w"), "--candidate-env", "TINY_SLOWER=0.5", "perf_tests"])
    out = capsys.readouterr().out
    assert code == compare.EXIT_REGRESSED, out
    result = json.loads((tmp_path / "w" / "compare.json").read_text())
    assert result["side_by_side"] and [Path(f).name for f in result["files"]["base"]] == [
        "01_base.json", "02_base.json", "03_base.json"]
    (row,) = [r for r in result["rows"] if r["metric"] == "cpu"]
    assert row["verdict"] == "REGRESSED" and 1.35 < row["ratio"] < 1.65, row
    run = json.loads((tmp_path / "w" / "02_new.json").read_text())
    assert run["benchmarks"][0]["extra_info"]["exclusive_rounds"] is True
    assert len(run["benchmarks"][0]["extra_info"]["cpu_raw_rounds_s"]) == 5
    assert not list((tmp_path / "w").glob(".pair*"))  # the pairs' lock folders are gone
    plain = _tiny_project(tmp_path / "plain", 20.0)
    assert main(["compare", "--base", str(plain), "--new", str(plain), "--side-by-side", "--rounds", "1", "--work",
                 str(tmp_path / "p"), "perf_tests"]) == compare.EXIT_REFUSED
    assert "did not run alone" in capsys.readouterr().err


@pytest.mark.parametrize("item", ["NOEQUALS", "=1", "2X=1", "A B=1"])
def test_candidate_env_must_be_name_equals_value(tmp_path, capsys, item):
    assert main(["compare", "--base", str(tmp_path), "--work", str(tmp_path / "w"),
                 "--candidate-env", item]) == compare.EXIT_REFUSED
    assert f"--candidate-env {item!r}: expected NAME=VALUE" in capsys.readouterr().err


def test_compare_refuses_a_base_that_is_neither_a_directory_nor_a_revision(tmp_path, capsys):
    assert main(["compare", "--base", "no-such-rev-xyz", "--work", str(tmp_path)]) == compare.EXIT_REFUSED
    assert "neither a directory nor a git revision" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["compare", "--base", str(tmp_path / "empty"), "--work", str(tmp_path)]) == compare.EXIT_REFUSED
    assert "without perf_tests/" in capsys.readouterr().err


def test_base_checkout_of_a_revision_is_a_worktree(tmp_path, monkeypatch):
    repo = _tiny_project(tmp_path / "repo", 20.0)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "tiny"]):
        subprocess.run([*git, *cmd], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    path, made = compare.base_checkout("HEAD", tmp_path / "work")
    assert made and (path / "perf_tests" / "test_tiny.py").is_file()
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], check=True)


def test_cli_lists_the_comparison_commands():
    out = subprocess.run([sys.executable, "-m", "pcvr_lib", "--help"], capture_output=True, text=True, cwd=ROOT).stdout
    for command in ("report", "diff", "noise", "compare"):
        assert command in out


def test_cpu_cases_gate_on_the_least_disturbed_round(tmp_path):
    base = _bench("test_x[a=1]", 1.0)
    busy = _bench("test_x[a=1]", 1.3)  # other jobs slowed two of the rounds: the median moved, the min did not
    busy["stats"]["min"] = base["stats"]["min"]
    rows = compare.diff_runs(json.loads(_run(tmp_path / "a.json", [base]).read_text()),
                             json.loads(_run(tmp_path / "b.json", [busy]).read_text()), None)
    assert [(r.metric, r.verdict, r.change) for r in rows] == [("cpu", "ok", 0.0)]


def test_calibrated_cpu_cases_gate_on_the_fastest_round_at_the_probes_median_speed():
    stats = {"min": 0.05, "median": 0.2}
    extra = {"cpu_raw_min_s": 0.24, "probe_median_s": 0.012}  # the machine ran the probe at half speed
    assert compare.cpu_seconds(stats, extra) == pytest.approx(0.24 * 0.006 / 0.012)
    assert compare.cpu_seconds(stats, {}) == 0.05  # runs without calibration: the least disturbed round


def test_a_noise_file_of_another_machine_is_refused_when_asked_for(tmp_path, capsys):
    base = _run(tmp_path / "a.json", [_bench("test_x[a=1]", 1.0)], cpu={"brand_raw": "Some Other CPU"})
    new = _run(tmp_path / "b.json", [_bench("test_x[a=1]", 1.0)], cpu={"brand_raw": "Some Other CPU"})
    noise = str(ROOT / ".benchmarks" / "cpu" / "noise-intel-xeon-processor-2cpus.json")  # measured on the 2-core Xeon
    assert main(["diff", str(base), str(new), "--noise", noise]) == compare.EXIT_REFUSED
    assert "noise measured on" in capsys.readouterr().err
