"""A run's inputs: the data file, its schema, and the loaders that read them. Each failure names the path
or option at fault."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pyarrow as pa

from pcvr_lib.data.loader import PcvrLoader
from pcvr_lib.data.parquet import check_data_schema, open_dataset, scan_values
from pcvr_lib.errors import note, warn
from pcvr_lib.schema import SchemaError, load_schema
from pcvr_lib.train.checkpoint import CONFIG_FILE, SCHEMA_FILE
from pcvr_lib.train.config import TrainConfig, TrainError, strict_time_filter


def data_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TrainError(f"data file not found: {p} (make one with: pcvr generate --schema SCHEMA.json --out {p})")
    if not p.is_file():
        raise TrainError(f"data path is not a file: {p}")
    return p


def trained_data_path(data: str | Path | None, config: TrainConfig, folder: Path) -> Path:
    """val / infer: --data when given, else the file the checkpoint was trained on (stored absolute)."""
    if data is not None:
        return data_path(data)
    p = Path(config.data)
    if not p.is_file():
        raise TrainError(f"the data this checkpoint was trained on, {p} (as {folder / CONFIG_FILE} records), is not "
                         "there (moved or deleted): pass --data FILE")
    return p


def check_data(data: Path, schema, *, what: str, fix: str, labels: bool, dense: bool) -> list[str]:
    """What train, val and infer check on their data before any work, the same checks `pcvr inspect` reports:
    the data's own schema is the run's (`what` names the run's, `fix` says what to do), the file opens with
    every column, no request timestamp is negative. Lossy values are warned about (null labels when `labels`,
    non-finite dense values when `dense`: training says them, scoring reads them the same way): returned, for
    the caller to print (`errors.warn`) once its other preconditions hold, and to record in its JSON."""
    check_data_schema(data, schema, what, fix)
    with reading(data):
        counts = scan_values(open_dataset(data, schema), schema)
    counts.refuse_negative_timestamps(data)
    return counts.warnings(data, labels=labels, dense=dense)


def check_batch_rows(loader, batch_size: int, data: Path) -> list[str]:
    """Say what --batch-size gives where the file's layout changes it: a batch never spans row groups, so each
    row group's last batch holds fewer rows, and a batch size above a row group's rows on the training side
    gives batches of those rows. Returns the warnings (for the training summary)."""
    rows = loader.batch_rows
    largest = int(rows.max())
    if largest < batch_size:
        text = (f"--batch-size {batch_size} is more than the {largest:,} training rows of the largest row group of "
                f"{data}: a batch never spans row groups, so every step trains on at most {largest:,} rows")
        warn(text)
        return [text]
    short = rows[rows < batch_size]
    if len(short):
        low, high = int(short.min()), int(short.max())
        note(f"--batch-size {batch_size}: {len(rows) - len(short)} of {len(rows)} batches hold {batch_size} rows, "
             f"{len(short)} (row groups' last) {low if low == high else f'{low}-{high}'}: a batch never spans row "
             "groups; steps draw batches in proportion to their rows")
    return []


def schema_path(data: Path, schema: str | None) -> Path:
    """The --schema given, else the schema.json beside the data file."""
    if schema is not None:
        return Path(schema)
    beside = data.parent / SCHEMA_FILE
    if not beside.is_file():
        raise TrainError(f"no --schema given and no {SCHEMA_FILE} beside the data file {data}")
    return beside


def read_schema(path: Path, max_lens):
    """The schema at `path` with the run's --max-lens; a bad max_len blames the option, not the file (a missing
    file or a folder: load_schema's message)."""
    try:
        return load_schema(path, max_lens=max_lens)
    except SchemaError as exc:
        text = str(exc)
        if "max_len" in text:  # the option, not the file, is at fault
            raise TrainError(f"--max-lens {max_lens}: {text.split(': ', 1)[-1]}") from exc
        raise TrainError(text if str(path) in text else f"{path}: {text}") from exc


def make_loader(data: Path, schema, config: TrainConfig, *, for_training: bool = False, list_order=None, **kw):
    """A loader with the run's converter setting; only training batches get the run's loader preset
    (cache, augmentations): evaluation and inference read each row once, unaugmented. The list order is
    the run's unless `list_order` overrides it (val/infer --list-order)."""
    preset = config.loader_preset if for_training else "none"
    return PcvrLoader(data, schema, preset=preset, strict_time_filter=strict_time_filter(config),
                      list_order=list_order or config.list_order, **kw)


@contextlib.contextmanager
def reading(data: Path):
    """Read errors from deep inside pyarrow (a damaged page, a truncated file) name the data file."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        # an errno means the operating system (disk full, permissions: the boundary names the path); the
        # decoder's errors carry none. A message that names the file already is passed on as it is.
        if str(data) in str(exc) or (isinstance(exc, OSError) and exc.errno is not None):
            raise
        raise TrainError(f"{data}: cannot be read ({' '.join(str(exc).split())}); the file is damaged: "
                         "regenerate or re-copy it") from exc
