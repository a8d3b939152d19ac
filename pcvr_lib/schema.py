"""The PCVR feature schema: load, validate and compile it into a column layout.

The schema JSON (format "raw_parquet") lists the int, dense and sequence features of the parquet data.
Every rule of the reference's loader is checked here, each failure naming the group and fid at fault.
The compiled layout gives, per group, each feature's offset and width in the converted batch, the
per-position vocabulary, and per sequence domain its side features (all but the timestamp) and max_len.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_FORMAT = "raw_parquet"
TOP_LEVEL_KEYS = {"format", "user_int", "item_int", "user_dense", "item_dense", "seq"}
REQUIRED_TOP_LEVEL_KEYS = {"format", "user_int", "item_int", "user_dense", "seq"}
DOMAIN_KEYS = {"prefix", "ts_fid", "features"}
INT_GROUPS = ("user_int", "item_int")
DENSE_GROUPS = ("user_dense", "item_dense")
DEFAULT_MAX_LENS = {"seq_a": 256, "seq_b": 256, "seq_c": 512, "seq_d": 512}
DEFAULT_MAX_LEN = 256
# Scalar columns of the parquet files besides the features.
SCALAR_COLUMNS = {
    "user_id": "int64",
    "item_id": "int64",
    "label_type": "int32",
    "label_time": "int64",
    "timestamp": "int64",
}
# The scalars the converter reads.
CONVERTER_SCALARS = ("timestamp", "label_type", "user_id")
# The largest vocab_size of an id feature: a converted batch holds ids as int32. A timestamp feature's
# vocab_size is not read (its values are times, int64), so the limit does not apply to it.
MAX_VOCAB = 2**31 - 1


class SchemaError(ValueError):
    """A schema JSON breaks a rule; the message names the group and fid at fault."""


@dataclass(frozen=True)
class IntFeature:
    fid: int
    vocab_size: int  # exclusive upper bound; 0 zeroes the column
    dim: int
    offset: int  # first position in the group's [B, width] block
    column: str


@dataclass(frozen=True)
class DenseFeature:
    fid: int
    dim: int
    offset: int
    column: str


@dataclass(frozen=True)
class SeqFeature:
    fid: int
    vocab_size: int
    column: str


@dataclass(frozen=True)
class Domain:
    name: str
    prefix: str
    ts_fid: int
    features: tuple[SeqFeature, ...]  # in schema order, the timestamp feature included
    max_len: int

    @property
    def side_features(self) -> tuple[SeqFeature, ...]:
        """The features that go into `values [B, F_side, L]`: all but the timestamp, in schema order."""
        return tuple(f for f in self.features if f.fid != self.ts_fid)

    @property
    def ts_feature(self) -> SeqFeature:
        return next(f for f in self.features if f.fid == self.ts_fid)

    @property
    def side_vocab(self) -> np.ndarray:
        return np.array([f.vocab_size for f in self.side_features], dtype=np.int64)


@dataclass(frozen=True)
class Schema:
    user_int: tuple[IntFeature, ...]
    item_int: tuple[IntFeature, ...]
    user_dense: tuple[DenseFeature, ...]
    item_dense: tuple[DenseFeature, ...]
    domains: tuple[Domain, ...]  # sorted by name
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    def int_group(self, side: str) -> tuple[IntFeature, ...]:
        return {"user": self.user_int, "item": self.item_int}[side]

    def dense_group(self, side: str) -> tuple[DenseFeature, ...]:
        return {"user": self.user_dense, "item": self.item_dense}[side]

    def int_width(self, side: str) -> int:
        return sum(f.dim for f in self.int_group(side))

    def dense_width(self, side: str) -> int:
        return sum(f.dim for f in self.dense_group(side))

    def int_vocab(self, side: str) -> np.ndarray:
        """Per-position vocabulary of the side's int block (length int_width(side))."""
        group = self.int_group(side)
        if not group:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.full(f.dim, f.vocab_size, dtype=np.int64) for f in group])

    def domain(self, name: str) -> Domain:
        for d in self.domains:
            if d.name == name:
                return d
        raise KeyError(f"schema has no sequence domain {name!r}; domains: {[d.name for d in self.domains]}")

    @property
    def feature_columns(self) -> list[str]:
        """Every feature column the converter reads, in layout order."""
        cols = [f.column for f in self.user_int + self.item_int + self.user_dense + self.item_dense]
        for d in self.domains:
            cols.extend(f.column for f in d.features)
        return cols

    @property
    def converter_columns(self) -> list[str]:
        return list(CONVERTER_SCALARS) + self.feature_columns

    def with_max_lens(self, max_lens: Mapping[str, int] | str | None) -> Schema:
        lens = parse_max_lens(max_lens)
        if max_lens is not None:
            _check_max_len_names(lens, [d.name for d in self.domains])
        domains = tuple(
            Domain(d.name, d.prefix, d.ts_fid, d.features, lens.get(d.name, DEFAULT_MAX_LEN)) for d in self.domains
        )
        return Schema(self.user_int, self.item_int, self.user_dense, self.item_dense, domains, self.raw)

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=False)


