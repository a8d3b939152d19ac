"""A run's inputs: the data file, its schema, and the loaders that read them. Each failure names the path
or option at fault."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pyarrow as pa

from pcvr_lib.data.loader import PcvrLoader
from pcvr_lib.schema import SchemaError, load_schema
from pcvr_lib.train.checkpoint import SCHEMA_FILE
from pcvr_lib.train.config import TrainConfig, TrainError, strict_time_filter


def data_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TrainError(f"data file not found: {p} (make one with: pcvr generate --schema SCHEMA.json --out {p})")
    if not p.is_file():
        raise TrainError(f"data path is not a file: {p}")
    return p


def schema_path(data: Path, schema: str | None) -> Path:
    """The --schema given, else the schema.json beside the data file."""
    if schema is not None:
        return Path(schema)
    beside = data.parent / SCHEMA_FILE
    if not beside.is_file():
        raise TrainError(f"no --schema given and no {SCHEMA_FILE} beside the data file {data}")
    return beside


def read_schema(path: Path, max_lens):
    """The schema at `path` with the run's --max-lens; a bad max_len blames the option, not the file."""
    if not path.is_file():
        raise TrainError(f"schema file not found: {path}")
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
