"""Code says what and why, never history (ARCHITECTURE.md, Conventions), and modules stay small.

History (which session or lease measured what, on which tree, on which day, for which issue) belongs in
notes/ and in commit messages. The first test looks for it in the comments and strings of every tracked
Python file, and in every line of the tracked shell scripts, Makefiles and TOML files (their code is
mostly strings and comments, so the whole line is read). notes/ and .benchmarks/ hold history by design.
"""

from __future__ import annotations

import io
import pathlib
import re
import subprocess
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIS_FILE = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()
MAX_MODULE_LINES = 700
SIZED_PACKAGES = ("pcvr_lib", "perf_tests", "accuracy_tests", "smoke_tests", "tools")
HISTORY_FOLDERS = ("notes/", ".benchmarks/")

HISTORY_PATTERNS = {
    # "session 6", "sessions 5-6", "lease B", "leaseA", and "s6"-style tags (lowercase: S17 is a shape)
    "session or lease": re.compile(r"(?i:\bsessions?)[\s-]*\d+|\b(?i:leases?)\s*[A-Z](?![A-Za-z])|\bs\d{1,2}\b"),
    # a git object name: 7-40 lowercase hex digits with at least one letter and one digit, standing alone
    # (0x9e3779b9 is a constant, 1000000 a number, "defaced" a word; a 64-digit sha256 is longer than 40)
    "tree hash": re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![0-9A-Za-z_])"),
    "date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    "issue number": re.compile(r"(?i:\bissues?)\s*#?\s*\d+|\b(?:PR|(?i:pull request))\s*#\s*\d+"),
}

# (file, a pattern of the allowed line, why): each entry must still match a finding (test below).
ALLOWED = [
    ("pcvr_lib/data/generate.py", re.compile(r"\b2025-10-09\b"),
     "the generated data's first request time: a property of the data, not of its history"),
    ("smoke_tests/test_report_compare.py", re.compile(r"\b(?:abcdef1234(?:567)?|156d421737(?:29a750)?|740bbe9)\b"),
     "made-up commit ids: the test data of the report's commit column"),
    ("pcvr_lib/models/dualq.py", re.compile(r"# 1970-01-01 was a Thursday$"),
     "the Unix epoch's weekday, which the weekday arithmetic on that line relies on"),
]


def tracked_files() -> list[str]:
    listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return listing.stdout.splitlines()


def is_shell_script(path: str) -> bool:
    if path.endswith(".sh"):
        return True
    if pathlib.PurePosixPath(path).suffix:
        return False
    with open(ROOT / path, "rb") as handle:
        first = handle.readline()
    return first.startswith(b"#!") and first.rstrip().endswith((b"sh", b"bash"))


def checked_files() -> list[str]:
    """The tracked code and configuration read for history: .py, shell scripts, Makefiles, .toml."""
    return sorted(
        path for path in tracked_files()
        if not path.startswith(HISTORY_FOLDERS) and path != THIS_FILE
        and (path.endswith((".py", ".toml")) or pathlib.PurePosixPath(path).name == "Makefile"
             or is_shell_script(path))
    )


def python_text(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each line of each comment and string token (docstrings included)."""
    kinds = {tokenize.COMMENT, tokenize.STRING}
    if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python 3.12 splits f-strings into parts
        kinds.add(tokenize.FSTRING_MIDDLE)
    pieces = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in kinds:
            for offset, text in enumerate(token.string.splitlines()):
                pieces.append((token.start[0] + offset, text))
    return pieces


def history_findings(path: str) -> list[tuple[int, str, str, str]]:
    """(line number, kind, match, the line) of each history citation in one file, allowed ones left out."""
    source = (ROOT / path).read_text(encoding="utf-8")
    lines = source.splitlines()
    pieces = python_text(source) if path.endswith(".py") else list(enumerate(lines, start=1))
    findings = []
    for number, text in pieces:
        line = lines[number - 1]
        for kind, pattern in HISTORY_PATTERNS.items():
            for match in pattern.finditer(text):
                if not any(path == file and allowed.search(line) for file, allowed, _ in ALLOWED):
                    findings.append((number, kind, match.group(0), line.strip()))
    return findings


def test_code_cites_no_history():
    offending = [
        f"{path}:{number}: {kind} {found!r}: {line[:140]}"
        for path in checked_files()
        for number, kind, found, line in history_findings(path)
    ]
    if offending:
        pytest.fail(f"{len(offending)} history citations in code (say what and why; history goes to notes/ "
                    "and commit messages):\n" + "\n".join(offending), pytrace=False)


def test_every_allowed_line_still_exists():
    """An allowance whose line is gone is removed, so that the list stays short and every entry explained."""
    for path, allowed, why in ALLOWED:
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        assert any(allowed.search(line) for line in lines), f"{path}: no line matches {allowed.pattern} ({why})"


def test_the_patterns_tell_history_from_code():
    cited = ["measured in session 6", "sessions 5-6", "lease B's host", "noise_runs/leaseA_rep1.json",
             "the s6 smoke", "on tree aacb54b", "tree 53c23c8", "swept on 2026-12-02", "issue 12's shapes",
             "(issue #14)", "PR #3"]
    legitimate = ["golden = 0x9E3779B9", "0x9e3779b9", "S17 and S4096 shapes", "1000000 rows", "defaced",
                  "sha256 " + "ab12" * 16, "bf16 at 30 s", "the GPU session's time limit", "please Release it",
                  "#1f77b4", "issues are filed", "float16", "2026-13-45"]

    def kinds(text):
        return [kind for kind, pattern in HISTORY_PATTERNS.items() if pattern.search(text)]
    assert [text for text in cited if not kinds(text)] == []
    assert {text: kinds(text) for text in legitimate if kinds(text)} == {}


def test_no_module_is_over_700_lines():
    sizes = {
        path: len((ROOT / path).read_text(encoding="utf-8").splitlines())
        for path in tracked_files()
        if path.endswith(".py") and path.split("/", 1)[0] in SIZED_PACKAGES
    }
    over = [f"{path}: {lines} lines" for path, lines in sorted(sizes.items()) if lines > MAX_MODULE_LINES]
    if over:
        pytest.fail(f"{len(over)} modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(over),
                    pytrace=False)
