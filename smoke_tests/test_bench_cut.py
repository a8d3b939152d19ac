"""A benchmark run cut by SIGINT or SIGTERM (what `timeout -s INT` and `timeout` send) writes the JSON of every
finished case and says that it was cut (perf_tests/bench_plugin.py), for real: a pytest process on a tiny
benchmark file, signalled while its second case runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = textwrap.dedent("""
    import os
    import time
    from pathlib import Path

    import pytest


    @pytest.mark.parametrize("i", range(4))
    def test_case(benchmark, i):
        benchmark.extra_info["i"] = i

        def call():
            if i == 1 and os.environ.get("CUT_MARK"):
                Path(os.environ["CUT_MARK"]).write_text("case 1 is timing")
                time.sleep(60)  # the signal lands here, inside a round: partial statistics

        benchmark.pedantic(call, rounds=3, iterations=1)
""")


def _signals_as_in_a_foreground_job() -> None:
    """The child's SIGINT and SIGTERM at their defaults, as a terminal's foreground job has them: this test
    may itself run in a background job of a non-interactive shell, which starts with SIGINT ignored, and the
    plugin leaves an ignored signal ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def run_tiny_suite(tmp_path: Path, cut: signal.Signals | None) -> tuple[int, str, dict]:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["perf_tests.bench_plugin"]\n')
    (tmp_path / "test_cut_cases.py").write_text(CASES)
    mark = tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUT_MARK": str(mark) if cut else ""}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_cut_cases.py",
                             "--benchmark-json=out.json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_signals_as_in_a_foreground_job)
    try:
        if cut is not None:
            deadline = time.monotonic() + 180  # a loaded 2-core CI machine starts pytest slowly
            while not mark.exists():
                assert proc.poll() is None, f"pytest ended before the cut:\n{proc.stdout.read()}"
                assert time.monotonic() < deadline, "the second case never started"
                time.sleep(0.05)
            proc.send_signal(cut)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    path = tmp_path / "out.json"
    assert path.is_file() and path.stat().st_size, f"no JSON written:\n{out}"
    return proc.returncode, out, json.loads(path.read_text())


@pytest.mark.parametrize("cut", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_cut_run_keeps_its_finished_cases_and_says_it_was_cut(tmp_path, cut):
    rc, out, data = run_tiny_suite(tmp_path, cut)
    assert rc == pytest.ExitCode.INTERRUPTED, out
    assert [b["extra_info"]["i"] for b in data["benchmarks"]] == [0], out  # the finished case, not the cut one
    assert len(data["benchmarks"][0]["stats"]["data"]) == 3
    assert data["cut"] == {"reason": cut.name, "collected": 4, "finished": 1,
                           "interrupted": ["test_cut_cases.py::test_case[1]"], "not_run": 2}
    assert (f"benchmark run cut ({cut.name}) after 1 of 4 test(s): out.json holds the 1 finished benchmark case(s); "
            "1 interrupted (dropped), 2 not run") in out


def test_a_complete_run_says_it_was_not_cut(tmp_path):
    rc, out, data = run_tiny_suite(tmp_path, None)
    assert rc == 0, out
    assert len(data["benchmarks"]) == 4 and data["cut"] is None
    assert "benchmark run cut" not in out


FAILING_AFTER_TIMING = textwrap.dedent("""
    import pytest


    @pytest.mark.parametrize("i", range(3))
    def test_case(benchmark, i):
        benchmark.extra_info["i"] = i
        benchmark.pedantic(lambda: None, rounds=3, iterations=1)
        assert i != 1, "a check after the timing failed"
""")


def run_one_file(tmp_path: Path, name: str, source: str) -> tuple[int, str, dict]:
    """(exit code, stdout, JSON) of a pytest run of `source` as test file `name` with the plugin loaded."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["perf_tests.bench_plugin"]\n')
    (tmp_path / name).write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name,
                           "--benchmark-json=out.json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    return done.returncode, done.stdout, json.loads((tmp_path / "out.json").read_text())


def test_a_case_that_fails_after_its_timing_is_left_out_and_named(tmp_path):
    rc, out, data = run_one_file(tmp_path, "test_failing.py", FAILING_AFTER_TIMING)
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert [b["extra_info"]["i"] for b in data["benchmarks"]] == [0, 2]
    assert list(data["failed"]) == ["test_failing.py::test_case[1]"]
    assert "a check after the timing failed" in data["failed"]["test_failing.py::test_case[1]"]
    assert data["cut"] is None


SKIPPING = textwrap.dedent("""
    import pytest


    @pytest.mark.parametrize("peer", ["ours", "absent"])
    def test_case(benchmark, peer):
        if peer == "absent":
            pytest.skip("absent: package not installed (pip install absent)")
        benchmark.pedantic(lambda: None, rounds=3, iterations=1)
""")


def test_a_skipped_case_is_listed_with_its_reason(tmp_path):
    rc, out, data = run_one_file(tmp_path, "test_skipping.py", SKIPPING)
    assert rc == pytest.ExitCode.OK, out
    assert [b["name"] for b in data["benchmarks"]] == ["test_case[ours]"]
    why = "absent: package not installed (pip install absent)"
    assert data["skipped"] == {"test_skipping.py::test_case[absent]": why}
    assert data["failed"] == {}


DYING = textwrap.dedent("""
    import os
    import signal

    import pytest


    @pytest.mark.parametrize("i", range(4))
    def test_case(benchmark, i):
        benchmark.extra_info["i"] = i
        if i == 2 and os.environ.get("DIE"):
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer or a crash leaves: no clean end
        benchmark.pedantic(lambda: None, rounds=3, iterations=1)
""")


@pytest.mark.parametrize("die", [True, False], ids=["killed", "complete"])
def test_a_process_that_dies_leaves_a_checkpoint_of_its_finished_cases(tmp_path, die):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["perf_tests.bench_plugin"]\n')
    (tmp_path / "test_dying.py").write_text(DYING)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PCVR_BENCH_CHECKPOINT_S": "0", "DIE": "1" if die else ""}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_dying.py",
                           "--benchmark-json=out.json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    data = json.loads((tmp_path / "out.json").read_text())
    if die:
        assert done.returncode == -signal.SIGKILL, done.stdout
        assert [b["extra_info"]["i"] for b in data["benchmarks"]] == [0, 1]
        assert all(len(b["stats"]["data"]) == 3 for b in data["benchmarks"])
        assert data["cut"]["reason"].startswith("the process died")
        assert (data["cut"]["collected"], data["cut"]["finished"], data["cut"]["not_run"]) == (4, 2, 2)
        assert data["failed"] == {}  # the checkpoint went through the run's JSON hooks
    else:  # the checkpoints written after each case are replaced by the run's own JSON
        assert done.returncode == 0, done.stdout
        assert [b["extra_info"]["i"] for b in data["benchmarks"]] == [0, 1, 2, 3] and data["cut"] is None
        assert not list(tmp_path.glob("*.part"))


def test_a_checkpoint_replaces_the_whole_file_whether_a_path_or_an_open_file(tmp_path):
    from perf_tests.bench_plugin import write_over

    path = tmp_path / "run.json"
    path.write_bytes(b"x" * 100)
    write_over(path, b"{}")
    assert path.read_bytes() == b"{}"
    with open(tmp_path / "open.json", "wb") as handle:  # how pytest-benchmark < 5.3 holds --benchmark-json
        write_over(handle, b"[" + b" " * 50 + b"]")
        write_over(handle, b"{}")
    assert (tmp_path / "open.json").read_bytes() == b"{}"
