"""Seeded demo-like PCVR parquet data from any valid schema, amplified and cached by content hash.

The base table (`rows` rows) is generated once with vectorised numpy; amplification writes it
`multiplier` times with the reference's jitter for repeat i > 0 (user_id/item_id += i*rows,
timestamp/label_time += i*86,400), one repeat's rows split into row groups of `row_group_size`.

Shapes (see notes/data-convert.md for the numbers):
- scalars user_id / item_id int64 (Zipf-like), label_type int32 (2 = conversion, about 10%, else 1),
  label_time int64, timestamp int64 (request time over two weeks from 2025-10-09);
- width-1 int features: Zipf-like (p ~ 1/k) ids in [1, vocab) plus nulls, zeros, negatives and
  out-of-vocab values (some exactly == vocab);
- width>1 int lists: lengths up to about twice the width, some null or empty;
- dense lists float32: embeddings of exactly `dim` (some null), and the lists that share a fid with a
  user_int list are element-aligned with it (same length, same nulls), like fids 62-66/89-91 of the demo;
  a few NaN / +-inf;
- sequences: per row a heavy-tailed (lognormal) length capped at 4000; the last domain (sorted by name,
  seq_d in the demo) averages about 2.5x its max_len (~1,300 events), the others about 0.7x theirs, so many
  rows are longer than max_len. Lists are chronological, newest LAST by default (`list_order`:
  "newest-first" reverses every row's sequence lists, the order of the independent data the reference
  also reads; "mixed" reverses a seeded half of the rows); event times lie before the request except for about
  10% of rows whose newest events come a little after it; some event times are 0. A side column is null for
  0.2% of rows (a rare ragged domain).

Planted signal (the label's logit; `planted_score` recomputes it from a converted batch):
    +1.4 if the first width-1 user_int feature with vocab >= 3 has value % 3 == 1
    +1.2 if the first width-1 item_int feature with vocab >= 3 has value % 4 == 1
    +1.3 if the newest event of the first domain happened within one hour before the request
    +1.0 if that newest event's first side feature has value % 2 == 1
(values that are invalid after conversion - null, <= 0, out of vocab - count as "no"), plus a bias
solved so that about 10% of rows are positive.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pcvr_lib.data.parquet import SCHEMA_METADATA_KEY
from pcvr_lib.errors import CommandError
from pcvr_lib.schema import Schema, load_schema

GENERATOR_VERSION = 2
LIST_ORDERS = ("newest-last", "newest-first", "mixed")
REQUEST_T0 = 1_760_000_000  # 2025-10-09, request times span two weeks after it
REQUEST_SPAN = 14 * 86_400
DAY = 86_400
MAX_SEQ_LEN = 4000
POSITIVE_RATE = 0.10
PARQUET_COMPRESSION = "snappy"
GENERATION_INFO = "generation.json"  # written beside a generated file: rows, bytes, seconds, peak RSS
# The memory check before a large base table (check_memory): a sample of this many rows is generated and
# its bytes per row scaled; peak RSS was 1.14-1.15x the table's bytes at 1,000 and 4,000 rows of the demo
# schema (numpy intermediates), so the estimate takes 1.25x.
MEMORY_SAMPLE_ROWS = 200
MEMORY_PEAK_FACTOR = 1.25

# Noise rates of the id generator.
P_NULL = 0.03
P_ZERO = 0.03
P_NEG = 0.01
P_OOB = 0.005
P_SIDE_NULL = 0.002  # a side column null for a row while its domain has events (rare)

# Planted signal weights (see the module docstring).
W_USER, W_ITEM, W_RECENT, W_SIDE = 1.4, 1.2, 1.3, 1.0
RECENT_SECONDS = 3600


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------


def _zipf_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """Zipf-like ids (p(k) ~ 1/k, log-uniform) in [1, vocab); vocab <= 1 gives 1 (out of vocab)."""
    top = max(int(vocab), 2) if vocab > 0 else 1000
    ids = np.floor(np.exp(rng.random(n) * np.log(top))).astype(np.int64)
    return np.clip(ids, 1, max(top - 1, 1))


def _noisy_ids(rng: np.random.Generator, n: int, vocab: int, noise: float = 1.0) -> np.ndarray:
    """Zipf-like ids with zeros, negatives and out-of-vocab values (some exactly == vocab) mixed in."""
    ids = _zipf_ids(rng, n, vocab)
    u = rng.random(n)
    cut_zero = P_ZERO * noise
    cut_neg = cut_zero + P_NEG * noise
    cut_oob = cut_neg + P_OOB * noise
    ids[u < cut_zero] = 0
    neg = (u >= cut_zero) & (u < cut_neg)
    ids[neg] = -rng.integers(1, 1000, size=int(neg.sum()))
    oob = (u >= cut_neg) & (u < cut_oob)
    if vocab > 0:
        ids[oob] = vocab + rng.integers(0, 3, size=int(oob.sum())) * rng.integers(0, 2, size=int(oob.sum()))
    return ids


def _list_array(lengths: np.ndarray, null: np.ndarray, values: np.ndarray) -> pa.Array:
    """A list array from per-row lengths (null rows must have length 0) and the flat values."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    assert offsets[-1] == len(values)
    mask = pa.array(null) if null.any() else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def _list_lengths(rng: np.random.Generator, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths of a width>1 int list: uniform in [1, dim], 15% beyond dim (up to 2*dim+2), some null/empty."""
    lengths = rng.integers(1, dim + 1, size=n)
    u = rng.random(n)
    beyond = u < 0.15
    lengths[beyond] = rng.integers(dim + 1, 2 * dim + 3, size=int(beyond.sum()))
    lengths[(u >= 0.15) & (u < 0.21)] = 0
    null = (u >= 0.21) & (u < 0.21 + P_NULL)
    lengths[null] = 0
    return lengths.astype(np.int64), null


def _dense_values(rng: np.random.Generator, n: int) -> np.ndarray:
    values = rng.standard_normal(n).astype(np.float32)
    u = rng.random(n)
    values[u < 0.005] = np.nan
    values[(u >= 0.005) & (u < 0.0075)] = np.inf
    values[(u >= 0.0075) & (u < 0.01)] = -np.inf
    return values


def _seq_lengths(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """Heavy-tailed (lognormal, sigma 0.9) lengths with the given mean, capped at MAX_SEQ_LEN; 4% empty."""
    sigma = 0.9
    mu = np.log(mean) - sigma**2 / 2
    lengths = np.minimum(np.floor(rng.lognormal(mu, sigma, size=n)), MAX_SEQ_LEN).astype(np.int64)
    lengths[rng.random(n) < 0.04] = 0
    return lengths


def _event_times(rng: np.random.Generator, request_ts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Chronological event times (newest last) per row, flat. The newest event is a few hours before the
    request (for ~10% of rows a little after it); gaps between events are exponential (mean 6 h)."""
    n_rows = len(lengths)
    total = int(lengths.sum())
    gaps = rng.exponential(6 * 3600, size=total).astype(np.int64) + 1
    # suffix sums within each row: time from event j back from the row's newest event
    ends = np.cumsum(lengths)
    csum = np.cumsum(gaps)
    row_of = np.repeat(np.arange(n_rows), lengths)
    suffix = csum[np.repeat(ends - 1, lengths)] - csum  # 0 for the newest event of each row
    newest_gap = rng.exponential(4 * 3600, size=n_rows).astype(np.int64)
    late = rng.random(n_rows) < 0.10
    newest_gap[late] = -rng.integers(1, 3 * 3600, size=int(late.sum()))
    ts = request_ts[row_of] - newest_gap[row_of] - suffix
    ts[rng.random(total) < 0.003] = 0
    return ts


# ----------------------------------------------------------------------------------------------
# the base table
# ----------------------------------------------------------------------------------------------


def _reverse_rows(array: pa.Array, flip: np.ndarray) -> pa.Array:
    """The list column with the lists of the rows where `flip` is set reversed (nulls kept)."""
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(row)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    source = np.where(flip[row], lengths[row] - 1 - within, within) + np.repeat(offsets[:-1], lengths)
    values = array.values.to_numpy()[source]
    return pa.ListArray.from_arrays(
        pa.array(offsets - offsets[0], pa.int32()), pa.array(values), mask=array.is_null() if array.null_count else None
    )


def generate_table(schema: Schema, rows: int, seed: int = 0, list_order: str = "newest-last") -> pa.Table:
    """The base table: `rows` rows of demo-like data for `schema` (deterministic in `seed`); sequence lists
    in `list_order` (LIST_ORDERS; the same events whatever the order)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if list_order not in LIST_ORDERS:
        raise ValueError(f"list_order must be one of {', '.join(LIST_ORDERS)}, got {list_order!r}")
    rng = np.random.default_rng(seed)
    columns: dict[str, pa.Array] = {}

    request_ts = REQUEST_T0 + rng.integers(0, REQUEST_SPAN, size=rows).astype(np.int64)
    user_id = _zipf_ids(rng, rows, max(rows * 4, 16))
    item_id = _zipf_ids(rng, rows, max(rows, 16))
    logit = np.zeros(rows)

    int_lists: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # user_int fid -> (lengths, null) of lists
    for group in ("user_int", "item_int"):
        planted = False
        for feat in getattr(schema, group):
            if feat.dim == 1:
                values = _noisy_ids(rng, rows, feat.vocab_size)
                null = rng.random(rows) < P_NULL
                if not planted and feat.vocab_size >= 3:
                    valid = ~null & (values > 0) & (values < feat.vocab_size)
                    if group == "user_int":
                        logit += W_USER * (valid & (values % 3 == 1))
                    else:
                        logit += W_ITEM * (valid & (values % 4 == 1))
                    planted = True
                columns[feat.column] = pa.array(values, mask=null)
            else:
                lengths, null = _list_lengths(rng, rows, feat.dim)
                if group == "user_int":
                    int_lists[feat.fid] = (lengths, null)
                values = _noisy_ids(rng, int(lengths.sum()), feat.vocab_size)
                columns[feat.column] = _list_array(lengths, null, values)

    for group in ("user_dense", "item_dense"):
        for feat in getattr(schema, group):
            if group == "user_dense" and feat.fid in int_lists:
                lengths, null = int_lists[feat.fid]  # element-aligned with the same-fid user_int list
            else:
                lengths = np.full(rows, feat.dim, dtype=np.int64)
                u = rng.random(rows)
                null = u < P_NULL
                short = (u >= P_NULL) & (u < P_NULL + 0.02)
                lengths[short] = rng.integers(0, feat.dim, size=int(short.sum()))
                lengths[null] = 0
            columns[feat.column] = _list_array(lengths, null, _dense_values(rng, int(lengths.sum())))

    for i, domain in enumerate(schema.domains):
        last = i == len(schema.domains) - 1
        mean = (2.5 if last else 0.7) * domain.max_len
        lengths = _seq_lengths(rng, rows, mean)
        ts = _event_times(rng, request_ts, lengths)
        ends = np.cumsum(lengths)
        has = lengths > 0
        newest = np.where(has, ends - 1, 0)
        no_null = np.zeros(rows, dtype=bool)
        for feat in domain.features:
            if feat.fid == domain.ts_fid:
                columns[feat.column] = _list_array(lengths, no_null, ts)
                continue
            null = rng.random(rows) < P_SIDE_NULL  # a side column missing for a row (ragged domain)
            feat_lengths = np.where(null, 0, lengths)
            values = _noisy_ids(rng, int(lengths.sum()), feat.vocab_size)
            if i == 0 and feat is domain.side_features[0] and len(values):
                newest_value = values[newest]
                ok = has & ~null & (newest_value > 0) & (newest_value < feat.vocab_size)
                logit += W_SIDE * (ok & (newest_value % 2 == 1))
            keep = np.repeat(~null, lengths)
            columns[feat.column] = _list_array(feat_lengths, null, values[keep])
        if i == 0 and len(ts):
            gap = request_ts - ts[newest]
            logit += W_RECENT * (has & (gap > 0) & (gap <= RECENT_SECONDS))

    # bias so that about POSITIVE_RATE of rows are positive (bisection on the expected rate)
    lo, hi = -12.0, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        rate = np.mean(1 / (1 + np.exp(-(logit + mid))))
        lo, hi = (mid, hi) if rate < POSITIVE_RATE else (lo, mid)
    prob = 1 / (1 + np.exp(-(logit + lo)))
    positive = rng.random(rows) < prob
    label_type = np.where(positive, 2, 1).astype(np.int32)
    label_time = request_ts + np.where(positive, rng.integers(60, 3 * DAY, size=rows), 0)

    scalars = {
        "user_id": pa.array(user_id, pa.int64()),
        "item_id": pa.array(item_id, pa.int64()),
        "label_type": pa.array(label_type, pa.int32()),
        "label_time": pa.array(label_time, pa.int64()),
        "timestamp": pa.array(request_ts, pa.int64()),
    }
    if list_order != "newest-last":
        flip = np.ones(rows, dtype=bool)
        if list_order == "mixed":
            flip = np.random.default_rng([seed, 1]).random(rows) < 0.5
        for domain in schema.domains:
            for feat in domain.features:
                columns[feat.column] = _reverse_rows(columns[feat.column], flip)
    ordered = dict(scalars)
    for feat in schema.user_int + schema.item_int + schema.user_dense + schema.item_dense:
        ordered[feat.column] = columns[feat.column]
    for name in schema.raw["seq"]:  # domains in schema (file) order
        for feat in schema.domain(name).features:
            ordered[feat.column] = columns[feat.column]
    return pa.table(ordered)


def planted_score(batch: Any, schema: Schema) -> np.ndarray:
    """The planted logit (without bias) recomputed from a converted Batch (newest event at length-1)."""
    score = np.zeros(batch.batch_size)
    for side, weight, mod in (("user", W_USER, 3), ("item", W_ITEM, 4)):
        feat = next((f for f in schema.int_group(side) if f.dim == 1 and f.vocab_size >= 3), None)
        if feat is not None:
            v = getattr(batch, side).int_values[:, feat.offset].numpy().astype(np.int64)
            score += weight * ((v > 0) & (v % mod == 1))
    if schema.domains:
        seq = batch.sequences[schema.domains[0].name]
        lengths = seq.lengths.numpy().astype(np.int64)
        has = lengths > 0
        pos = np.maximum(lengths - 1, 0)
        rows = np.arange(len(lengths))
        gap = batch.request_timestamp.numpy() - seq.timestamps.numpy()[rows, pos]
        score += W_RECENT * (has & (gap > 0) & (gap <= RECENT_SECONDS))
        if seq.values.shape[1]:
            v = seq.values.numpy()[rows, 0, pos].astype(np.int64)
            score += W_SIDE * (has & (v > 0) & (v % 2 == 1))
    return score


# ----------------------------------------------------------------------------------------------
# amplification, writing and the cache
# ----------------------------------------------------------------------------------------------


def amplified(base: pa.Table, repeat: int) -> pa.Table:
    """Repeat `repeat` of the base table with the reference's id/time jitter (repeat 0 is the base)."""
    if repeat == 0:
        return base
    rows = base.num_rows
    out = base
    for name, shift in (
        ("user_id", repeat * rows),
        ("item_id", repeat * rows),
        ("timestamp", repeat * DAY),
        ("label_time", repeat * DAY),
    ):
        col = base.column(name)
        shifted = pc.add(col, pa.scalar(shift, col.type))
        out = out.set_column(out.schema.get_field_index(name), name, shifted)
    return out


CACHE_ENV = "PCVR_CACHE_DIR"


def default_cache_dir() -> Path:
    """$PCVR_CACHE_DIR, else .cache/pcvr of the checkout. A PCVR_CACHE_DIR that is (or lies under) a file is an
    error naming the variable: the converter's compiled kernels live there too, and a silent fallback would
    measure the slow converter."""
    env = os.environ.get(CACHE_ENV)
    if not env:
        return Path(__file__).resolve().parents[2] / ".cache" / "pcvr"
    path = Path(env)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            raise CommandError(f"{CACHE_ENV}={env}: {parent} is a file, not a folder; point {CACHE_ENV} at a "
                               "folder or unset it")
    return path


def cache_key(
    schema: Schema, rows: int, multiplier: int, seed: int, row_group_size: int, list_order: str = "newest-last"
) -> str:
    # list_order enters the key only when not the default: a default file's key is the same without it
    order = {} if list_order == "newest-last" else {"list_order": list_order}
    payload = json.dumps(
        {
            **order,
            "schema": schema.raw,
            "rows": rows,
            "multiplier": multiplier,
            "seed": seed,
            "row_group_size": row_group_size,
            "generator_version": GENERATOR_VERSION,
            "compression": PARQUET_COMPRESSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def write_parquet(base: pa.Table, path: Path, *, multiplier: int, row_group_size: int, progress: bool = True) -> None:
    """Write `multiplier` jittered repeats of `base` to `path` atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    bar = None
    if progress and multiplier > 1:
        from tqdm import tqdm

        bar = tqdm(total=multiplier * base.num_rows, unit="rows", desc=f"generate {path.name}")
    try:
        with pq.ParquetWriter(tmp, base.schema, compression=PARQUET_COMPRESSION) as writer:
            for i in range(multiplier):
                writer.write_table(amplified(base, i), row_group_size=row_group_size)
                if bar is not None:
                    bar.update(base.num_rows)
        os.chmod(tmp, 0o644)  # mkstemp files are private; the data is not
        os.replace(tmp, path)
    finally:
        if bar is not None:
            bar.close()
        tmp.unlink(missing_ok=True)


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, path)


def generate_dataset(
    schema_or_path: Schema | str | Path | Mapping[str, Any],
    *,
    rows: int = 1000,
    multiplier: int = 1,
    seed: int = 0,
    row_group_size: int = 1000,
    cache_dir: str | Path | None = None,
    force: bool = False,
    progress: bool = True,
    out: str | Path | None = None,
    list_order: str = "newest-last",
) -> Path:
    """Generate (or reuse from the cache) a parquet file of rows*multiplier rows; returns its path.

    Without `out` the file lives in `cache_dir` (default `.cache/pcvr`, env PCVR_CACHE_DIR) under a
    directory named by the content hash of the schema, the parameters and the generator version, with
    `schema.json` beside it; a cached file is reused unless `force`. With `out` the file is written there
    (schema.json beside it); an existing file is an error unless `force`.
    """
    schema = schema_or_path if isinstance(schema_or_path, Schema) else load_schema(schema_or_path)
    for name, value, low in (("rows", rows, 1), ("multiplier", multiplier, 1), ("row_group_size", row_group_size, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    total = rows * multiplier
    if out is None:
        key = cache_key(schema, rows, multiplier, seed, row_group_size, list_order)
        folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        folder = folder / f"demo_{total}_{key}"
        path = folder / f"demo_{total}.parquet"
        if path.is_file() and not force:
            return path
    else:
        path = Path(out)
        folder = path.parent
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists; pass --force (force=True) to overwrite it")
    check_memory(schema, rows, multiplier, seed, list_order)
    folder.mkdir(parents=True, exist_ok=True)
    schema_text = json.dumps(schema.raw, indent=2) + "\n"
    schema_path = folder / "schema.json"
    if out is not None and schema_path.exists() and not force and schema_path.read_text() != schema_text:
        raise FileExistsError(f"{schema_path} exists with another schema; pass --force to overwrite it")
    _write_text_atomic(schema_path, schema_text)
    import resource
    import time

    start = time.perf_counter()
    base = generate_table(schema, rows, seed, list_order)
    # the schema in the file's footer too, so that a file moved without its schema.json is still checked
    base = base.replace_schema_metadata({SCHEMA_METADATA_KEY: json.dumps(schema.raw, sort_keys=True)})
    write_parquet(base, path, multiplier=multiplier, row_group_size=row_group_size, progress=progress)
    # how the file was made, beside it (the benchmarks record it): the peak is this process's peak RSS
    info = {
        "rows": total,
        "row_groups": pq.ParquetFile(path).metadata.num_row_groups,
        "bytes": path.stat().st_size,
        "seconds": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "measured_by": "generate_dataset",
    }
    _write_text_atomic(path.with_name(GENERATION_INFO), json.dumps(info, indent=2) + "\n")
    return path


def available_memory() -> tuple[int, str] | None:
    """(bytes this process may still allocate, where the limit comes from): the smallest of the memory the
    system has available, this process's address-space limit (ulimit -v) and its cgroup's limit; None when
    none of them can be read."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        limits.append((int(info["MemAvailable"]) * 1024, "MemAvailable"))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        except (OSError, StopIteration, ValueError):
            size = 0
        limits.append((max(soft - size, 0), "the address-space limit (ulimit -v)"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            limits.append((max(int(limit) - used, 0), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1024 or unit == "TB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def check_memory(schema: Schema, rows: int, multiplier: int, seed: int, list_order: str) -> None:
    """Refuse `rows` whose base table would not fit in memory, before generating it: the need is estimated from
    a generated sample of MEMORY_SAMPLE_ROWS rows of this schema (table bytes per row x rows x
    MEMORY_PEAK_FACTOR); small tables are not estimated."""
    if rows <= 10 * MEMORY_SAMPLE_ROWS:
        return
    per_row = generate_table(schema, MEMORY_SAMPLE_ROWS, seed, list_order).nbytes / MEMORY_SAMPLE_ROWS
    found = available_memory()  # after the sample: what it left allocated is not available either
    if found is None:
        return
    available, source = found
    need = per_row * rows * MEMORY_PEAK_FACTOR
    if need <= available:
        return
    fit = max(int(available / (per_row * MEMORY_PEAK_FACTOR)), 1)
    total = rows * multiplier
    raise CommandError(
        f"--rows {rows:,}: generating needs about {_size(need)} of memory ({_size(per_row)} per row of this schema; "
        f"the base table is built in memory), more than the {_size(available)} available ({source}); use at most "
        f"--rows {fit:,} (--multiplier {-(-total // fit):,} repeats it to {total:,} rows at no memory cost)")


def generation_info(path: str | Path) -> dict | None:
    """What generate_dataset recorded about a file it wrote (None when it has no record)."""
    info = Path(path).with_name(GENERATION_INFO)
    return json.loads(info.read_text()) if info.is_file() else None


# ----------------------------------------------------------------------------------------------
# command line: pcvr generate
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schema", required=True, help="schema JSON (raw_parquet format)")
    parser.add_argument("--rows", type=int, default=1000, help="rows of the base table (default 1000)")
    parser.add_argument("--multiplier", type=int, default=1, help="repeat the base table N times with jitter")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--row-group-size", type=int, default=1000, help="parquet rows per row group (default 1000)")
    parser.add_argument("--out", help="parquet path to write (default: the content-hash cache directory)")
    parser.add_argument("--cache-dir", help="cache directory (default .cache/pcvr or $PCVR_CACHE_DIR)")
    parser.add_argument("--force", action="store_true", help="overwrite / regenerate an existing file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none is shown off a terminal)")
    parser.add_argument(
        "--list-order", choices=LIST_ORDERS, default="newest-last", help="sequence list order (default newest-last)"
    )


def run(args: argparse.Namespace) -> int:
    from pcvr_lib.errors import check_writable
    from pcvr_lib.progress import interactive

    # argument errors before any work (the schema is checked by generate_dataset before it generates)
    for option, value, low in (("--rows", args.rows, 1), ("--multiplier", args.multiplier, 1),
                               ("--row-group-size", args.row_group_size, 1), ("--seed", args.seed, 0)):
        if value < low:
            raise CommandError(f"{option} must be >= {low}, got {value}")
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise CommandError(f"--out {out} is a folder; give the parquet file's path, e.g. {out / 'data.parquet'}")
        if out.exists() and not args.force:
            raise CommandError(f"--out {out} exists; pass --force to overwrite it or choose another path")
        check_writable(out.parent, "--out")
    elif args.cache_dir:
        check_writable(Path(args.cache_dir), "--cache-dir")
    else:
        check_writable(default_cache_dir(), CACHE_ENV if os.environ.get(CACHE_ENV) else "the cache folder")
    path = generate_dataset(
        args.schema,
        rows=args.rows,
        multiplier=args.multiplier,
        seed=args.seed,
        row_group_size=args.row_group_size,
        cache_dir=args.cache_dir,
        force=args.force,
        progress=not args.no_progress and interactive(),  # no bar in logs or CI
        out=args.out,
        list_order=args.list_order,
    )
    meta = pq.ParquetFile(path).metadata
    print(f"{path}  rows={meta.num_rows} row_groups={meta.num_row_groups} bytes={path.stat().st_size}")
    return 0
