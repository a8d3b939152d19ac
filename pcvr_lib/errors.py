"""Failures a command reports, and the output-path check every command makes before long work.

Library modules raise these; `pcvr_lib.cli` (the one error boundary) turns them into exit codes. They
live here rather than in the CLI so that the library never imports the command line.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


class CommandError(Exception):
    """A known failure of a command (bad input, refused request); the message says what and where."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C caught by a command that knows where it stopped; the message says so."""


def warn(message: str) -> None:
    """Legal input that loses something (a value read as missing, a metric that cannot be computed) or a slower
    path taken: one line `warning: <what, how many, what it means>` on stderr. Commands also record their
    warnings in the JSON they write, so a log without stderr still shows them."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """Something the user asked for that the data changes without loss (e.g. shorter batches at row-group ends):
    one line `note: ...` on stderr."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def check_writable(folder, option: str, shown=None) -> None:
    """Create `folder` if needed and prove a file can be written there: commands call this before any long
    work, so that a locked or impossible output path fails in the first second, not after the work. `shown`
    is the path the message names (default: the folder; a file's path when the folder is the file's)."""
    folder = Path(folder)
    shown = folder if shown is None else shown
    for parent in (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            raise CommandError(f"{option} {shown}: {parent} is a file, not a folder; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pcvr-write-check-"):
            pass
    except OSError as exc:
        where = f"{shown}: {folder}" if shown != folder else str(folder)
        raise CommandError(f"{option} {where} is not writable ({exc.strerror or exc}); choose a writable path") from exc


def check_writable_file(path, option: str) -> None:
    """check_writable for an output file: its folder must take a file, and the path must not be a folder."""
    path = Path(path)
    if path.is_dir():
        raise CommandError(f"{option} {path} is a folder; give a file path, e.g. {path / 'out.json'}")
    check_writable(path.parent, option, shown=path)
