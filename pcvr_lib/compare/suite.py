"""Running the benchmark suite in a pytest process that writes its JSON (`pcvr diff --run`, `pcvr noise`,
`pcvr compare`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pcvr_lib.report import ReportError


def pytest_command(json_out: Path, tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *tests, "--benchmark-only", "-q", "-p", "no:cacheprovider",
            f"--benchmark-json={json_out}"]


def run_suite(json_out: Path, tests: list[str], cwd: Path | None = None,
              extra_env: dict[str, str] | None = None) -> None:
    """One pytest process of the benchmark suite, writing its JSON; a failure to write JSON is an error.
    `extra_env` is set for this process only (`pcvr compare --candidate-env`)."""
    check_suite(start_suite(json_out, tests, cwd, extra_env).wait(), json_out, tests, cwd)


def start_suite(json_out: Path, tests: list[str], cwd: Path | None = None,
                extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start one pytest process of the benchmark suite (see run_suite) without waiting for it."""
    from pcvr_lib.data.generate import default_cache_dir

    json_out.parent.mkdir(parents=True, exist_ok=True)
    # both trees share one data cache: generated files are keyed by content, so a base worktree does not
    # regenerate them (nor rebuild the converter's native code, keyed by its source)
    env = {**os.environ, "PCVR_CACHE_DIR": str(default_cache_dir().resolve()), **(extra_env or {})}
    return subprocess.Popen(pytest_command(json_out.resolve(), tests), cwd=cwd, env=env)


def check_suite(code: int, json_out: Path, tests: list[str], cwd: Path | None = None) -> None:
    """A pytest run that wrote no JSON, or exited with an error other than a failed case, is an error."""
    if not json_out.is_file():
        raise ReportError(f"pytest ({' '.join(tests)}) in {cwd or Path.cwd()} exited {code} without writing {json_out}")
    if code not in (0, 1):  # 1: a failed case is reported by the comparison (it goes missing)
        raise ReportError(f"pytest ({' '.join(tests)}) in {cwd or Path.cwd()} exited {code}")
