"""What the command-line tests share: a small training setup, the one-error-line rule, finished runs and
their files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pcvr_lib.cli import main as cli_main
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.workloads.models import DEMO_SCHEMA

ROWS = 120
MAX_LENS = "seq_a:6,seq_b:6,seq_c:6,seq_d:6"
TRAIN = ["--model", "baseline", "--max-lens", MAX_LENS, "--batch-size", "32", "--model-config",
         '{"vocab_cap": 64}', "--log-every", "0"]


def demo_data(folder: Path) -> Path:
    """ROWS generated rows of the demo schema in `folder`/d.parquet."""
    return generate_dataset(DEMO_SCHEMA, rows=ROWS, seed=5, out=folder / "d.parquet", progress=False)


def finished_run(data: Path, run_dir: Path, *options: str) -> Path:
    """`pcvr train` of TRAIN on `data` into `run_dir` with `options` (steps, evaluations), which must succeed."""
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(run_dir), *options]) == 0
    return run_dir


def copy_of(run_dir: Path, folder: Path) -> Path:
    """A copy of a finished run (a test may damage it) in `folder`/copy."""
    copy = folder / "copy"
    shutil.copytree(run_dir, copy)
    return copy


def run_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "training_summary.json").read_text())


def best_checkpoint(run_dir: Path) -> Path:
    return run_dir / Path(run_summary(run_dir)["best_checkpoint"]).name


def without_notices(err: str) -> list[str]:
    """stderr's lines but the `warning:` / `note:` lines the commands print about their data (counted lossy
    values, batch sizes) once its preconditions hold, before the work."""
    return [line for line in err.strip().splitlines() if not line.startswith(("warning: ", "note: "))]


def one_error_line(capsys, command: str, *needles: str) -> str:
    """The captured stderr is exactly one `pcvr <command>: error: ...` line holding every needle (after the
    warnings about the data, when the error came during the work)."""
    err = capsys.readouterr().err
    lines = without_notices(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"pcvr {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]
