"""Train / validate / infer a PCVR model and write the run-dir artifacts (models-smoke.md section 3).

Python API: `train(TrainConfig) -> summary`, `validate(run_dir=..., ...) -> evaluation`,
`infer(checkpoint=..., ...) -> telemetry`. Commands: `pcvr train | val | infer`.

- Training: seeded (python, numpy, torch; deterministic algorithms on request), BCE with logits, the
  optimizers of `pcvr_lib.optim` (AdamW lr 1e-4 betas (0.9, 0.98) for dense parameters, sparse Adagrad
  lr 0.05 for the embedding tables), global grad-norm clipping at 1.0 over dense and sparse gradients, a
  step with a non-finite loss (or gradient norm) is skipped and counted. Optional bf16 autocast (`amp`)
  and torch.compile (with an eager fallback that is recorded). Batches come from `pcvr_lib.data.loader`
  (`steps` mode: seeded draws of batch keys on the training side of the split).
- Validation after training (and every `eval_every` steps) on the holdout side; each writes a checkpoint
  `global_step{N}.AUC={auc:.6f}/` with model.safetensors, schema.json and train_config.json (the complete
  config). `val` and `infer` rebuild the model from those three files only: no pickles anywhere.
- Sample keys: predictions are keyed by the row position in the data file (`Batch.row_index`), so rows
  sharing a user id never overwrite each other (the reference keyed predictions.json by user id).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pcvr_lib.metrics import classification_metrics, sigmoid

CHECKPOINT_RE = re.compile(r"^global_step(\d+)\.AUC=([0-9.]+|nan)$")
MODEL_FILE = "model.safetensors"
SCHEMA_FILE = "schema.json"
CONFIG_FILE = "train_config.json"
MANIFEST_FILE = "checkpoint.json"  # written last: the sha256 of every file; its presence = complete
OPTIMIZER_FILE = "optimizer.safetensors"  # optimizer + RNG tensors, for --resume
STATE_FILE = "train_state.json"  # the rest of the state for --resume (history so far, tensor layout)
SUMMARY_FILE = "training_summary.json"
TMP_PREFIX = ".tmp-"  # a checkpoint being written
# what a run writes into its run dir (removed by --overwrite, along with the checkpoint folders)
RUN_ARTIFACTS = (SUMMARY_FILE, "training_telemetry.json", "evaluation.json", "validation_predictions.jsonl",
                 "evaluation_telemetry.json", "predictions.json", "inference_telemetry.json")


class TrainError(ValueError):
    """A bad path or option for train / val / infer; the message names it."""


# ------------------------------------------------------------------------------------------ config
@dataclass
class TrainConfig:
    model: str
    data: str  # parquet file
    run_dir: str
    schema: str | None = None  # default: schema.json beside the data file
    max_lens: str | None = None  # "seq_a:64,..." (default: the schema defaults)
    model_config: dict = field(default_factory=dict)
    experiment_name: str | None = None  # default: the model name
    label: str | None = None  # default: the run dir's name
    seed: int = 42
    deterministic: bool = True
    steps: int = 20
    batch_size: int = 128
    eval_batch_size: int = 256
    eval_every: int = 0  # 0: validate once, after the last step
    dense_optimizer: str = "adamw"
    dense_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    sparse_lr: float = 0.05
    max_grad_norm: float = 1.0
    init_output_prior: bool = True  # logit bias starts at the training labels' log-odds
    eval_at_init: bool = False  # also score the holdout before the first step (shows what training added)
    split: str = "timestamp_auto"
    valid_ratio: float = 0.2
    loader_preset: str = "none"  # pcvr_lib.data.loader.PRESETS: cache policy + augmentations for training
    strict_time_filter: bool | None = None  # converter drops events at/after the request time (None: preset's)
    device: str = "cpu"
    amp: bool = False  # bf16 autocast
    compile: bool = False
    num_workers: int = 0
    log_every: int = 0  # 0: silent
    list_order: str = "auto"  # sequence list order: auto (told per row from the event times) or given

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TrainError(f"train config: unknown option(s) {unknown}")
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


# ---------------------------------------------------------------------------------------- helpers
def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.benchmark = not deterministic


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TrainError(f"--device {name!r} is not a torch device name (cpu, cuda, cuda:0, ...)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def _autocast(device: torch.device, amp: bool):
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux: clear_refs 5), so that each phase
    reports its own peak; silently a no-op where unsupported."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


class Telemetry:
    """Wall time, CPU peak RSS, CUDA peak memory and throughput of one phase."""

    def __init__(self, label: str, device: torch.device):
        self.label, self.device = label, device
        self.rows = self.batches = self.steps = 0
        self.excluded = 0.0  # seconds inside the phase that belong to another phase (training's holdout evals)

    def __enter__(self) -> Telemetry:
        _reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = _now()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall = time.perf_counter() - self._t0
        self.elapsed = self.wall - self.excluded
        self.ended = _now()

    def to_dict(self, model=None, metadata: dict | None = None) -> dict[str, Any]:
        elapsed = max(self.elapsed, 1e-9)
        cuda = self.device.type == "cuda"
        return {
            "label": self.label,
            "started_at": self.started,
            "ended_at": self.ended,
            "elapsed_sec": self.elapsed,
            "wall_sec": self.wall,
            "cpu_peak_rss_mb": _peak_rss_mb(),
            "device": str(self.device),
            "cuda_device_name": torch.cuda.get_device_name(self.device) if cuda else None,
            "cuda_peak_allocated_mb": torch.cuda.max_memory_allocated(self.device) / 2**20 if cuda else None,
            "cuda_peak_reserved_mb": torch.cuda.max_memory_reserved(self.device) / 2**20 if cuda else None,
            "rows": self.rows,
            "batches": self.batches,
            "steps": self.steps,
            "rows_per_sec": self.rows / elapsed,
            "batches_per_sec": self.batches / elapsed,
            "steps_per_sec": self.steps / elapsed,
            "model_parameters": model.parameter_counts() if model is not None else None,
            "torch_version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "metadata": metadata or {},
        }


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, allow_nan=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _finite_or_none(value):
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _load_schema(schema_path: Path, max_lens):
    from pcvr_lib.schema import SchemaError, load_schema

    if not schema_path.is_file():
        raise TrainError(f"schema file not found: {schema_path}")
    try:
        return load_schema(schema_path, max_lens=max_lens)
    except SchemaError as exc:
        text = str(exc)
        if "max_len" in text:  # the option, not the file, is at fault
            raise TrainError(f"--max-lens {max_lens}: {text.split(': ', 1)[-1]}") from exc
        raise TrainError(text if str(schema_path) in text else f"{schema_path}: {text}") from exc


def _data_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TrainError(f"data file not found: {p} (make one with: pcvr generate --schema SCHEMA.json --out {p})")
    if not p.is_file():
        raise TrainError(f"data path is not a file: {p}")
    return p


def _schema_path(data: Path, schema: str | None) -> Path:
    if schema is not None:
        return Path(schema)
    beside = data.parent / SCHEMA_FILE
    if not beside.is_file():
        raise TrainError(f"no --schema given and no {SCHEMA_FILE} beside the data file {data}")
    return beside


def _loader(cfg_data: Path, schema, config: TrainConfig, *, for_training: bool = False, list_order=None, **kw):
    """A loader with the run's converter setting; only training batches get the run's loader preset
    (cache, augmentations): evaluation and inference read each row once, unaugmented. The list order is
    the run's unless `list_order` overrides it (val/infer --list-order)."""
    from pcvr_lib.data.loader import PcvrLoader

    preset = config.loader_preset if for_training else "none"
    return PcvrLoader(cfg_data, schema, preset=preset, strict_time_filter=_strict_time_filter(config),
                      list_order=list_order or config.list_order, **kw)


