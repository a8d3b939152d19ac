"""Root conftest: makes the checkout importable without an install and adds the shared options.

The GPU host runs `python3 -m pytest` from a bare copy of the checkout, so `pcvr_lib` must be importable
from here rather than from site-packages.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# triton decides when it is imported, for each @triton.jit function of its own library (triton.language.standard),
# whether that function is interpreted (TRITON_INTERPRET set) or compiled. The CPU tests set TRITON_INTERPRET per
# test; if one of them imported triton first, its library would stay interpreted for the whole process and every
# later compile (the sm_90 compile tests, precompile's compile_for) would fail. So triton is imported here, before
# any test sets the variable, unless the whole run asked for the interpreter.
if "TRITON_INTERPRET" not in os.environ and importlib.util.find_spec("triton") is not None:
    import triton.language  # noqa: F401


@pytest.fixture(autouse=True)
def _child_runs_are_their_own(monkeypatch):
    """`make test` runs the tests in pytest-xdist workers, whose environment says so (PYTEST_XDIST_WORKER, ...).
    A pytest or `pcvr compare` that a test starts is a run of its own: pytest-benchmark would read the
    inherited variable and disable its timing, so the tests' children do not inherit it."""
    for name in [n for n in os.environ if n.startswith("PYTEST_XDIST_")]:
        monkeypatch.delenv(name)


def pytest_addoption(parser):
    group = parser.getgroup("pcvr")
    group.addoption(
        "--data-scale",
        choices=["ci", "default", "full"],
        default=None,
        help="size of the generated benchmark data: ci (tiny, the default when CI is set), "
        "default (stable numbers in a few minutes) or full (the reference's 300x)",
    )


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def data_cache_dir() -> Path:
    """Where generated parquet files are cached by content hash (ignored by git)."""
    from pcvr_lib.data.generate import default_cache_dir

    path = default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def data_scale(request) -> str:
    chosen = request.config.getoption("--data-scale")
    if chosen:
        return chosen
    return "ci" if os.environ.get("CI") else "default"


def pytest_benchmark_update_machine_info(config, machine_info):
    from pcvr_lib.timing import update_machine_info

    update_machine_info(machine_info)


def pytest_benchmark_update_commit_info(config, commit_info):
    """PCVR_MEASURED_TREE names the code that ran where the checkout's git metadata does not (the GPU host's copy
    carries the session's first commit: .benchmarks/README.md); tools/h200_session.sh passes it on."""
    if os.environ.get("PCVR_MEASURED_TREE"):
        commit_info["measured_tree"] = os.environ["PCVR_MEASURED_TREE"]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Every case records a fingerprint of its workload (pcvr_lib.compare.WORKLOAD_KEYS), so a comparison
    flags a case whose workload changed under the same id instead of comparing two different things, and
    the run records the digest of every source file its cases ran (`source_files`, pcvr_lib.sources), so
    `pcvr report` can name the files that changed since. A case that does not say what its call returns
    or which sources it runs is counted and named on the terminal: its fingerprint or its freshness
    cannot be judged."""
    from pcvr_lib import sources
    from pcvr_lib.compare import fingerprint

    subjects = set()
    missing: dict[str, list[str]] = {"returns": [], "sources": []}
    for bench in output_json["benchmarks"]:
        extra = bench.setdefault("extra_info", {})
        extra.setdefault("fingerprint", fingerprint(extra))
        for key, names in missing.items():
            if not extra.get(key):
                names.append(bench["fullname"])
        if extra.get("sources"):
            subjects.add(extra["sources"])
    output_json["source_files"] = sources.run_file_digests(subjects)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None and any(missing.values()):
        terminal.write("\n")  # after the progress line
    for key, names in missing.items():
        if names and terminal is not None:
            terminal.write_line(f"warning: {len(names)} benchmark case(s) record no extra_info.{key} "
                                f"(e.g. {names[0]}): " + ("their fingerprint cannot tell what the call returned"
                                                          if key == "returns" else "their sources state is unknown"),
                                yellow=True)


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: a listed test is checked against everything collected
def pytest_collection_modifyitems(config, items):
    """PCVR_ONLY_NODEIDS=FILE runs only the node ids listed in FILE (one per line): the GPU session's way to
    finish an accuracy run that a time limit cut (tools/pytest_unreported.py writes the list). A listed id
    that is not collected is an error, so a renamed test cannot drop out of the resumed run unnoticed."""
    path = os.environ.get("PCVR_ONLY_NODEIDS")
    if not path:
        return
    wanted = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    collected = {item.nodeid for item in items}
    missing = [nodeid for nodeid in wanted if nodeid not in collected]
    if missing:
        raise pytest.UsageError(f"PCVR_ONLY_NODEIDS={path}: {len(missing)} listed test(s) not collected, "
                                f"e.g. {missing[0]!r} (run pytest from the repository root with the same paths)")
    keep = set(wanted)
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
    items[:] = [item for item in items if item.nodeid in keep]
