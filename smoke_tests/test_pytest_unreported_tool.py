"""tools/pytest_unreported.py and the root conftest's PCVR_ONLY_NODEIDS: a pytest run cut by the GPU session's
time limit is finished by running exactly the tests it never reported (and a listed test that no longer exists
is an error, not a silent skip)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from smoke_tests.tool_loader import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "pytest_unreported.py"

SAMPLE_TESTS = '''
import pytest

@pytest.mark.parametrize("n", [1, 2, 3])
def test_numbers(n):
    assert n > 0

def test_plain():
    pass
'''


def test_reported_ids_read_plain_and_xdist_lines():
    tool = load_tool("pytest_unreported")
    log = "\n".join([
        "a/test_x.py::test_one PASSED                                   [ 10%]",
        "[gw3] [ 41%] FAILED a/test_x.py::test_two[bf16-causal p0.3]",
        "[gw0] [ 50%] SKIPPED a/test_x.py::test_three",
        "a/test_x.py::test_five",  # collected but never reported (the run was cut)
    ])
    reported = tool.reported_ids(log)
    assert {"a/test_x.py::test_one", "a/test_x.py::test_two[bf16-causal p0.3]", "a/test_x.py::test_three"} <= reported
    assert "a/test_x.py::test_five" not in reported
    collected = tool.collected_ids("a/test_x.py::test_one\na/test_x.py::test_five\n\n2 tests collected in 0.1s\n")
    assert collected == ["a/test_x.py::test_one", "a/test_x.py::test_five"]


def _pytest(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                           "-c", str(ROOT / "pyproject.toml"), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_a_cut_run_resumes_with_exactly_the_unreported_tests(tmp_path):
    sample = ROOT / "smoke_tests" / f"_sample_unreported_{os.getpid()}_test.py"
    sample.write_text(SAMPLE_TESTS)
    try:
        rel = str(sample.relative_to(ROOT))
        collected = _pytest(tmp_path, "--collect-only", "-q", rel).stdout
        full_log = _pytest(tmp_path, "-v", rel).stdout
        # the cut run reported test_numbers[1], a second run (as the exclusive tests' log) test_numbers[2]
        lines = full_log.splitlines()
        cut_log = "\n".join(line for line in lines if not any(t in line for t in ("numbers[2]", "numbers[3]", "plain")))
        second_log = "\n".join(line for line in lines if "test_numbers[2]" in line)
        (tmp_path / "collected.txt").write_text(collected)
        (tmp_path / "run.log").write_text(cut_log)
        (tmp_path / "second.log").write_text(second_log)
        todo = subprocess.run([sys.executable, str(TOOL), *(str(tmp_path / f) for f in ("collected.txt", "run.log",
                                                                                          "second.log"))],
                              capture_output=True, text=True, check=True).stdout.split()
        assert todo == [f"{rel}::test_numbers[3]", f"{rel}::test_plain"]
        (tmp_path / "todo.txt").write_text("\n".join(todo) + "\n")
        resumed = _pytest(tmp_path, "-v", rel, env={"PCVR_ONLY_NODEIDS": str(tmp_path / "todo.txt")})
        assert resumed.returncode == 0, resumed.stdout[-2000:]
        tool = load_tool("pytest_unreported")
        ran = tool.reported_ids(resumed.stdout)
        assert ran == set(todo), resumed.stdout[-2000:]
        narrowed = _pytest(tmp_path, "-v", rel, "-k", "plain", env={"PCVR_ONLY_NODEIDS": str(tmp_path / "todo.txt")})
        assert narrowed.returncode == 0 and tool.reported_ids(narrowed.stdout) == {f"{rel}::test_plain"}
        (tmp_path / "todo.txt").write_text(f"{rel}::test_gone\n")
        gone = _pytest(tmp_path, rel, env={"PCVR_ONLY_NODEIDS": str(tmp_path / "todo.txt")})
        assert gone.returncode != 0 and "test_gone" in gone.stdout + gone.stderr
    finally:
        sample.unlink()
