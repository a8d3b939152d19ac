"""The node ids of a plan file that a crashed benchmark run did not reach: what to run again after a process
died (a segfault in a compiler, say) without losing the rest of a device call.

    python3 tools/remaining_ids.py IDS_FILE RUN_JSON > remaining.txt

RUN_JSON is the run's checkpoint (perf_tests/bench_plugin.py): its timed cases and its `failed` ones are done.
The first id of the plan that is neither is the one the process died in; it is left out, with every id of its
group (the same id but for `phase=`: the model x backend x mode whose build crashed), and named on stderr. The
ids after it are printed in the plan's order. A run that did not die (no `cut`, or cut otherwise) leaves nothing.

    python3 tools/remaining_ids.py IDS_FILE RUN_JSON --time-limit > remaining.txt

is for a process killed at its step's time limit (SIGKILL after a SIGINT it did not stop for: inductor builds a
graph through it) rather than by a crash of its own: the id it was in is not to blame, so it and its group run
again first.

    python3 tools/remaining_ids.py IDS_FILE RUN_JSON [RUN_JSON ...] --untimed > todo.txt

is for a later device call (cut or not, died or not): the plan's ids that none of the runs timed or failed, in
the plan's order (a missing run file counts as no run: a fresh machine kept nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PHASE = re.compile(r",?phase=[^,\]]*")
DIED_PREFIX = "the process died"


def remaining(ids: list[str], run: dict, time_limit: bool = False) -> tuple[list[str], list[str]]:
    """(ids still to run, ids left out as the crashed group) of the plan `ids` after `run`; with `time_limit`
    nothing is left out."""
    cut = run.get("cut") or {}
    if not str(cut.get("reason", "")).startswith(DIED_PREFIX):
        return [], []
    todo = untimed(ids, [run])
    if not todo:
        return [], []
    if time_limit:
        return todo, []
    group = PHASE.sub("", todo[0])
    crashed = [node for node in todo if PHASE.sub("", node) == group]
    return [node for node in todo if node not in crashed], crashed


def untimed(ids: list[str], runs: list[dict]) -> list[str]:
    """The ids of the plan `ids` that no run in `runs` timed or failed."""
    done = {node for run in runs for node in run.get("failed") or {}}
    done |= {b.get("fullname") or b.get("name") for run in runs for b in run.get("benchmarks", [])}
    return [node for node in ids if node not in done]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", type=Path, help="the plan: node ids, one a line, in the order they ran")
    parser.add_argument("runs", type=Path, nargs="+", metavar="run",
                        help="the run's benchmark JSON (its checkpoint after a crash); with --untimed, any runs")
    parser.add_argument("--time-limit", action="store_true",
                        help="the process was killed at its step's time limit, not by a crash: keep its last id")
    parser.add_argument("--untimed", action="store_true",
                        help="the plan's ids that none of the runs timed or failed (missing run files: no run)")
    args = parser.parse_args(argv)
    ids = [line.strip() for line in args.ids.read_text().splitlines() if line.strip()]
    if len(args.runs) > 1 and not args.untimed:
        print("remaining_ids: several runs are for --untimed; after a crash, give the one run that died",
              file=sys.stderr)
        return 2
    runs = []
    for path in args.runs:
        if args.untimed and not path.exists():
            continue
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"remaining_ids: {path}: not a readable benchmark JSON ({exc})", file=sys.stderr)
            return 2
    if args.untimed:
        print("\n".join(untimed(ids, runs)))
        return 0
    run = runs[0]
    left, crashed = remaining(ids, run, args.time_limit)
    if args.time_limit and left:
        print(f"remaining_ids: the step stopped at its time limit in {left[0]}; {len(left)} id(s) to run, that "
              "one first", file=sys.stderr)
    if crashed:
        print(f"remaining_ids: the process died in {crashed[0]}; left out with its group: {len(crashed)} id(s); "
              f"{len(left)} to run again", file=sys.stderr)
    print("\n".join(left))
    return 0


if __name__ == "__main__":
    sys.exit(main())
