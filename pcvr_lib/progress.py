"""Progress for long work: a tqdm bar on an interactive terminal, nothing (or a plain line now and then,
where the caller asks for one) when stderr is a pipe, a file, CI or a terminal that reports no usable
width (tqdm draws nothing there), so logs stay readable and no terminal is left without a sign of life."""

from __future__ import annotations

import os
import sys
import time

QUIET_ENV = "PCVR_NO_PROGRESS"  # set (to anything but "" or "0") to silence every bar, e.g. inside workers
MIN_BAR_COLUMNS = 20  # narrower than this (or no width at all: 0 columns), a bar cannot show anything


def interactive(stream=None) -> bool:
    """True when progress bars make sense: stderr is a terminal that reports a usable width, this is not CI,
    and PCVR_NO_PROGRESS is unset."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    quiet = os.environ.get(QUIET_ENV, "") not in ("", "0") or bool(os.environ.get("CI"))
    return bool(isatty and isatty()) and not quiet and terminal_columns(stream) >= MIN_BAR_COLUMNS


def terminal_columns(stream) -> int:
    """The width the terminal behind `stream` reports (0 when it reports none or is not a terminal)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def bar(total: int | None, desc: str, unit: str = "it", **kwargs):
    """A tqdm bar on stderr, disabled (a silent no-op object) when not interactive."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not interactive(), leave=False, dynamic_ncols=True,
                file=sys.stderr, **kwargs)


def eta_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class StepProgress:
    """Training progress: a bar with rows/s, loss and ETA on a terminal; otherwise a plain line with the
    same numbers after the first step, every `every` steps and after any step that ends more than
    `quiet_sec` after the last line (`every` 0: no lines). `note(text)` prints a line either way (above
    the bar on a terminal): what a long pause between steps was (a holdout evaluation, a checkpoint)."""

    def __init__(self, steps: int, start: int, desc: str, every: int = 0, quiet_sec: float = 10.0):
        self.steps, self.start, self.every, self.quiet_sec = steps, start, every, quiet_sec
        self.rows = 0
        self.t0 = self.last_line = time.perf_counter()
        self.bar = bar(steps, desc, unit="step", initial=start)

    def update(self, step: int, rows: int, loss: float, grad_norm: float) -> None:
        self.rows += rows
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.rows / elapsed
        eta = (self.steps - step) * elapsed / max(step - self.start, 1)
        if not self.bar.disable:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} rows/s", refresh=False)
            self.bar.update(1)
        elif self.every and (step % self.every == 0 or step in (self.start + 1, self.steps)
                             or time.perf_counter() - self.last_line > self.quiet_sec):
            self.last_line = time.perf_counter()
            print(f"step {step}/{self.steps} loss {loss:.4f} grad_norm {grad_norm:.3f} {rate:,.0f} rows/s "
                  f"ETA {eta_text(eta)}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if not self.bar.disable:
            self.bar.write(text, file=sys.stderr)
        elif self.every:
            self.last_line = time.perf_counter()
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
