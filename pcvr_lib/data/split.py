"""Train/validation splits over the rows of one parquet file.

Every split gives a `SplitPlan`: boolean row masks over the file's rows (row position = the sample key the
converter writes into `Batch.row_index`) plus the row-group layout, so the loader can skip row groups with
no row on its side and filter the rows of the batches it reads.

Methods (see data.md section 3):

- `timestamp_auto`: the newest rows are valid. target = clamp(round(N * valid_ratio), 1, N - 1);
  valid_start = sorted(ts)[N - target]; valid = ts >= valid_start (ties go to valid, so 1000 rows at 0.2
  with one tie at the boundary give 201 valid rows); train = ts < valid_start.
- `row_group_tail`: the last max(1, int(G * valid_ratio)) row groups are valid. A single-row-group file is
  used for both sides and flagged `single_row_group` (train and valid overlap).
- `user_hash` / `sample_hash`: a splitmix64 mix of (key ^ salt) mod 1,000,003; valid when the score is
  below round(valid_ratio * 1,000,003). User keys are user ids (strings hashed with blake2b first), sample
  keys are row positions. A user therefore always lands on one side.

`train_ratio` < 1 limits the training side:
- timestamp_auto keeps the newest round(n_train * train_ratio) train rows (by timestamp, then row
  position), i.e. the training rows closest to the validation period;
- row_group_tail keeps the last max(1, int(G_train * train_ratio)) training groups; the dropped training
  groups are in neither side (the reference puts them on the validation side);
- the hash splits keep the rows whose score lies in the first round(train_ratio * rest) of the scores
  above the validation threshold, so the choice is stable per key like the split itself.
Rows on neither side are counted in `dropped_rows`. An empty side is an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

HASH_MODULUS = 1_000_003
SPLIT_METHODS = ("timestamp_auto", "row_group_tail", "user_hash", "sample_hash")
SIDES = ("train", "valid", "all")


class SplitError(ValueError):
    """A split cannot be made (bad option or an empty side)."""


@dataclass(frozen=True)
class SplitPlan:
    method: str
    train_mask: np.ndarray  # bool [N]
    valid_mask: np.ndarray  # bool [N]
    row_group_rows: np.ndarray  # int64 [G], rows per row group
    flags: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.train_mask.shape[0])

    @property
    def row_group_offsets(self) -> np.ndarray:
        """int64 [G + 1]: first row of each row group, then N."""
        return np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)

    def mask(self, side: str) -> np.ndarray:
        if side == "train":
            return self.train_mask
        if side == "valid":
            return self.valid_mask
        if side == "all":
            return np.ones(self.num_rows, dtype=bool)
        raise SplitError(f"split side must be one of {SIDES}, got {side!r}")

    def rows(self, side: str) -> np.ndarray:
        """Row positions of a side, ascending."""
        return np.flatnonzero(self.mask(side))

    def row_groups(self, side: str) -> np.ndarray:
        """Row groups that hold at least one row of the side (the loader reads only these)."""
        return np.flatnonzero(self.row_group_counts(side))

    def row_group_counts(self, side: str) -> np.ndarray:
        """int64 [G]: rows of the side in each row group."""
        cumulative = np.concatenate([[0], np.cumsum(self.mask(side), dtype=np.int64)])
        offsets = self.row_group_offsets
        return cumulative[offsets[1:]] - cumulative[offsets[:-1]]

    @property
    def dropped_rows(self) -> int:
        return int((~(self.train_mask | self.valid_mask)).sum())

    def summary(self) -> dict:
        return {
            "method": self.method,
            "rows": self.num_rows,
            "train_rows": int(self.train_mask.sum()),
            "valid_rows": int(self.valid_mask.sum()),
            "dropped_rows": self.dropped_rows,
            "flags": list(self.flags),
            **self.params,
        }


def _check_ratios(valid_ratio: float, train_ratio: float) -> None:
    if not (isinstance(valid_ratio, int | float) and 0.0 < float(valid_ratio) < 1.0):
        raise SplitError(f"valid_ratio must be in (0, 1), got {valid_ratio!r}")
    if not (isinstance(train_ratio, int | float) and 0.0 < float(train_ratio) <= 1.0):
        raise SplitError(f"train_ratio must be in (0, 1], got {train_ratio!r}")


def _check_nonempty(method: str, train: np.ndarray, valid: np.ndarray, hint: str = "") -> None:
    for side, mask in (("train", train), ("valid", valid)):
        if not mask.any():
            raise SplitError(f"{method} split: the {side} side is empty ({train.size} rows){hint}")


def _row_group_rows(row_group_rows: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    if row_group_rows is None:
        return np.array([n], dtype=np.int64)
    rg = np.asarray(row_group_rows, dtype=np.int64)
    if rg.ndim != 1 or (rg < 0).any() or int(rg.sum()) != n:
        raise SplitError(f"row_group_rows must be non-negative counts summing to the {n} rows, got {rg.tolist()}")
    return rg


def timestamp_auto(
    timestamps: np.ndarray,
    *,
    valid_ratio: float = 0.2,
    train_ratio: float = 1.0,
    row_group_rows: Sequence[int] | None = None,
) -> SplitPlan:
    _check_ratios(valid_ratio, train_ratio)
    ts = np.asarray(timestamps)
    if ts.ndim != 1 or not np.issubdtype(ts.dtype, np.integer):
        raise SplitError(f"timestamp_auto needs a 1-D integer timestamp array, got {ts.dtype} {ts.shape}")
    n = ts.size
    if n < 2:
        raise SplitError(f"timestamp_auto split needs at least 2 rows, got {n}")
    target = min(max(round(n * valid_ratio), 1), n - 1)
    valid_start = np.partition(ts, n - target)[n - target]
    valid = ts >= valid_start
    train = ts < valid_start
    if train_ratio < 1.0 and train.any():
        train_rows = np.flatnonzero(train)
        keep = max(1, round(train_rows.size * train_ratio))
        # newest training rows first: by timestamp, then by row position (stable, deterministic)
        order = np.lexsort((train_rows, ts[train_rows]))
        train = np.zeros(n, dtype=bool)
        train[train_rows[order[-keep:]]] = True
    _check_nonempty("timestamp_auto", train, valid, " (every timestamp is >= the validation start)")
    return SplitPlan(
        "timestamp_auto",
        train,
        valid,
        _row_group_rows(row_group_rows, n),
        params={"valid_ratio": valid_ratio, "train_ratio": train_ratio, "valid_start": int(valid_start)},
    )


def row_group_tail(row_group_rows: Sequence[int], *, valid_ratio: float = 0.2, train_ratio: float = 1.0) -> SplitPlan:
    _check_ratios(valid_ratio, train_ratio)
    rg = np.asarray(row_group_rows, dtype=np.int64)
    if rg.ndim != 1 or rg.size == 0 or (rg < 0).any():
        raise SplitError(f"row_group_tail needs a non-empty list of row-group sizes, got {list(rg)}")
    n = int(rg.sum())
    groups = rg.size
    group_of_row = np.repeat(np.arange(groups), rg)
    flags: tuple[str, ...] = ()
    if groups == 1:
        # One row group cannot be split by groups: use it for both sides and say so.
        train = np.ones(n, dtype=bool)
        valid = np.ones(n, dtype=bool)
        flags = ("single_row_group",)
    else:
        n_valid = max(1, int(groups * valid_ratio))
        n_valid = min(n_valid, groups - 1)
        first_valid = groups - n_valid
        n_train = max(1, int(first_valid * train_ratio)) if train_ratio < 1.0 else first_valid
        valid = group_of_row >= first_valid
        train = (group_of_row < first_valid) & (group_of_row >= first_valid - n_train)
    _check_nonempty("row_group_tail", train, valid, " (empty row groups)")
    return SplitPlan(
        "row_group_tail", train, valid, rg, flags, {"valid_ratio": valid_ratio, "train_ratio": train_ratio}
    )


def splitmix64(keys: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over uint64 keys (wrapping arithmetic), vectorised."""
    z = np.asarray(keys).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def string_keys(values: Sequence[str | bytes | None]) -> np.ndarray:
    """uint64 keys of string ids: the first 8 bytes (little endian) of blake2b; None hashes as ''."""
    out = np.empty(len(values), dtype=np.uint64)
    for i, v in enumerate(values):  # strings have no vectorised hash; only used for string user ids
        data = v.encode() if isinstance(v, str) else (v or b"")
        out[i] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return out


