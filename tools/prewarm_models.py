"""Fill torch.compile's caches on disk for the compiled cases of perf_tests/test_models.py before a timed run:
one untimed pytest process (`--benchmark-disable`: the case's check and one call, so both graphs of a phase get
made) per model x backend x mode, several at once. Inductor's FX-graph, AOTAutograd and Triton caches are keyed
by the graph and the config (not by the process), so the timed run that follows loads what these made instead of
compiling each model in turn (1-2.5 min a model on the H200 host). Eager and captured cases need no compiling
and are skipped.

    python3 tools/prewarm_models.py NODE_IDS_FILE [--jobs 12]

A SIGINT or SIGTERM (the session step's time limit) stops every process it started; what they cached stays.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ID = re.compile(r"model=(?P<model>[^,\]]+),backend=(?P<backend>[^,\]]+),mode=(?P<mode>[^,\]]+),phase=")


def groups_of(ids: list[str]) -> dict[tuple[str, str, str], list[str]]:
    """The compiled node ids by (model, backend, mode), in the file's order."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for node in ids:
        match = ID.search(node)
        if match and match["mode"] in ("compile", "graph"):
            out.setdefault((match["model"], match["backend"], match["mode"]), []).append(node)
    return out


def why_failed(log: Path, tail: int = 3) -> list[str]:
    """A failed build's reason from its pytest log: the short summary's FAILED / ERROR lines, else its last
    lines (a crash or an error before any test ran)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    summary = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return summary or lines[-tail:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", help="a file of perf_tests/test_models.py node ids, one a line")
    parser.add_argument("--jobs", type=int, default=12, help="processes at once (default 12)")
    parser.add_argument("--compile-threads", type=int, default=2,
                        help="inductor's compile workers per process (not part of its cache key; default 2)")
    args = parser.parse_args()
    ids = [line.strip() for line in Path(args.ids).read_text().splitlines() if line.strip()]
    todo = list(groups_of(ids).items())
    if not todo:
        print("prewarm_models: no compile or graph case in", args.ids)
        return 0
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(args.compile_threads))
    logs = ROOT / "results"
    logs.mkdir(exist_ok=True)
    running: dict[subprocess.Popen, tuple[tuple[str, str, str], float]] = {}

    def stop(signum, _frame):
        for proc in running:
            proc.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    start, failed = time.perf_counter(), 0
    while todo or running:
        while todo and len(running) < args.jobs:
            key, nodes = todo.pop(0)
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable", *nodes]
            with open(logs / f"prewarm_{'_'.join(key)}.log", "w") as log:  # the child keeps its own descriptor
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[proc] = (key, time.perf_counter())
        time.sleep(1.0)
        for proc in [p for p in running if p.poll() is not None]:
            key, began = running.pop(proc)
            failed += proc.returncode != 0
            print(f"[{time.perf_counter() - start:5.0f}s] {' '.join(key)}: rc {proc.returncode} in "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
            if proc.returncode != 0:  # why, here: the build's own log stays on the machine
                print(*(f"    {line}" for line in why_failed(logs / f"prewarm_{'_'.join(key)}.log")), sep="\n")
    print(f"prewarm_models: {len(groups_of(ids))} builds, {failed} failed, {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
