"""A loader's options and its access plan over one parquet file: the presets, the option checks, the batch
keys of the chosen split side and the order they are read in (see pcvr_lib.data.loader)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pcvr_lib.data.augment import BENCHMARK_AUGMENTATIONS, Augmenter
from pcvr_lib.data.batch import Batch
from pcvr_lib.data.cache import CACHE_POLICIES
from pcvr_lib.data.convert import check_order_options
from pcvr_lib.data.parquet import DataError, open_dataset
from pcvr_lib.data.shared_cache import CachePlan
from pcvr_lib.data.split import SIDES, SPLIT_METHODS, SplitPlan, plan_split
from pcvr_lib.schema import Schema, load_schema


@dataclass(frozen=True)
class Preset:
    cache_policy: str
    augmentations: tuple
    strict_time_filter: bool


PRESETS: dict[str, Preset] = {
    "none": Preset("none", (), False),
    "cache": Preset("lru", (), False),
    "opt": Preset("opt", (), False),
    "augment": Preset("lru", BENCHMARK_AUGMENTATIONS, True),
    "opt-augment": Preset("opt", BENCHMARK_AUGMENTATIONS, True),
}
MODES = ("sweep", "steps")

BatchKey = tuple[str, int, int]  # (file, row_group, batch_index)


class LoaderError(ValueError):
    """A loader option is invalid (the message names the option and the allowed values), or the converter
    rejected a batch of the file (the message names the file, the row group and the rows served before it;
    the converter's DataError is the cause)."""


class CorruptRowGroupError(DataError):
    """A row group of the file cannot be decoded (a corrupt page); names the file and the row group."""


def file_list_order(counts: dict[str, int]) -> str:
    """A file's order from its rows per class: "newest-first" / "newest-last" when every monotonic row
    that tells agrees, "mixed" when both occur, "unknown" when none tells, "given" when not checked.
    Not-monotonic rows are counted apart (list_order_rows), they do not make a file mixed."""
    if counts.get("given"):
        return "given"
    first, last = counts["newest_first"], counts["newest_last"]
    if first and last:
        return "mixed"
    return "newest-first" if first else ("newest-last" if last else "unknown")


def _check_int(name: str, value, low: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise LoaderError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class LoaderPlan:
    """The options of a `PcvrLoader` (checked here, so a bad one fails before the first batch), the file's
    row-group layout and the deterministic access plan: what every worker process gets."""

    def __init__(
        self,
        path: str | Path,
        schema: Schema | str | Path | dict,
        *,
        preset: str = "none",
        batch_size: int = 256,
        mode: str = "sweep",
        passes: int = 1,
        steps: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        split: str | SplitPlan | None = None,
        side: str = "all",
        valid_ratio: float = 0.2,
        train_ratio: float = 1.0,
        split_salt: int = 0,
        cache_policy: str | None = None,
        cache_capacity: int = 512,
        augmentations: Sequence | None = None,
        strict_time_filter: bool | None = None,
        strict_on_eval: bool = False,
        list_order: str = "auto",
        non_monotonic: str = "sort",
        training: bool = True,
        num_workers: int = 0,
        read_ahead: int = 2,
        pin_memory: bool | None = None,
        torch_threads: int | None = 1,
    ):
        if preset not in PRESETS:
            raise LoaderError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
        if mode not in MODES:
            raise LoaderError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if side not in SIDES:
            raise LoaderError(f"side must be one of {', '.join(SIDES)}, got {side!r}")
        if cache_policy is not None and cache_policy not in CACHE_POLICIES:
            raise LoaderError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {cache_policy!r}")
        if split is not None and not isinstance(split, SplitPlan) and split not in SPLIT_METHODS:
            raise LoaderError(f"split must be None, a SplitPlan or one of {', '.join(SPLIT_METHODS)}, got {split!r}")
        try:  # the converter's rules, checked here so a bad option fails before the first batch
            check_order_options(list_order, non_monotonic)
        except ValueError as exc:
            raise LoaderError(str(exc)) from exc
        self.list_order = list_order
        self.non_monotonic = non_monotonic
        if split is None and side != "all":
            raise LoaderError(f"side={side!r} needs a split (one of {', '.join(SPLIT_METHODS)})")
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.passes = _check_int("passes", passes, 1)
        if mode == "steps":
            if steps is None:
                raise LoaderError("mode='steps' needs steps (an integer >= 1)")
            self.steps = _check_int("steps", steps, 1)
        else:
            self.steps = None
        self.cache_capacity = _check_int("cache_capacity", cache_capacity, 1)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.read_ahead = _check_int("read_ahead", read_ahead, 0)
        self.seed = _check_int("seed", seed, 0)
        self.torch_threads = None if torch_threads is None else _check_int("torch_threads", torch_threads, 1)

        self.schema = schema if isinstance(schema, Schema) else load_schema(schema)
        self.path = Path(path)
        parquet = open_dataset(self.path, self.schema)  # clear errors for missing/truncated/empty/bad columns
        self.file_key = str(self.path.resolve())
        self.columns = self.schema.converter_columns
        self.preset = preset
        self.mode = mode
        self.shuffle = bool(shuffle)
        self.side = side
        self.training = bool(training)
        chosen = PRESETS[preset]
        self.cache_policy = cache_policy if cache_policy is not None else chosen.cache_policy
        self.augmentations = tuple(augmentations) if augmentations is not None else chosen.augmentations
        # Augmentations are for training batches only: never for inference or the validation side.
        self.augment_active = bool(self.augmentations) and self.training and side != "valid"
        strict = chosen.strict_time_filter if strict_time_filter is None else strict_time_filter
        # strict filtering belongs to training batches (data.md); evaluation only when asked by name
        self.strict_time_filter_requested = bool(strict)
        self.strict_on_eval = bool(strict_on_eval)
        training_batches = self.training and side != "valid"
        self.strict_time_filter = bool(strict) and (training_batches or self.strict_on_eval)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        Augmenter(self.augmentations)  # validates the configs now rather than in a worker

        meta = parquet.metadata
        self.row_group_rows = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
        self.row_group_offsets = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        if isinstance(split, SplitPlan):
            if split.num_rows != int(meta.num_rows):
                raise LoaderError(f"split plan covers {split.num_rows} rows, the file has {meta.num_rows}")
            self.split = split
        elif split is not None:
            self.split = plan_split(parquet, split, valid_ratio=valid_ratio, train_ratio=train_ratio, salt=split_salt)
        else:
            self.split = None
        self._mask = self.split.mask(side) if self.split is not None else None
        self._keys, self._key_rows, self.spans = self._eligible_keys()
        self.batches_per_group = max(key[2] for key in self._keys) + 1 if self._keys else 1
        if not self._keys:
            raise LoaderError(f"no rows on the {side!r} side of {self.path}")
        self._plan: list[tuple[int, int, BatchKey]] | None = None
        self._stats: dict = {}  # the last complete iteration's pipeline stats, per worker

    # -- planning ----------------------------------------------------------------------------------
    def batch_start(self, key: BatchKey) -> int:
        return self.spans[key][0]

    def _eligible_keys(self) -> tuple[list[BatchKey], np.ndarray, dict[BatchKey, tuple[int, int]]]:
        """Batch keys, their row counts, and the span [start, stop) of file rows each one is cut from."""
        keys, rows, spans = [], [], {}
        for group, n in enumerate(self.row_group_rows.tolist()):
            base = int(self.row_group_offsets[group])
            side_rows = np.arange(n) if self._mask is None else np.flatnonzero(self._mask[base : base + n])
            for b, first in enumerate(range(0, len(side_rows), self.batch_size)):
                chunk = side_rows[first : first + self.batch_size]
                key = (self.file_key, group, b)
                keys.append(key)
                rows.append(len(chunk))
                spans[key] = (base + int(chunk[0]), base + int(chunk[-1]) + 1)
        return keys, np.array(rows, dtype=np.int64), spans

    def plan_items(self) -> list[tuple[int, int, BatchKey]]:
        """The whole access plan: (pass, position in pass, key), deterministic by seed."""
        if self._plan is not None:
            return self._plan
        plan: list[tuple[int, int, BatchKey]] = []
        if self.mode == "steps":
            rng = np.random.default_rng(self.seed)
            draws = rng.choice(len(self._keys), size=self.steps, p=self._key_rows / self._key_rows.sum())
            plan = [(0, i, self._keys[k]) for i, k in enumerate(draws.tolist())]
        else:
            groups = sorted({key[1] for key in self._keys})
            by_group: dict[int, list[BatchKey]] = {}
            for key in self._keys:
                by_group.setdefault(key[1], []).append(key)
            for p in range(self.passes):
                order = groups
                if self.shuffle:
                    order = [groups[i] for i in np.random.default_rng([self.seed, p]).permutation(len(groups))]
                keys = [key for g in order for key in by_group[g]]
                plan.extend((p, i, key) for i, key in enumerate(keys))
        self._plan = plan
        return plan

    def skip(self, count: int) -> None:
        """Drop the first `count` items of the plan: a resumed training run continues where it stopped."""
        self._plan = self.plan_items()[_check_int("count", count, 0):]

    def keeps_all_rows(self, key: BatchKey) -> bool:
        """True when every row the batch is converted from is on the loader's split side."""
        if self._mask is None:
            return True
        start, stop = self.spans[key]
        return bool(self._mask[start:stop].all())

    def filter_rows(self, batch: Batch, key: BatchKey) -> Batch:
        """Keep the rows of the loader's split side (a no-op without a split or for a batch fully inside)."""
        if self.keeps_all_rows(key):
            return batch
        start, stop = self.spans[key]
        return batch.select(torch.from_numpy(np.flatnonzero(self._mask[start:stop])))

    def pass_traces(self, items) -> dict[int, list[BatchKey]]:
        """For each pass, the keys of that pass and every later one (OPT's future at the pass start)."""
        traces: dict[int, list[BatchKey]] = {}
        starts: dict[int, int] = {}
        for i, (p, _, _) in enumerate(items):
            starts.setdefault(p, i)
        keys = [key for _, _, key in items]
        for p, start in starts.items():
            traces[p] = keys[start:]
        return traces

    def shared_cache_plan(self) -> CachePlan:
        """The decisions of the cache the workers share: the policy replayed on the whole plan."""
        items = self.plan_items()
        return CachePlan.replay(
            self.cache_policy, self.cache_capacity, self.seed, [key for _, _, key in items],
            self.pass_traces(items), [p for p, _, _ in items],
        )

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def planned_batches(self) -> int:
        return len(self.plan_items())

    @property
    def batch_rows(self) -> np.ndarray:
        """Rows of each batch of the side (batch_size, but fewer in each row group's last batch)."""
        return self._key_rows

    @property
    def planned_rows(self) -> int:
        """Rows the plan yields before augmentation (views multiply them afterwards)."""
        rows = dict(zip(self._keys, self._key_rows.tolist(), strict=True))
        return sum(rows[key] for _, _, key in self.plan_items())