def _strict_time_filter(config: TrainConfig) -> bool:
    from pcvr_lib.data.loader import PRESETS

    if config.strict_time_filter is not None:
        return bool(config.strict_time_filter)
    return PRESETS[config.loader_preset].strict_time_filter


# ------------------------------------------------------------------------------------ predictions
@torch.no_grad()
def predict_batches(model, batches, device: torch.device, amp: bool = False) -> dict[str, np.ndarray]:
    """Run the model over batches; returns row_index, user_id, timestamp, target, logit, probability."""
    model.eval()
    out: dict[str, list] = {k: [] for k in ("row_index", "user_id", "timestamp", "target", "logit")}
    count = 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with _autocast(device, amp):
            logits = model(batch)
        out["logit"].append(logits.float().squeeze(-1).cpu().numpy())
        out["row_index"].append(batch.row_index.cpu().numpy())
        out["user_id"].append(batch.user_id.cpu().numpy())
        out["timestamp"].append(batch.request_timestamp.cpu().numpy())
        out["target"].append(batch.label.cpu().numpy())
        count += 1
    result = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in out.items()}
    result["probability"] = sigmoid(result["logit"])
    result["batches"] = count
    return result


# -------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir: Path, model, schema, config: TrainConfig, step: int, auc: float,
                    optimizers=None, train_state: dict | None = None) -> Path:
    """Write `global_step{N}.AUC={auc}/` atomically: every file goes to a hidden temporary folder, then
    MANIFEST_FILE (the sha256 of each file) is written last and the folder is renamed into place. A folder
    without a manifest is incomplete and never loaded. With `optimizers` and `train_state`, the optimizer
    state, the RNG state and the run's history so far are saved too, so that `--resume` can continue."""
    import shutil

    from safetensors.torch import save_file

    folder = run_dir / f"global_step{step}.AUC={auc:.6f}"
    tmp = run_dir / f"{TMP_PREFIX}{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in _raw_model(model).state_dict().items()}
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"model": config.model, "global_step": str(step)})
        (tmp / SCHEMA_FILE).write_text(json.dumps(dict(schema.raw), indent=2) + "\n")
        full = config.to_dict()
        full["model_config"] = _raw_model(model).config.to_dict()  # every model option, defaults included
        full["global_step"] = step
        write_json(tmp / CONFIG_FILE, full)
        if optimizers is not None:
            state_tensors: dict[str, torch.Tensor] = {}
            structure = _split_tensors(optimizers.state_dict(), "optimizer", state_tensors)
            rng = {"torch": _split_tensors(torch.get_rng_state(), "rng.torch", state_tensors)}
            if torch.cuda.is_available():
                rng["cuda"] = _split_tensors(torch.cuda.get_rng_state_all(), "rng.cuda", state_tensors)
            save_file(state_tensors, str(tmp / OPTIMIZER_FILE))
            write_json(tmp / STATE_FILE, dict(train_state or {}, global_step=step, optimizer=structure, rng=rng))
        names = sorted(p.name for p in tmp.iterdir())
        write_json(tmp / MANIFEST_FILE, {"global_step": step, "auc": _finite_or_none(float(auc)),
                                         "sha256": {name: _sha256(tmp / name) for name in names}})
        if folder.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _split_tensors(obj, prefix: str, tensors: dict[str, torch.Tensor]):
    """A JSON-able copy of a (nested) state dict whose tensors are moved into `tensors` by name: optimizer
    state is saved as safetensors + JSON, no pickles. Int dict keys and tuples survive the round trip."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().contiguous().cpu()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__items__": [[k, _split_tensors(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: _join_tensors(v, tensors) for k, v in obj["__items__"]}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def _raw_model(model):
    return getattr(model, "_orig_mod", model)


def _read_manifest(folder: Path) -> dict | None:
    """The checkpoint's manifest, or None when the folder is incomplete (no manifest, unreadable)."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("sha256"), dict) else None


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(global step, folder) of the run dir's complete checkpoints, oldest first; incomplete ones (an
    interrupted save: no manifest) are skipped."""
    found = []
    for child in run_dir.iterdir() if run_dir.is_dir() else []:
        m = CHECKPOINT_RE.match(child.name)
        if m and child.is_dir() and _read_manifest(child) is not None:
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder to use: the one a run dir's training_summary.json names (its latest complete
    one when there is no summary, e.g. after an interrupted run), a checkpoint folder, or its
    model.safetensors file."""
    p = Path(path)
    if p.is_file() and p.name == MODEL_FILE:
        p = p.parent
    if not p.exists():
        raise TrainError(f"checkpoint path not found: {p}")
    if not p.is_dir():
        raise TrainError(f"checkpoint path {p} is a file: give a run dir, a checkpoint folder or its {MODEL_FILE}")
    if (p / MODEL_FILE).exists() or (p / MANIFEST_FILE).exists() or CHECKPOINT_RE.match(p.name):
        folder = p
    elif (p / SUMMARY_FILE).is_file():
        summary = _read_json_file(p / SUMMARY_FILE, "training summary")
        named = summary.get("best_checkpoint") if isinstance(summary, dict) else None
        if not isinstance(named, str) or not named:
            raise TrainError(f"{p / SUMMARY_FILE} names no best_checkpoint: retrain into a fresh --run-dir")
        folder = p / Path(named).name  # the run dir may have moved since: the name is what counts
        if not folder.is_dir():
            raise TrainError(f"{p / SUMMARY_FILE} names checkpoint {folder.name}, which is not in {p}")
    else:
        found = complete_checkpoints(p)
        if not found:
            raise TrainError(
                f"no complete checkpoint under {p}: expected global_step<N>.AUC=<auc>/ with {MODEL_FILE} and "
                f"{MANIFEST_FILE} (run `pcvr train` first)"
            )
        folder = found[-1][1]
    if _read_manifest(folder) is None:
        raise TrainError(f"checkpoint {folder} is incomplete (no readable {MANIFEST_FILE}: an interrupted save "
                         "or an older pcvr); use another checkpoint or retrain")
    return folder