def parse_max_lens(spec: Mapping[str, int] | str | None) -> dict[str, int]:
    """`"seq_a:256,seq_b:128"` or a mapping -> {domain: max_len}; None gives the reference defaults."""
    if spec is None:
        return dict(DEFAULT_MAX_LENS)
    if isinstance(spec, str):
        out: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition(":")
            if not sep or not name.strip() or not value.strip().isdigit():
                raise SchemaError(f"max_len spec {part!r}: expected DOMAIN:LENGTH, e.g. seq_a:256")
            out[name.strip()] = int(value)
        spec = out
    lens = dict(spec)
    for name, value in lens.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SchemaError(f"max_len of domain {name!r} must be an integer >= 1, got {value!r}")
    return lens


def _check_max_len_names(lens: Mapping[str, int], domains: list[str]) -> None:
    """A max_len for a domain the schema does not have is a typo, never something to ignore."""
    unknown = sorted(set(lens) - set(domains))
    if unknown:
        raise SchemaError(f"max_lens names unknown sequence domain(s) {unknown}; this schema's domains: "
                          f"{', '.join(sorted(domains)) or '(none)'}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


_FIELD_MIN = {"vocab_size": 0, "dim": 1}  # smallest allowed value of each non-fid field


def _entry(where: str, index: int, entry: Any, names: tuple[str, ...]) -> tuple[int, ...]:
    """One feature entry, given as a list in `names` order or a dict of those keys (names[0] is "fid")."""
    if isinstance(entry, Mapping):
        _check_keys(f"{where}[{index}]", entry, set(names), set(names))
        values = tuple(entry[name] for name in names)
    elif isinstance(entry, list | tuple) and len(entry) == len(names):
        values = tuple(entry)
    else:
        raise SchemaError(f"{where}[{index}]: expected [{', '.join(names)}] or a dict of those, got {entry!r}")
    fid = values[0]
    _check_fid(where, index, fid)
    for name, value in zip(names[1:], values[1:], strict=True):
        low = _FIELD_MIN[name]
        if not _is_int(value) or value < low:
            raise SchemaError(f"{where} fid {fid}: {name} must be an integer >= {low}, got {value!r}")
    return tuple(int(v) for v in values)


def _check_fid(group: str, index: int, fid: Any) -> None:
    if not _is_int(fid) or fid < 0:
        raise SchemaError(f"{group}[{index}]: fid must be an integer >= 0, got {fid!r}")


def _check_vocab_limit(where: str, fid: int, vocab: int) -> None:
    if vocab > MAX_VOCAB:
        raise SchemaError(f"{where} fid {fid}: vocab_size {vocab} is over {MAX_VOCAB:,} (2**31 - 1, the int32 ids of "
                          "a converted batch); use a smaller vocab_size (hash the ids into it)")


def _check_keys(where: str, obj: Mapping, allowed: set[str], required: set[str]) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(obj)
    if missing:
        raise SchemaError(f"{where}: missing key(s) {sorted(missing)}")


def _check_unique(group: str, fids: list[int]) -> None:
    seen: set[int] = set()
    for fid in fids:
        if fid in seen:
            raise SchemaError(f"{group}: duplicate fid {fid}")
        seen.add(fid)


def _as_list(group: str, value: Any) -> list:
    if not isinstance(value, list | tuple):
        raise SchemaError(f"{group}: expected a list of feature entries, got {type(value).__name__}")
    return list(value)


def parse_schema(raw: Mapping[str, Any], max_lens: Mapping[str, int] | str | None = None) -> Schema:
    """Validate a schema dict and compile its layout; raises SchemaError naming what is wrong."""
    if not isinstance(raw, Mapping):
        raise SchemaError(f"schema must be a JSON object, got {type(raw).__name__}")
    _check_keys("schema", raw, TOP_LEVEL_KEYS, REQUIRED_TOP_LEVEL_KEYS)
    if raw["format"] != SCHEMA_FORMAT:
        raise SchemaError(f"schema format must be {SCHEMA_FORMAT!r}, got {raw['format']!r}")

    int_groups: dict[str, tuple[IntFeature, ...]] = {}
    for group in INT_GROUPS:
        entries = [_entry(group, i, e, ("fid", "vocab_size", "dim")) for i, e in enumerate(_as_list(group, raw[group]))]
        if not entries:
            raise SchemaError(f"{group}: must list at least one feature")
        _check_unique(group, [fid for fid, _, _ in entries])
        for fid, vocab, _ in entries:
            _check_vocab_limit(group, fid, vocab)
        offsets = np.cumsum([0] + [dim for _, _, dim in entries])
        int_groups[group] = tuple(
            IntFeature(fid, vocab, dim, int(off), f"{group}_feats_{fid}")
            for (fid, vocab, dim), off in zip(entries, offsets, strict=False)
        )

    dense_groups: dict[str, tuple[DenseFeature, ...]] = {}
    for group in DENSE_GROUPS:
        entries = [_entry(group, i, e, ("fid", "dim")) for i, e in enumerate(_as_list(group, raw.get(group, [])))]
        _check_unique(group, [fid for fid, _ in entries])
        offsets = np.cumsum([0] + [dim for _, dim in entries])
        dense_groups[group] = tuple(
            DenseFeature(fid, dim, int(off), f"{group}_feats_{fid}")
            for (fid, dim), off in zip(entries, offsets, strict=False)
        )

    seq = raw["seq"]
    if not isinstance(seq, Mapping):
        raise SchemaError(f"seq: expected an object mapping domain names to domains, got {type(seq).__name__}")
    lens = parse_max_lens(max_lens)
    domains = []
    prefixes: dict[str, str] = {}
    for name, spec in seq.items():
        if not isinstance(name, str) or not name.strip():
            raise SchemaError(f"seq: domain names must be non-empty strings, got {name!r}")
        where = f"seq.{name}"
        if not isinstance(spec, Mapping):
            raise SchemaError(f"{where}: expected an object with {sorted(DOMAIN_KEYS)}, got {type(spec).__name__}")
        _check_keys(where, spec, DOMAIN_KEYS, DOMAIN_KEYS)
        prefix = spec["prefix"]
        if not isinstance(prefix, str) or not prefix.strip():
            raise SchemaError(f"{where}: prefix must be a non-empty string, got {prefix!r}")
        if prefix in prefixes:
            raise SchemaError(f"{where}: prefix {prefix!r} is already used by domain {prefixes[prefix]!r}")
        prefixes[prefix] = name
        feats = [
            _entry(f"{where}.features", i, e, ("fid", "vocab_size"))
            for i, e in enumerate(_as_list(where, spec["features"]))
        ]
        if not feats:
            raise SchemaError(f"{where}: must list at least one feature")
        _check_unique(f"{where}.features", [fid for fid, _ in feats])
        ts_fid = spec["ts_fid"]
        if not _is_int(ts_fid) or int(ts_fid) not in {fid for fid, _ in feats}:
            raise SchemaError(f"{where}: ts_fid {ts_fid!r} is not one of the domain's feature fids")
        for fid, vocab in feats:
            if fid != ts_fid:
                _check_vocab_limit(f"{where}.features", fid, vocab)
        domains.append(
            Domain(
                name=name,
                prefix=prefix,
                ts_fid=int(ts_fid),
                features=tuple(SeqFeature(fid, vocab, f"{prefix}_{fid}") for fid, vocab in feats),
                max_len=lens.get(name, DEFAULT_MAX_LEN),
            )
        )
    domains.sort(key=lambda d: d.name)
    if max_lens is not None:
        _check_max_len_names(lens, [d.name for d in domains])
    return Schema(
        user_int=int_groups["user_int"],
        item_int=int_groups["item_int"],
        user_dense=dense_groups["user_dense"],
        item_dense=dense_groups["item_dense"],
        domains=tuple(domains),
        raw=dict(raw),
    )


def load_schema(source: str | Path | Mapping[str, Any], max_lens: Mapping[str, int] | str | None = None) -> Schema:
    """Load a schema from a JSON file path or an already-parsed dict."""
    if isinstance(source, Mapping):
        return parse_schema(source, max_lens)
    path = Path(source)
    if path.is_dir():
        inside = path / "schema.json"
        hint = f"; did you mean {inside}?" if inside.is_file() else ""
        raise SchemaError(f"schema path {path} is a folder, not a schema JSON file{hint}")
    if not path.is_file():
        raise SchemaError(f"schema file not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path}: not valid JSON ({exc})") from exc
    try:
        return parse_schema(raw, max_lens)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}") from exc