def hash_scores(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """Scores in [0, 1,000,003) of integer keys (int64 ids reinterpreted as uint64) xor salt."""
    k = np.asarray(keys)
    if k.dtype.kind == "i":
        k = k.astype(np.int64).view(np.uint64)
    elif k.dtype.kind != "u":
        raise SplitError(f"hash keys must be integers, got dtype {k.dtype}")
    k = k.astype(np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
    return (splitmix64(k) % np.uint64(HASH_MODULUS)).astype(np.int64)


def _hash_split(
    method: str, scores: np.ndarray, valid_ratio: float, train_ratio: float, rg: np.ndarray, params: dict
) -> SplitPlan:
    threshold = round(valid_ratio * HASH_MODULUS)
    valid = scores < threshold
    if train_ratio < 1.0:
        train = (scores >= threshold) & (scores < threshold + round(train_ratio * (HASH_MODULUS - threshold)))
    else:
        train = ~valid
    _check_nonempty(method, train, valid, " (too few keys for this valid_ratio; try another salt or ratio)")
    return SplitPlan(method, train, valid, rg, (), {"valid_ratio": valid_ratio, "train_ratio": train_ratio, **params})


def user_hash(
    user_ids: np.ndarray | Sequence,
    *,
    valid_ratio: float = 0.2,
    train_ratio: float = 1.0,
    salt: int = 0,
    row_group_rows: Sequence[int] | None = None,
) -> SplitPlan:
    """Hash split by user: integer ids are mixed directly, strings via blake2b. Null ids must be filled first."""
    _check_ratios(valid_ratio, train_ratio)
    ids = np.asarray(user_ids) if not isinstance(user_ids, np.ndarray) else user_ids
    if ids.dtype.kind in "iu":
        keys = ids
    elif ids.dtype.kind in "OUS":
        if ids.dtype.kind == "O" and any(v is not None and not isinstance(v, str | bytes) for v in ids):
            raise SplitError("user_hash: object user ids must be strings or bytes")
        keys = string_keys(list(ids))
    else:
        raise SplitError(f"user_hash: user ids must be integers or strings, got dtype {ids.dtype}")
    scores = hash_scores(keys, salt)
    return _hash_split(
        "user_hash", scores, valid_ratio, train_ratio, _row_group_rows(row_group_rows, scores.size), {"salt": salt}
    )


def sample_hash(
    num_rows: int,
    *,
    valid_ratio: float = 0.2,
    train_ratio: float = 1.0,
    salt: int = 0,
    row_group_rows: Sequence[int] | None = None,
) -> SplitPlan:
    """Hash split by row position (the sample key)."""
    _check_ratios(valid_ratio, train_ratio)
    if num_rows < 1:
        raise SplitError(f"sample_hash split needs at least 1 row, got {num_rows}")
    scores = hash_scores(np.arange(num_rows, dtype=np.int64), salt)
    return _hash_split(
        "sample_hash", scores, valid_ratio, train_ratio, _row_group_rows(row_group_rows, num_rows), {"salt": salt}
    )


def plan_split(
    parquet_file,
    method: str,
    *,
    valid_ratio: float = 0.2,
    train_ratio: float = 1.0,
    salt: int = 0,
) -> SplitPlan:
    """Make a split of an open `pyarrow.parquet.ParquetFile`, reading only the column the method needs."""
    if method not in SPLIT_METHODS:
        raise SplitError(f"unknown split method {method!r}; allowed: {', '.join(SPLIT_METHODS)}")
    meta = parquet_file.metadata
    rg = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
    n = int(rg.sum())
    if method == "row_group_tail":
        return row_group_tail(rg, valid_ratio=valid_ratio, train_ratio=train_ratio)
    if method == "sample_hash":
        return sample_hash(n, valid_ratio=valid_ratio, train_ratio=train_ratio, salt=salt, row_group_rows=rg)
    column = "timestamp" if method == "timestamp_auto" else "user_id"
    if column not in parquet_file.schema_arrow.names:
        raise SplitError(f"{method} split needs the column {column!r}, which the parquet file lacks")
    array = parquet_file.read(columns=[column]).column(column)
    if array.null_count:
        raise SplitError(f"{method} split: column {column!r} has {array.null_count} null values")
    values = array.to_numpy()
    if method == "timestamp_auto":
        return timestamp_auto(values, valid_ratio=valid_ratio, train_ratio=train_ratio, row_group_rows=rg)
    return user_hash(values, valid_ratio=valid_ratio, train_ratio=train_ratio, salt=salt, row_group_rows=rg)
