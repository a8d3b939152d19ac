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
- the JSON says what happened in a top-level `cut` field: null for a complete run, else {"reason",
  "collected", "finished", "interrupted" (the ids dropped), "not_run"}; a run stopped by -x / --maxfail is
  cut too. The terminal says it in one line; `pcvr report FILE` prints it.

perf_tests/conftest.py loads it; a test directory of its own can load it with `pytest_plugins`.
"""

from __future__ import annotations

import os
import signal

import pytest

CUT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class BenchCut:
    def __init__(self):
        self.signal: str | None = None  # the signal that cut the run
        self.finishing = False  # the session is writing its results: signals wait
        self.previous: dict[int, object] = {}
        self.timed: set[str] = set()  # node ids whose call phase reported
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.cut: dict | None = None
        self.failed: dict[str, str] = {}  # node id -> the first line of why its test failed

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

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid, location):
        self.finished.add(nodeid)

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
            bench_session.benchmarks[:] = [b for b in bench_session.benchmarks
                                           if b.fullname in self.timed and b.fullname not in self.failed]
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

    @pytest.hookimpl(trylast=True)  # after pytest-benchmark's table: the last word of the run
    def pytest_terminal_summary(self, terminalreporter):
        if self.cut is None:
            return
        path = terminalreporter.config.getoption("benchmark_json", None)
        bench_session = getattr(terminalreporter.config, "_benchmarksession", None)
        kept = len(bench_session.benchmarks) if bench_session is not None else 0
        where = f"{path} holds the {kept} finished benchmark case(s)" if path else f"{kept} finished case(s) kept"
        terminalreporter.write_line(
            f"benchmark run cut ({self.cut['reason']}) after {self.cut['finished']} of {self.cut['collected']} "
            f"test(s): {where}; {len(self.cut['interrupted'])} interrupted (dropped), {self.cut['not_run']} not run",
            yellow=True, bold=True)


def pytest_configure(config):
    plugin = BenchCut()
    plugin.install()
    config.pluginmanager.register(plugin, "pcvr_bench_cut")


def pytest_unconfigure(config):
    plugin = config.pluginmanager.get_plugin("pcvr_bench_cut")
    if plugin is not None:
        plugin.uninstall()