def verify_checkpoint(folder: Path) -> dict:
    """Check every file against the sha256 recorded when the checkpoint was saved; returns the manifest."""
    manifest = _read_manifest(folder)
    if manifest is None:
        raise TrainError(f"checkpoint {folder} is incomplete (no readable {MANIFEST_FILE})")
    for name in (MODEL_FILE, SCHEMA_FILE, CONFIG_FILE):
        if name not in manifest["sha256"]:
            raise TrainError(f"checkpoint {folder}: {MANIFEST_FILE} lists no {name}")
    for name, expected in manifest["sha256"].items():
        file = folder / str(name)
        if not file.is_file():
            raise TrainError(f"checkpoint {folder} lacks {name}: use another checkpoint or retrain")
        if _sha256(file) != expected:
            raise TrainError(f"checkpoint file {file} is damaged: its sha256 differs from the one recorded when "
                             "it was saved; use another checkpoint or retrain")
    return manifest


def _read_json_file(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise TrainError(f"{path}: not a valid {what} JSON file ({exc})") from exc


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """Rebuild (model, schema, TrainConfig, folder) from a checkpoint's files, after checking their
    sha256 against the manifest."""
    from safetensors.torch import load_file

    from pcvr_lib.models import build_model
    from pcvr_lib.schema import SchemaError, parse_schema

    folder = find_checkpoint(path)
    verify_checkpoint(folder)
    raw_config = _read_json_file(folder / CONFIG_FILE, "train config")
    if not isinstance(raw_config, dict):
        raise TrainError(f"{folder / CONFIG_FILE}: not a JSON object")
    raw_config.pop("global_step", None)
    config = TrainConfig.from_dict(raw_config)
    try:
        schema = parse_schema(_read_json_file(folder / SCHEMA_FILE, "schema"), max_lens=config.max_lens)
    except SchemaError as exc:
        raise TrainError(f"{folder / SCHEMA_FILE}: {exc}") from exc
    model = build_model(config.model, schema, config.model_config)
    state = _load_safetensors(folder / MODEL_FILE, load_file)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TrainError(f"checkpoint {folder} does not fit model {config.model!r}: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.to(device), schema, config, folder


def _load_safetensors(path: Path, load_file) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError (not importable by a stable name)
        raise TrainError(f"{path}: not a readable safetensors file ({exc}); use another checkpoint or "
                         "retrain") from exc


# -------------------------------------------------------------------------------------------- train
def _compile(model, enabled: bool, meta: dict):
    meta["compile_requested"] = enabled
    meta["compile_active"] = False
    if not enabled:
        return model
    try:
        compiled = torch.compile(model)
        meta["compile_active"] = True
        return compiled
    except Exception as exc:  # noqa: BLE001 - compile problems fall back to eager, recorded
        meta["compile_fallback_reason"] = f"{type(exc).__name__}: {exc}"
        return model


def train(config: TrainConfig, progress=None, *, overwrite: bool = False, resume: bool = False) -> dict[str, Any]:
    """Train, validate, checkpoint and write training_summary.json + training_telemetry.json.

    Everything is checked before the first step: options, device, data, schema, and the run dir, which
    must be empty or new unless `overwrite` (the previous run's artifacts are removed first) or `resume`
    (training continues after the run dir's last complete checkpoint, with its optimizer and RNG state).
    `progress(step, steps, loss)` is called after each step when given. Ctrl-C raises
    `pcvr_lib.cli.Interrupted` saying where training stopped and which checkpoint is the last good one."""
    if config.steps < 1:
        raise TrainError(f"steps must be >= 1, got {config.steps}")
    if config.batch_size < 1 or config.eval_batch_size < 1:
        raise TrainError("batch sizes must be >= 1")
    if config.eval_every < 0 or config.log_every < 0:
        raise TrainError("--eval-every and --log-every must be >= 0")
    if overwrite and resume:
        raise TrainError("--overwrite and --resume exclude each other: replace the run or continue it")
    _check_names(config)
    device = resolve_device(config.device)
    data = _data_path(config.data)
    schema = _load_schema(_schema_path(data, config.schema), config.max_lens)
    run_dir = Path(config.run_dir)
    start = _prepare_run_dir(run_dir, config, overwrite=overwrite, resume=resume)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    seed_everything(config.seed, config.deterministic)
    try:
        with _reading(data):
            return _train(config, device, data, schema, run_dir, progress, start)
    finally:  # the deterministic switch is process-wide: give the caller its setting back
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def check_writable(folder: Path, option: str) -> None:
    from pcvr_lib.cli import check_writable as check

    check(folder, option)


def _check_names(config: TrainConfig) -> None:
    """Unknown model, optimizer or split names fail before any work, listing the valid ones."""
    from pcvr_lib.data.loader import PRESETS
    from pcvr_lib.data.split import SPLIT_METHODS
    from pcvr_lib.models import model_names
    from pcvr_lib.optim.registry import DENSE_OPTIMIZERS

    if config.model not in model_names():
        raise TrainError(f"unknown model {config.model!r}; registered: {', '.join(model_names())}")
    if config.dense_optimizer not in DENSE_OPTIMIZERS:
        raise TrainError(f"unknown --dense-optimizer {config.dense_optimizer!r}; one of {', '.join(DENSE_OPTIMIZERS)}")
    if config.split not in SPLIT_METHODS:
        raise TrainError(f"unknown --split {config.split!r}; one of {', '.join(SPLIT_METHODS)}")
    if config.loader_preset not in PRESETS:
        raise TrainError(f"unknown --loader-preset {config.loader_preset!r}; one of {', '.join(PRESETS)}")


# where a resumed run must agree with the checkpoint it continues (the rest may change: steps, device, ...)
RESUME_MUST_MATCH = ("model", "schema", "max_lens", "model_config", "seed", "deterministic", "batch_size",
                     "dense_optimizer", "dense_lr", "betas", "weight_decay", "sparse_lr", "max_grad_norm",
                     "init_output_prior", "split", "valid_ratio", "amp")


def _prepare_run_dir(run_dir: Path, config: TrainConfig, *, overwrite: bool, resume: bool) -> Path | None:
    """Refuse a non-empty run dir unless overwrite/resume; returns the checkpoint to resume from."""
    import shutil

    if run_dir.exists() and not run_dir.is_dir():
        raise TrainError(f"--run-dir {run_dir} is a file, not a directory")
    existing = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if existing and not (overwrite or resume):
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        raise TrainError(f"--run-dir {run_dir} is not empty ({shown}): pass --overwrite to replace that run, "
                         "--resume to continue it, or choose a new --run-dir")
    check_writable(run_dir, "--run-dir")
    if overwrite:
        for name in existing:
            path = run_dir / name
            if path.is_dir() and (CHECKPOINT_RE.match(name) or name.startswith(TMP_PREFIX)):
                shutil.rmtree(path)
            elif name in RUN_ARTIFACTS:
                path.unlink()
        return None
    if not resume:
        return None
    resumable = [f for _, f in complete_checkpoints(run_dir) if (f / STATE_FILE).is_file()]
    if not resumable:
        raise TrainError(f"--resume: {run_dir} holds no complete checkpoint with optimizer state to continue from "
                         "(train without --resume, or with --overwrite)")
    folder = resumable[-1]
    verify_checkpoint(folder)
    saved = _read_json_file(folder / CONFIG_FILE, "train config")
    now = config.to_dict()
    for key in RESUME_MUST_MATCH:
        theirs = saved.get(key)
        if key == "model_config":  # the saved one lists every option; the command's only overrides
            theirs = {k: v for k, v in (theirs or {}).items() if k in now[key]}
        if theirs != now[key]:
            raise TrainError(f"--resume: {folder} was trained with {key}={saved.get(key)!r}, this command asks for "
                             f"{now[key]!r}; use the same options (or --overwrite to start again)")
    step = int(_read_manifest(folder)["global_step"])
    if step >= config.steps:
        raise TrainError(f"--resume: {folder.name} is already at step {step}; ask for more --steps than that")
    return folder


@contextlib.contextmanager
def _reading(data: Path):
    """Read errors from deep inside pyarrow (a damaged page, a truncated file) name the data file."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        # an errno means the operating system (disk full, permissions: the boundary names the path); the
        # decoder's errors carry none. A message that names the file already is passed on as it is.
        if str(data) in str(exc) or (isinstance(exc, OSError) and exc.errno is not None):
            raise
        raise TrainError(f"{data}: cannot be read ({' '.join(str(exc).split())}); the file is damaged: "
                         "regenerate or re-copy it") from exc


def _train(config: TrainConfig, device, data, schema, run_dir: Path, progress, resume_from: Path | None):
    from safetensors.torch import load_file

    from pcvr_lib.cli import Interrupted
    from pcvr_lib.models import build_model
    from pcvr_lib.optim import build_optimizer_set, train_step
    from pcvr_lib.progress import StepProgress

    model = build_model(config.model, schema, config.model_config).to(device)
    meta: dict[str, Any] = {"model": config.model, "seed": config.seed, "amp": config.amp}
    optimizers = build_optimizer_set(
        model.dense_parameters(),
        model.sparse_parameters(),
        dense=config.dense_optimizer,
        dense_options={"lr": config.dense_lr, "betas": tuple(config.betas), "weight_decay": config.weight_decay},
        sparse_options={"lr": config.sparse_lr},
    )
    train_loader = _loader(
        data, schema, config, for_training=True, batch_size=config.batch_size, mode="steps", steps=config.steps,
        seed=config.seed,
        split=config.split, side="train", valid_ratio=config.valid_ratio, training=True,
        num_workers=config.num_workers,
    )
    split = train_loader.split
    history: dict[str, Any] = {"losses": [], "grad_norms": [], "skipped": 0, "clipped": 0, "checkpoints": [],
                               "init_metrics": None}
    start = 0
    if resume_from is not None:  # model, optimizer, RNG and history as they were at that checkpoint
        state = _read_json_file(resume_from / STATE_FILE, "train state")
        tensors = _load_safetensors(resume_from / OPTIMIZER_FILE, load_file)
        _raw_model(model).load_state_dict(_load_safetensors(resume_from / MODEL_FILE, load_file))
        optimizers.load_state_dict(_join_tensors(state["optimizer"], tensors))
        torch.set_rng_state(_join_tensors(state["rng"]["torch"], tensors))
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(_join_tensors(state["rng"]["cuda"], tensors))
        history.update(state["history"])
        meta["train_positive_rate"] = state.get("train_positive_rate")
        start = int(state["global_step"])
        meta["resumed_from"] = resume_from.name
        train_loader.skip(start)
    elif config.init_output_prior:
        meta["train_positive_rate"] = _positive_rate(data, split.train_mask)
        _raw_model(model).set_output_prior(meta["train_positive_rate"])
    runner = _compile(model, config.compile, meta)
    val_result = None
    telemetry = Telemetry("train", device)
    eval_seconds = 0.0
    if config.log_every:
        print(f"train: {config.model} on {data} ({int(split.train_mask.sum())} train / {int(split.valid_mask.sum())} "
              f"holdout rows), steps {start + 1}..{config.steps} of {config.batch_size} rows, run dir {run_dir}",
              file=sys.stderr, flush=True)
    bar = StepProgress(config.steps, start, f"train {config.model}", every=config.log_every)
    done = start  # the last step completed (what Ctrl-C reports)
    try:
        with telemetry:
            if config.eval_at_init and resume_from is None:
                t0 = time.perf_counter()
                m = _holdout(model, data, schema, config, split, device)["metrics"]
                history["init_metrics"] = {k: m[k] for k in ("auc", "logloss", "sample_count")}
                eval_seconds += time.perf_counter() - t0
            for step, batch in enumerate(train_loader, start=start + 1):
                model.train()
                batch = batch.to(device, non_blocking=True)
                with _autocast(device, config.amp):
                    logits = runner(batch)
                if step == start + 1 and config.compile and meta["compile_active"]:
                    meta["first_step_sec_with_compile"] = time.perf_counter() - telemetry._t0
                loss = F.binary_cross_entropy_with_logits(logits.float().squeeze(-1), batch.label.float())
                info = train_step(loss, optimizers, max_grad_norm=config.max_grad_norm, skip_nonfinite=True)
                history["skipped"] += int(info["skipped"])
                history["clipped"] += int(info["clip_coef"] < 1.0)
                history["losses"].append(_finite_or_none(info["loss"]))
                history["grad_norms"].append(_finite_or_none(info["grad_norm"]))
                telemetry.rows += batch.batch_size
                telemetry.batches += 1
                telemetry.steps += 1
                if progress is not None:
                    progress(step, config.steps, info["loss"])
                done = step
                bar.update(step, batch.batch_size, info["loss"], info["grad_norm"])
                if step == config.steps or (config.eval_every and step % config.eval_every == 0):
                    t0 = time.perf_counter()
                    val_result = _holdout(model, data, schema, config, split, device)
                    # the name goes into the history before the save, so the checkpoint lists itself
                    name = f"global_step{step}.AUC={val_result['metrics']['auc']:.6f}"
                    history["checkpoints"] = [c for c in history["checkpoints"] if c != name] + [name]
                    save_checkpoint(run_dir, model, schema, config, step, val_result["metrics"]["auc"],
                                    optimizers=optimizers,
                                    train_state={"history": history,
                                                 "train_positive_rate": meta.get("train_positive_rate")})
                    eval_seconds += time.perf_counter() - t0
            telemetry.excluded = eval_seconds  # elapsed_sec and the rates cover the training steps only
    except KeyboardInterrupt:
        good = [f.name for _, f in complete_checkpoints(run_dir)]
        last = f"last good checkpoint {run_dir / good[-1]}" if good else "no checkpoint saved yet"
        raise Interrupted(f"training stopped after step {done} of {config.steps}; {last}"
                          + ("; continue with the same command plus --resume" if good else "")) from None
    finally:
        bar.close()
    train_meta = dict(meta, skipped_steps=history["skipped"], clipped_steps=history["clipped"],
                      holdout_eval_sec=eval_seconds, loader=train_loader.stats())
    train_telemetry = telemetry.to_dict(model, train_meta)
    write_json(run_dir / "training_telemetry.json", train_telemetry)
    metrics = val_result["metrics"]
    checkpoints = [str(run_dir / name) for name in history["checkpoints"]]
    summary = {
        "run_dir": str(run_dir),
        "experiment_name": config.experiment_name or config.model,
        "label": config.label or run_dir.name,
        "model": config.model,
        "seed": config.seed,
        "data_path": str(data),
        "split": {"method": config.split, "valid_ratio": config.valid_ratio,
                  "train_rows": int(split.train_mask.sum()), "valid_rows": int(split.valid_mask.sum()),
                  "params": split.params, "flags": list(split.flags)},
        "steps": config.steps,
        "resumed_from": meta.get("resumed_from"),
        "skipped_steps": history["skipped"],
        "clipped_steps": history["clipped"],
        "losses": history["losses"],
        "grad_norms": history["grad_norms"],
        "validation_metrics": {"auc": metrics["auc"], "logloss": metrics["logloss"], "brier": metrics["brier"],
                               "auc_ci": metrics.get("auc_ci"), "sample_count": metrics["sample_count"],
                               "metric_source": "training_validation"},
        "validation_score_diagnostics": metrics["score_diagnostics"],
        "init_validation_metrics": history["init_metrics"],
        "checkpoints": checkpoints,
        "best_checkpoint": checkpoints[-1],
        "checkpoint_sha256": _read_manifest(Path(checkpoints[-1]))["sha256"],
        "train_config": config.to_dict(),
        "model_config": model.config.to_dict(),
        "telemetry": train_telemetry,
    }
    write_json(run_dir / SUMMARY_FILE, summary)
    return summary


def _positive_rate(data: Path, rows: np.ndarray) -> float:
    """Share of positive labels (the converter's label rule) among the given rows."""
    import pyarrow.parquet as pq

    from pcvr_lib.data.convert import labels_from_label_type

    label_type = pq.read_table(data, columns=["label_type"]).column("label_type").combine_chunks()
    labels = labels_from_label_type(label_type)
    return float(labels[rows].mean(dtype=np.float64)) if rows.any() else 0.5


def _holdout(model, data, schema, config: TrainConfig, split, device) -> dict:
    loader = _loader(data, schema, config, batch_size=config.eval_batch_size, mode="sweep", split=split, side="valid",
                     training=True, num_workers=0)
    preds = predict_batches(model, loader, device, config.amp)
    return {"predictions": preds, "metrics": classification_metrics(preds["target"], preds["probability"])}


# ---------------------------------------------------------------------------------------------- val
def _score(model, loader, device, amp: bool, folder: Path, data_path: Path, desc: str) -> dict[str, np.ndarray]:
    """predict_batches with a progress bar; non-finite scores are an error, never a silent gap."""
    from pcvr_lib.progress import bar

    with bar(loader.planned_batches, desc, unit="batch") as progress, _reading(data_path):
        preds = predict_batches(model, _counted(loader, progress), device, amp)
    bad = int((~np.isfinite(preds["probability"])).sum())
    if bad:
        raise TrainError(f"{bad} of {len(preds['probability'])} scores are not finite: checkpoint {folder} on "
                         f"{data_path} gives NaN/inf; nothing was written (retrain, or check the data)")
    return preds


def _counted(batches, progress):
    for batch in batches:
        yield batch
        progress.update(1)


def validate(
    run_dir: str | Path | None = None,
    *,
    checkpoint: str | Path | None = None,
    data: str | Path | None = None,
    rows: str = "valid",
    batch_size: int = 256,
    device: str = "cpu",
    amp: bool | None = None,
    list_order: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (default: the one the run dir's training summary names) on the holdout side
    (`rows="valid"`, the same split as training) or on every row (`rows="all"`); writes evaluation.json,
    validation_predictions.jsonl and evaluation_telemetry.json into the run dir."""
    if run_dir is None and checkpoint is None:
        raise TrainError("val needs --run-dir or --checkpoint")
    if rows not in ("valid", "all"):
        raise TrainError(f"--rows must be 'valid' or 'all', got {rows!r}")
    if batch_size < 1:
        raise TrainError(f"--batch-size must be >= 1, got {batch_size}")
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint or run_dir, dev)
    out_dir = Path(run_dir) if run_dir is not None else folder.parent
    data_path = _data_path(data or config.data)
    check_writable(out_dir, "--run-dir" if run_dir is not None else "the checkpoint's run dir")
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("evaluation", dev)
    with telemetry:
        if rows == "valid":
            loader = _loader(data_path, schema, config, batch_size=batch_size, mode="sweep", split=config.split,
                             side="valid", valid_ratio=config.valid_ratio, training=True, list_order=list_order)
        else:
            loader = _loader(data_path, schema, config, batch_size=batch_size, mode="sweep", training=True,
                             list_order=list_order)
        preds = _score(model, loader, dev, use_amp, folder, data_path, "val")
        metrics = classification_metrics(preds["target"], preds["probability"])
        telemetry.rows, telemetry.batches = len(preds["target"]), preds["batches"]
    eval_telemetry = telemetry.to_dict(model, {"rows_scope": rows, "checkpoint": str(folder)})
    predictions_path = out_dir / "validation_predictions.jsonl"
    _write_prediction_lines(predictions_path, preds)
    evaluation = {
        "experiment_name": config.experiment_name or config.model,
        "label": config.label or Path(config.run_dir).name,
        "model": config.model,
        "seed": config.seed,
        "checkpoint_path": str(folder / MODEL_FILE),
        "data_path": str(data_path),
        "rows_scope": rows,
        "metrics": metrics,
        "validation_predictions_path": str(predictions_path),
        "telemetry": eval_telemetry,
    }
    write_json(out_dir / "evaluation_telemetry.json", eval_telemetry)
    write_json(out_dir / "evaluation.json", evaluation)
    return evaluation


def _write_prediction_lines(path: Path, preds: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for i in range(len(preds["target"])):
            f.write(json.dumps({
                "sample_index": int(preds["row_index"][i]),
                "user_id": int(preds["user_id"][i]),
                "score": float(preds["probability"][i]),
                "target": float(preds["target"][i]),
                "timestamp": int(preds["timestamp"][i]),
            }) + "\n")
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------- infer
def infer(
    checkpoint: str | Path,
    *,
    data: str | Path | None = None,
    result_dir: str | Path | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    amp: bool | None = None,
    list_order: str | None = None,
) -> dict[str, Any]:
    """Score every row of the data (labels not read) and write predictions.json
    {"predictions": {sample_key: probability}, "user_ids": {sample_key: user_id}} and
    inference_telemetry.json into result_dir (default: the checkpoint's run dir)."""
    if batch_size < 1:
        raise TrainError(f"--batch-size must be >= 1, got {batch_size}")
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint, dev)
    out_dir = Path(result_dir) if result_dir is not None else folder.parent
    data_path = _data_path(data or config.data)
    check_writable(out_dir, "--result-dir" if result_dir is not None else "the checkpoint's run dir")
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("inference", dev)
    with telemetry:
        loader = _loader(data_path, schema, config, batch_size=batch_size, mode="sweep", training=False,
                         list_order=list_order)
        preds = _score(model, loader, dev, use_amp, folder, data_path, "infer")
        telemetry.rows, telemetry.batches = len(preds["row_index"]), preds["batches"]
    keys = [str(int(k)) for k in preds["row_index"]]
    if len(set(keys)) != len(keys):
        raise TrainError(f"{data_path}: duplicate sample keys in the inference output")
    payload = {
        "sample_key": "row_index",
        "predictions": {k: float(p) for k, p in zip(keys, preds["probability"], strict=True)},
        "user_ids": {k: int(u) for k, u in zip(keys, preds["user_id"], strict=True)},
    }
    inf_telemetry = telemetry.to_dict(model, {"checkpoint": str(folder), "data_path": str(data_path)})
    write_json(out_dir / "predictions.json", payload)
    write_json(out_dir / "inference_telemetry.json", inf_telemetry)
    return inf_telemetry


# -------------------------------------------------------------------------------------- commands
def _model_config_arg(text: str | None) -> dict:
    if not text:
        return {}
    p = Path(text)
    try:
        raw = json.loads(p.read_text()) if p.is_file() else json.loads(text)
    except json.JSONDecodeError as exc:
        raise TrainError(f"--model-config must be a JSON object or a JSON file: {exc}") from exc
    if not isinstance(raw, dict):
        raise TrainError("--model-config must be a JSON object")
    return raw


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--attention-backend, --rms-norm-backend (RMSNorm and LayerNorm), --embedding-backend: the model
    options of the same names (train and smoke)."""
    from pcvr_lib.models.common import BACKEND_OPTIONS, BACKENDS

    for option in BACKEND_OPTIONS:
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, choices=BACKENDS, help=f"model option {option} (default torch)")


def backend_overrides(args: argparse.Namespace, model_config: dict) -> dict:
    """model_config with the backend flags given on the command line; a flag that contradicts the same
    option in --model-config is an error, not a silent override."""
    from pcvr_lib.models.common import BACKEND_OPTIONS

    merged = dict(model_config)
    for option in BACKEND_OPTIONS:
        value = getattr(args, option, None)
        if value is None:
            continue
        if option in merged and merged[option] != value:
            raise TrainError(f"--{option.replace('_', '-')} {value} contradicts --model-config's "
                             f"{option}={merged[option]!r}; give it once")
        merged[option] = value
    return merged


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from pcvr_lib.data.loader import PRESETS
    from pcvr_lib.data.split import SPLIT_METHODS
    from pcvr_lib.models import model_names
    from pcvr_lib.optim.registry import DENSE_OPTIMIZERS

    d = TrainConfig(model="", data="", run_dir="")
    add = parser.add_argument
    add("--model", required=True, help=f"model name: {', '.join(model_names())}")
    add("--data", required=True, help="parquet file (make one with: pcvr generate)")
    add("--run-dir", required=True, help="where checkpoints and the training summary go; must be new or empty "
        "unless --overwrite or --resume")
    run_mode = parser.add_mutually_exclusive_group()
    run_mode.add_argument("--overwrite", action="store_true",
                          help="replace the run already in --run-dir (its checkpoints and JSON files)")
    run_mode.add_argument("--resume", action="store_true",
                          help="continue the run in --run-dir from its last complete checkpoint (same options)")
    add("--schema", help="schema JSON (default: schema.json beside the data)")
    add("--max-lens", help="sequence lengths, e.g. seq_a:64,seq_b:64 (default: schema defaults)")
    add("--model-config", help="JSON object (or file) of model options, e.g. '{\"d_model\": 64}'")
    add_backend_arguments(parser)
    add("--experiment-name", help="name the diagnostics group runs by (default: the model name)")
    add("--label", help="this run's label in reports (default: the run dir's name)")
    add("--seed", type=int, default=d.seed, help=f"seed of data order, init and dropout (default {d.seed})")
    add("--no-deterministic", action="store_true", help="allow non-deterministic (faster) torch kernels")
    add("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    add("--batch-size", type=int, default=d.batch_size, help=f"training rows per step (default {d.batch_size})")
    add("--eval-batch-size", type=int, default=d.eval_batch_size,
        help=f"rows per batch when scoring the holdout (default {d.eval_batch_size})")
    add("--eval-every", type=int, default=0,
        help="also validate and checkpoint every N steps (default 0: only after the last step)")
    add("--dense-optimizer", default=d.dense_optimizer,
        help=f"optimizer of the dense parameters: {', '.join(DENSE_OPTIMIZERS)} (default {d.dense_optimizer})")
    add("--dense-lr", type=float, default=d.dense_lr, help=f"dense learning rate (default {d.dense_lr})")
    add("--sparse-lr", type=float, default=d.sparse_lr,
        help=f"sparse Adagrad learning rate of the embedding tables (default {d.sparse_lr})")
    add("--max-grad-norm", type=float, default=d.max_grad_norm,
        help=f"clip the global gradient norm to this (default {d.max_grad_norm})")
    add("--eval-at-init", action="store_true", help="also score the holdout before step 1")
    add("--no-output-prior", action="store_true",
        help="leave the logit bias at its random init (default: the train labels' log-odds)")
    add("--split", default=d.split, help=f"train/holdout split: {', '.join(SPLIT_METHODS)} (default {d.split})")
    add("--valid-ratio", type=float, default=d.valid_ratio, help=f"holdout share of rows (default {d.valid_ratio})")
    add("--loader-preset", default=d.loader_preset,
        help=f"data loader preset for training batches, as in the data benchmarks: {', '.join(PRESETS)} "
             f"(default {d.loader_preset})")
    strict = parser.add_mutually_exclusive_group()
    strict.add_argument("--strict-time-filter", dest="strict_time_filter", action="store_true", default=None,
                        help="converter drops sequence events at or after the request time (default: the preset's; "
                             "on for the augment presets)")
    strict.add_argument("--no-strict-time-filter", dest="strict_time_filter", action="store_false",
                        help="converter keeps every event")
    add("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default cpu)")
    add("--amp", action="store_true", help="bf16 autocast")
    add("--compile", action="store_true", help="torch.compile (eager fallback, recorded)")
    add("--num-workers", type=int, default=0, help="data loader worker processes (default 0: in-process)")
    add("--log-every", type=int, default=5,
        help="without a terminal (logs, CI): a progress line every N steps, 0 for none (default 5)")
    _add_list_order(parser, "auto")


def _add_list_order(parser: argparse.ArgumentParser, default: str | None) -> None:
    from pcvr_lib.data.convert import LIST_ORDERS

    parser.add_argument(
        "--list-order", choices=LIST_ORDERS, default=default,
        help="sequence list order: auto tells it per row from the event times; newest-first / newest-last for "
        "data without usable times (default: " + (default or "the order the model was trained with") + ")",
    )


def run_train(args: argparse.Namespace) -> int:
    config = TrainConfig(
        model=args.model, data=args.data, run_dir=args.run_dir, schema=args.schema, max_lens=args.max_lens,
        model_config=backend_overrides(args, _model_config_arg(args.model_config)),
        experiment_name=args.experiment_name,
        label=args.label, seed=args.seed, deterministic=not args.no_deterministic, steps=args.steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, eval_every=args.eval_every,
        dense_optimizer=args.dense_optimizer, dense_lr=args.dense_lr, sparse_lr=args.sparse_lr,
        max_grad_norm=args.max_grad_norm, init_output_prior=not args.no_output_prior, eval_at_init=args.eval_at_init,
        split=args.split, valid_ratio=args.valid_ratio, loader_preset=args.loader_preset,
        strict_time_filter=args.strict_time_filter, device=args.device,
        amp=args.amp, compile=args.compile, num_workers=args.num_workers, log_every=args.log_every,
        list_order=args.list_order,
    )
    summary = train(config, overwrite=args.overwrite, resume=args.resume)
    m = summary["validation_metrics"]
    print(f"{summary['run_dir']}: holdout AUC {m['auc']:.4f} logloss {m['logloss']:.4f} "
          f"({m['sample_count']} rows), {summary['skipped_steps']} skipped step(s), "
          f"train {summary['telemetry']['elapsed_sec']:.1f}s; checkpoint {summary['best_checkpoint']}")
    return 0


def add_val_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="run directory: the checkpoint its training summary names; artifacts "
                        "written here")
    parser.add_argument("--checkpoint", help="checkpoint folder or model.safetensors (default: the run dir's)")
    parser.add_argument("--data", help="parquet file (default: the one the model was trained on)")
    parser.add_argument("--rows", choices=["valid", "all"], default="valid",
                        help="holdout side of the training split (default) or every row")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    _add_list_order(parser, None)


def run_val(args: argparse.Namespace) -> int:
    ev = validate(args.run_dir, checkpoint=args.checkpoint, data=args.data, rows=args.rows,
                  batch_size=args.batch_size, device=args.device, list_order=args.list_order)
    m = ev["metrics"]
    print(f"{ev['experiment_name']}: AUC {m['auc']:.4f} logloss {m['logloss']:.4f} brier {m['brier']:.4f} "
          f"on {m['sample_count']} rows -> {ev['validation_predictions_path']}")
    return 0


def add_infer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="run dir (the checkpoint its training summary names), checkpoint folder or "
                        "model.safetensors")
    parser.add_argument("--data", help="parquet file (default: the one the model was trained on)")
    parser.add_argument("--result-dir", help="where predictions.json goes (default: the checkpoint's run dir)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    _add_list_order(parser, None)


def run_infer(args: argparse.Namespace) -> int:
    t = infer(args.checkpoint, data=args.data, result_dir=args.result_dir, batch_size=args.batch_size,
              device=args.device, list_order=args.list_order)
    print(f"scored {t['rows']} rows in {t['elapsed_sec']:.2f}s ({t['rows_per_sec']:.0f} rows/s)")
    return 0
