"""pytest plugin of the benchmark runs: a run cut by SIGINT, SIGTERM or a timeout still writes its JSON.

pytest turns SIGINT into KeyboardInterrupt and still calls pytest_sessionfinish, where pytest-benchmark writes
`--benchmark-json`; but the case that was running has statistics with no rounds (or some), and
pytest-benchmark's JSON of such a case raises, so the file was never written (older pytest-benchmark left
it empty). SIGTERM, what `timeout` sends by default, killed the process before that. Here:

- the first SIGTERM or SIGINT raises KeyboardInterrupt in the main thread (pytest's path for Ctrl-C); later
  ones, and any that comes while the session finishes, are ignored, so that the results get written
  (`timeout -k` or SIGKILL still end a stuck run);
- the cases whose test did not finish its call are dropped from the run before pytest-benchmark writes it:
  only finished cases, each with all its rounds;
- a case whose test failed (its check, or the ceiling check after its timing) is dropped too, and listed with
  its reason in a top-level `failed` field ({node id: first line}), so a diff counts it as missing;
- a skipped case (a peer not installed, a backend that cannot run here) is listed with its reason in a
  top-level `skipped` field ({node id: reason}): the record says why a peer has no figure;
- the JSON says what happened in a top-level `cut` field: null for a complete run, else {"reason",
  "collected", "finished", "interrupted" (the ids dropped), "not_run"}; a run stopped by -x / --maxfail is
  cut too. The terminal says it in one line; `pcvr report FILE` prints it;
- a process that dies without finishing its session (a segfault in a compiler, SIGKILL, the out-of-memory
  killer) can write nothing at its end, so while the run goes the JSON path holds a checkpoint: the finished
  cases as of the last one that ended at least CHECKPOINT_EVERY_S (PCVR_BENCH_CHECKPOINT_S, 10 s) after the
  previous checkpoint, with a `cut` whose reason says the process died. A session that ends writes the real
  JSON over it.

perf_tests/conftest.py loads it; a test directory of its own can load it with `pytest_plugins`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

CUT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a crash loses at most the cases of this many seconds; each checkpoint serialises the run so far
CHECKPOINT_EVERY_S = float(os.environ.get("PCVR_BENCH_CHECKPOINT_S", "10"))
DIED = "the process died (crash, SIGKILL or out of memory) before the run ended: its checkpoint"


class BenchCut:
    def __init__(self, config):
        self.config = config
        self.signal: str | None = None  # the signal that cut the run
        self.finishing = False  # the session is writing its results: signals wait
        self.previous: dict[int, object] = {}
        self.timed: set[str] = set()  # node ids whose call phase reported
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.cut: dict | None = None
        self.failed: dict[str, str] = {}  # node id -> the first line of why its test failed
        self.skipped: dict[str, str] = {}  # node id -> the skip's reason
        self.collected = 0
        self.last_checkpoint = time.monotonic()
        self.run_info: tuple[dict, dict] | None = None  # machine and commit info of the checkpoints
        self.checkpoints = True

    # ------------------------------------------------------------ signals

    def install(self) -> None:
        for signum in CUT_SIGNALS:
            current = signal.getsignal(signum)
            # a signal ignored by whoever started pytest stays ignored (a background job of a
            # non-interactive shell ignores SIGINT); a handler of someone else's stays too
            if current not in (signal.SIG_DFL, signal.default_int_handler):
                continue
            try:
                self.previous[signum] = signal.signal(signum, self.on_signal)
            except ValueError:  # not the main thread: pytest runs embedded; leave the signals alone
                return

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None or self.finishing:  # let the finished cases be written
            os.write(2, f"\n{name} ignored: the benchmark results are being written (SIGKILL stops it)\n".encode())
            return
        self.signal = name
        raise KeyboardInterrupt(f"benchmark run cut by {self.signal}")

    # ------------------------------------------------------------ which cases finished

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid, location):
        self.started.add(nodeid)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.timed.add(report.nodeid)
        if report.failed and report.nodeid not in self.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            self.failed[report.nodeid] = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0]
        if report.skipped and report.nodeid not in self.skipped:
            self.skipped[report.nodeid] = skip_reason(report)

    @pytest.hookimpl
    def pytest_collection_finish(self, session):
        self.collected = len(session.items)

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid, location):
        self.finished.add(nodeid)
        if self.checkpoints and time.monotonic() - self.last_checkpoint >= CHECKPOINT_EVERY_S:
            try:
                self.checkpoint()
            except Exception as exc:  # noqa: BLE001 - the run matters more than its crash insurance
                self.checkpoints = False
                os.write(2, f"\nbenchmark checkpoints off: {type(exc).__name__}: {exc}\n".encode())

    def kept(self, benchmarks) -> list:
        """The cases a JSON may hold: their call finished (all rounds) and their test did not fail."""
        return [b for b in benchmarks if b.fullname in self.timed and b.fullname not in self.failed]

    def checkpoint(self) -> None:
        """The finished cases into the JSON path, marked as the record of a process that died: what a crash
        leaves behind. The machine probe runs once, at the first checkpoint."""
        bench_session = getattr(self.config, "_benchmarksession", None)
        target = getattr(bench_session, "json", None)
        if not target or bench_session.disabled:
            return
        benchmarks = self.kept(bench_session.benchmarks)
        if not benchmarks:
            return
        hook = self.config.hook
        if self.run_info is None:
            commit_info = hook.pytest_benchmark_generate_commit_info(config=self.config)
            hook.pytest_benchmark_update_commit_info(config=self.config, commit_info=commit_info)
            self.run_info = (bench_session.get_machine_info(), commit_info)
        machine_info, commit_info = self.run_info
        output = hook.pytest_benchmark_generate_json(config=self.config, benchmarks=benchmarks, include_data=True,
                                                      machine_info=machine_info, commit_info=commit_info)
        hook.pytest_benchmark_update_json(config=self.config, benchmarks=benchmarks, output_json=output)
        output["cut"] = {"reason": DIED, "collected": self.collected, "finished": len(self.finished),
                         "interrupted": [], "not_run": self.collected - len(self.finished)}
        write_over(target, json.dumps(output, indent=1, default=str).encode())
        self.last_checkpoint = time.monotonic()

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # before pytest-benchmark's own wrapper writes the JSON
    def pytest_sessionfinish(self, session, exitstatus):
        self.finishing = True
        reason = self.signal or ("KeyboardInterrupt" if exitstatus == pytest.ExitCode.INTERRUPTED else None)
        reason = reason or session.shouldfail or session.shouldstop or None
        if reason:
            collected = [item.nodeid for item in session.items]
            self.cut = {"reason": str(reason), "collected": len(collected),
                        "finished": sum(nodeid in self.finished for nodeid in collected),
                        "interrupted": sorted(self.started - self.finished),
                        "not_run": sum(nodeid not in self.started for nodeid in collected)}
        bench_session = getattr(session.config, "_benchmarksession", None)
        if bench_session is not None:
            # a case cut inside its call has partial statistics, a failed one (its check, or a ceiling it
            # exceeded after the timing) a number nobody may use: neither is written; `failed` names the latter
            bench_session.benchmarks[:] = self.kept(bench_session.benchmarks)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_benchmark_update_machine_info(self, config, machine_info):
        """In a cut run, a machine probe that fails (a GPU left mid-capture, say) must not cost the results:
        the error is recorded instead."""
        try:
            return (yield)
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON, which is what the cut run needs
            if self.cut is None:
                raise
            machine_info["probe_error_after_cut"] = f"{type(exc).__name__}: {exc}"
            return None

    @pytest.hookimpl
    def pytest_benchmark_update_json(self, config, benchmarks, output_json):
        output_json["cut"] = self.cut
        output_json["failed"] = dict(sorted(self.failed.items()))
        output_json["skipped"] = dict(sorted(self.skipped.items()))
        target = getattr(getattr(config, "_benchmarksession", None), "json", None)
        if self.finishing and target is not None and not isinstance(target, (str, os.PathLike)) and not target.closed:
            target.seek(0)  # the file pytest-benchmark < 5.3 opened is written next, from its start: no checkpoint
            target.truncate()  # left behind it

    @pytest.hookimpl(trylast=True)  # after pytest-benchmark's table: the last word of the run
    def pytest_terminal_summary(self, terminalreporter):
        if self.cut is None:
            return
        path = terminalreporter.config.getoption("benchmark_json", None)
        path = getattr(path, "name", path)  # pytest-benchmark < 5.3 holds the opened file
        bench_session = getattr(terminalreporter.config, "_benchmarksession", None)
        kept = len(bench_session.benchmarks) if bench_session is not None else 0
        where = f"{path} holds the {kept} finished benchmark case(s)" if path else f"{kept} finished case(s) kept"
        terminalreporter.write_line(
            f"benchmark run cut ({self.cut['reason']}) after {self.cut['finished']} of {self.cut['collected']} "
            f"test(s): {where}; {len(self.cut['interrupted'])} interrupted (dropped), {self.cut['not_run']} not run",
            yellow=True, bold=True)


def skip_reason(report) -> str:
    """The reason of a skipped test's report: pytest keeps (path, line, "Skipped: reason") for a skip, the
    xfail reason for an xfail."""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(getattr(report, "wasxfail", "") or report.longrepr).splitlines()[0] if report.longrepr else "skipped"


def write_over(target, data: bytes) -> None:
    """`data` as the whole content of pytest-benchmark's JSON target: a path (pytest-benchmark >= 5.3; replaced
    at once, never half written) or the file it opened at start-up (older ones)."""
    if isinstance(target, (str, os.PathLike)):
        part = Path(f"{os.fspath(target)}.part")
        part.write_bytes(data)
        os.replace(part, target)
    else:
        target.seek(0)
        target.write(data)
        target.truncate()
        target.flush()


def pytest_configure(config):
    plugin = BenchCut(config)
    plugin.install()
    config.pluginmanager.register(plugin, "pcvr_bench_cut")


def pytest_unconfigure(config):
    plugin = config.pluginmanager.get_plugin("pcvr_bench_cut")
    if plugin is not None:
        plugin.uninstall()
