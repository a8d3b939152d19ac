"""Failures a command reports, and the output-path check every command makes before long work.

Library modules raise these; `pcvr_lib.cli` (the one error boundary) turns them into exit codes. They
live here rather than in the CLI so that the library never imports the command line.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


class CommandError(Exception):
    """A known failure of a command (bad input, refused request); the message says what and where."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C caught by a command that knows where it stopped; the message says so."""


def check_writable(folder, option: str) -> None:
    """Create `folder` if needed and prove a file can be written there: commands call this before any long
    work, so that a locked or impossible output path fails in the first second, not after the work."""
    folder = Path(folder)
    for parent in (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            raise CommandError(f"{option} {folder}: {parent} is a file, not a folder; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pcvr-write-check-"):
            pass
    except OSError as exc:
        raise CommandError(f"{option} {folder} is not writable ({exc.strerror or exc}); choose a writable "
                           "path") from exc
