"""The tests a cut pytest run never reported: collected node ids minus those with an outcome in the logs.

    python3 -m pytest --collect-only -q PATHS > collected.txt
    python3 -m pytest -v -n 8 PATHS > run.log          # cut by a time limit
    python3 tools/pytest_unreported.py collected.txt run.log [more.log ...] > todo.txt
    PCVR_ONLY_NODEIDS=todo.txt python3 -m pytest -v -n 8 PATHS    # the rest (root conftest.py)

The log must be verbose (-v): each outcome line reads "[gw3] [ 41%] PASSED NODEID" with pytest-xdist,
"NODEID PASSED [ 41%]" without.
Prints one node id per line; the count and how many were reported go to stderr.
"""

from __future__ import annotations

import re
import sys

_WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
XDIST_LINE = re.compile(rf"\b(?:{_WORDS}) (\S+::.+?)\s*$")  # [gw3] [ 41%] PASSED NODEID
PLAIN_LINE = re.compile(rf"^(\S+::.+?) (?:{_WORDS})\b")  # NODEID PASSED [ 41%]


def collected_ids(text: str) -> list[str]:
    """Node ids of `pytest --collect-only -q` output (its trailing summary lines left out)."""
    return [line.strip() for line in text.splitlines() if "::" in line and not line.startswith(" ")]


def reported_ids(text: str) -> set[str]:
    """Node ids that have an outcome line in a verbose pytest log (with or without xdist's prefixes)."""
    out = set()
    for line in text.splitlines():
        match = XDIST_LINE.search(line) or PLAIN_LINE.search(line)
        if match:
            out.add(match.group(1))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        collected = collected_ids(f.read())
    reported = set()
    for log in argv[1:]:
        with open(log) as f:
            reported |= reported_ids(f.read())
    todo = [nodeid for nodeid in collected if nodeid not in reported]
    print(f"{len(collected)} collected, {len(collected) - len(todo)} reported, {len(todo)} unreported",
          file=sys.stderr)
    for nodeid in todo:
        print(nodeid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
