"""Side by side (`pcvr compare --side-by-side`): the base and the candidate run as two processes at once, and
each timed CPU round (its probes included) runs alone: it takes a lock shared by the two and stops the
other process (SIGSTOP) until the round is over. So the two sides' rounds interleave within seconds and
see the same load from other jobs, while neither ever shares the cores with the other's work."""

from __future__ import annotations

import contextlib
import os
import time

EXCLUSIVE_ENV = "PCVR_EXCLUSIVE_DIR"  # a folder holding `lock` and `pids` (the processes of the pair)


class ExclusiveRound:
    """Context manager: with `PCVR_EXCLUSIVE_DIR` set, hold its lock and keep the other processes named in
    its `pids` file stopped for the duration; without it, nothing."""

    def __init__(self, folder: str | None = None):
        self.folder = folder if folder is not None else os.environ.get(EXCLUSIVE_ENV) or None
        self._fd: int | None = None
        self._stopped: list[int] = []

    @property
    def active(self) -> bool:
        return self.folder is not None

    def peers(self) -> list[int]:
        try:
            text = open(os.path.join(self.folder, "pids")).read()
        except FileNotFoundError:  # the other side is not started yet
            return []
        return [int(p) for p in text.split() if int(p) != os.getpid()]

    def __enter__(self):
        if not self.active:
            return self
        import fcntl
        import signal

        self._fd = os.open(os.path.join(self.folder, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        for pid in self.peers():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # already finished
                continue
            self._stopped.append(pid)
            _wait_stopped(pid)
        return self

    def __exit__(self, *exc):
        if self._fd is None:
            return
        import fcntl
        import signal

        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped = []
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until /proc says `pid` is stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0005)