def schema_differences(a: Schema, b: Schema, limit: int = 4) -> list[str]:
    """How schema `b` differs from schema `a`, one short phrase per difference (at most `limit`, then a count of
    the rest); empty when they describe the same columns with the same vocabularies, dims and domains.
    Sequence lengths (max_len) are run options, not part of the data, and are not compared."""
    out: list[str] = []

    def features(where, mine, theirs, fields):
        if [f.fid for f in mine] != [f.fid for f in theirs] and {f.fid for f in mine} == {f.fid for f in theirs}:
            out.append(f"{where} lists its features in another order (another layout)")
        mine, theirs = {f.fid: f for f in mine}, {f.fid: f for f in theirs}
        for fid in sorted(mine.keys() - theirs.keys()):
            out.append(f"{where} fid {fid} only in the first")
        for fid in sorted(theirs.keys() - mine.keys()):
            out.append(f"{where} fid {fid} only in the second")
        for fid in sorted(mine.keys() & theirs.keys()):
            for name in fields:
                x, y = getattr(mine[fid], name), getattr(theirs[fid], name)
                if x != y:
                    out.append(f"{where} fid {fid} {name} {x} vs {y}")

    for group in INT_GROUPS:
        features(group, getattr(a, group), getattr(b, group), ("vocab_size", "dim"))
    for group in DENSE_GROUPS:
        features(group, getattr(a, group), getattr(b, group), ("dim",))
    mine, theirs = {d.name: d for d in a.domains}, {d.name: d for d in b.domains}
    for name in sorted(mine.keys() ^ theirs.keys()):
        out.append(f"domain {name} only in the {'first' if name in mine else 'second'}")
    for name in sorted(mine.keys() & theirs.keys()):
        x, y = mine[name], theirs[name]
        for attr in ("prefix", "ts_fid"):
            if getattr(x, attr) != getattr(y, attr):
                out.append(f"seq.{name} {attr} {getattr(x, attr)} vs {getattr(y, attr)}")
        features(f"seq.{name}", x.side_features, y.side_features, ("vocab_size",))
    if len(out) > limit:
        out = out[:limit] + [f"{len(out) - limit} more"]
    return out
