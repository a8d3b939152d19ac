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
        raise TrainError(f"{schema_path}: {exc}") from exc


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


def _loader(cfg_data: Path, schema, **kw):
    from pcvr_lib.data.loader import PcvrLoader

    return PcvrLoader(cfg_data, schema, preset="none", **kw)


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
def save_checkpoint(run_dir: Path, model, schema, config: TrainConfig, step: int, auc: float) -> Path:
    from safetensors.torch import save_file

    folder = run_dir / f"global_step{step}.AUC={auc:.6f}"
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in _raw_model(model).state_dict().items()}
    save_file(tensors, str(folder / MODEL_FILE), metadata={"model": config.model, "global_step": str(step)})
    (folder / SCHEMA_FILE).write_text(json.dumps(dict(schema.raw), indent=2) + "\n")
    full = config.to_dict()
    full["model_config"] = _raw_model(model).config.to_dict()  # every model option, defaults included
    full["global_step"] = step
    write_json(folder / CONFIG_FILE, full)
    return folder


def _raw_model(model):
    return getattr(model, "_orig_mod", model)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run dir (the latest global step), a checkpoint folder, or its
    model.safetensors file."""
    p = Path(path)
    if p.is_file() and p.name == MODEL_FILE:
        p = p.parent
    if not p.exists():
        raise TrainError(f"checkpoint path not found: {p}")
    if (p / MODEL_FILE).is_file():
        folder = p
    else:
        found = []
        for child in p.iterdir() if p.is_dir() else []:
            m = CHECKPOINT_RE.match(child.name)
            if m and (child / MODEL_FILE).is_file():
                found.append((int(m.group(1)), child))
        if not found:
            raise TrainError(
                f"no checkpoint under {p}: expected global_step<N>.AUC=<auc>/{MODEL_FILE} "
                "(run `pcvr train` first)"
            )
        folder = max(found)[1]
    for name in (SCHEMA_FILE, CONFIG_FILE):
        if not (folder / name).is_file():
            raise TrainError(f"checkpoint {folder} lacks {name}: it cannot be rebuilt without it")
    return folder


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """Rebuild (model, schema, TrainConfig, folder) from a checkpoint's three files."""
    from safetensors.torch import load_file

    from pcvr_lib.models import build_model
    from pcvr_lib.schema import parse_schema

    folder = find_checkpoint(path)
    raw_config = json.loads((folder / CONFIG_FILE).read_text())
    raw_config.pop("global_step", None)
    config = TrainConfig.from_dict(raw_config)
    schema = parse_schema(json.loads((folder / SCHEMA_FILE).read_text()), max_lens=config.max_lens)
    model = build_model(config.model, schema, config.model_config)
    state = load_file(str(folder / MODEL_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TrainError(f"checkpoint {folder} does not fit model {config.model!r}: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.to(device), schema, config, folder


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


def train(config: TrainConfig, progress=None) -> dict[str, Any]:
    """Train, validate, checkpoint and write training_summary.json + training_telemetry.json.

    `progress(step, steps, loss)` is called after each step when given."""
    if config.steps < 1:
        raise TrainError(f"steps must be >= 1, got {config.steps}")
    if config.batch_size < 1 or config.eval_batch_size < 1:
        raise TrainError("batch sizes must be >= 1")
    device = resolve_device(config.device)
    data = _data_path(config.data)
    schema = _load_schema(_schema_path(data, config.schema), config.max_lens)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    seed_everything(config.seed, config.deterministic)
    try:
        return _train(config, device, data, schema, run_dir, progress)
    finally:  # the deterministic switch is process-wide: give the caller its setting back
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _train(config: TrainConfig, device, data, schema, run_dir: Path, progress) -> dict[str, Any]:
    from pcvr_lib.models import build_model
    from pcvr_lib.optim import build_optimizer_set, train_step

    model = build_model(config.model, schema, config.model_config).to(device)
    meta: dict[str, Any] = {"model": config.model, "seed": config.seed, "amp": config.amp}
    runner = _compile(model, config.compile, meta)
    optimizers = build_optimizer_set(
        model.dense_parameters(),
        model.sparse_parameters(),
        dense=config.dense_optimizer,
        dense_options={"lr": config.dense_lr, "betas": tuple(config.betas), "weight_decay": config.weight_decay},
        sparse_options={"lr": config.sparse_lr},
    )
    train_loader = _loader(
        data, schema, batch_size=config.batch_size, mode="steps", steps=config.steps, seed=config.seed,
        split=config.split, side="train", valid_ratio=config.valid_ratio, training=True,
        num_workers=config.num_workers, list_order=config.list_order,
    )
    split = train_loader.split
    if config.init_output_prior:
        meta["train_positive_rate"] = _positive_rate(data, split.train_mask)
        _raw_model(model).set_output_prior(meta["train_positive_rate"])
    losses, skipped, clipped, grad_norms = [], 0, 0, []
    checkpoints = []
    val_result = None
    telemetry = Telemetry("train", device)
    eval_seconds = 0.0
    init_metrics = None
    with telemetry:
        if config.eval_at_init:
            t0 = time.perf_counter()
            m = _holdout(model, data, schema, config, split, device)["metrics"]
            init_metrics = {"auc": m["auc"], "logloss": m["logloss"], "sample_count": m["sample_count"]}
            eval_seconds += time.perf_counter() - t0
        for step, batch in enumerate(train_loader, start=1):
            model.train()
            batch = batch.to(device, non_blocking=True)
            with _autocast(device, config.amp):
                logits = runner(batch)
            if step == 1 and config.compile and meta["compile_active"]:
                meta["first_step_sec_with_compile"] = time.perf_counter() - telemetry._t0
            loss = F.binary_cross_entropy_with_logits(logits.float().squeeze(-1), batch.label.float())
            info = train_step(loss, optimizers, max_grad_norm=config.max_grad_norm, skip_nonfinite=True)
            skipped += int(info["skipped"])
            clipped += int(info["clip_coef"] < 1.0)
            losses.append(_finite_or_none(info["loss"]))
            grad_norms.append(_finite_or_none(info["grad_norm"]))
            telemetry.rows += batch.batch_size
            telemetry.batches += 1
            telemetry.steps += 1
            if progress is not None:
                progress(step, config.steps, info["loss"])
            if config.log_every and step % config.log_every == 0:
                print(f"step {step}/{config.steps} loss {info['loss']:.4f} grad_norm {info['grad_norm']:.3f}",
                      file=sys.stderr)
            if step == config.steps or (config.eval_every and step % config.eval_every == 0):
                t0 = time.perf_counter()
                val_result = _holdout(model, data, schema, config, split, device)
                folder = save_checkpoint(run_dir, model, schema, config, step, val_result["metrics"]["auc"])
                checkpoints.append(str(folder))
                eval_seconds += time.perf_counter() - t0
        telemetry.excluded = eval_seconds  # elapsed_sec and the rates cover the training steps only
    train_meta = dict(meta, skipped_steps=skipped, clipped_steps=clipped, holdout_eval_sec=eval_seconds,
                      loader=train_loader.stats())
    train_telemetry = telemetry.to_dict(model, train_meta)
    write_json(run_dir / "training_telemetry.json", train_telemetry)
    metrics = val_result["metrics"]
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
        "skipped_steps": skipped,
        "clipped_steps": clipped,
        "losses": losses,
        "grad_norms": grad_norms,
        "validation_metrics": {"auc": metrics["auc"], "logloss": metrics["logloss"], "brier": metrics["brier"],
                               "auc_ci": metrics.get("auc_ci"), "sample_count": metrics["sample_count"],
                               "metric_source": "training_validation"},
        "validation_score_diagnostics": metrics["score_diagnostics"],
        "init_validation_metrics": init_metrics,
        "checkpoints": checkpoints,
        "best_checkpoint": checkpoints[-1],
        "train_config": config.to_dict(),
        "model_config": model.config.to_dict(),
        "telemetry": train_telemetry,
    }
    write_json(run_dir / "training_summary.json", summary)
    return summary


def _positive_rate(data: Path, rows: np.ndarray) -> float:
    """Share of positive labels (the converter's label rule) among the given rows."""
    import pyarrow.parquet as pq

    from pcvr_lib.data.convert import labels_from_label_type

    label_type = pq.read_table(data, columns=["label_type"]).column("label_type").combine_chunks()
    labels = labels_from_label_type(label_type)
    return float(labels[rows].mean(dtype=np.float64)) if rows.any() else 0.5


def _holdout(model, data, schema, config: TrainConfig, split, device) -> dict:
    loader = _loader(data, schema, batch_size=config.eval_batch_size, mode="sweep", split=split, side="valid",
                     training=True, num_workers=0, list_order=config.list_order)
    preds = predict_batches(model, loader, device, config.amp)
    return {"predictions": preds, "metrics": classification_metrics(preds["target"], preds["probability"])}


# ---------------------------------------------------------------------------------------------- val
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
    """Evaluate a checkpoint (default: the run dir's latest) on the holdout side (`rows="valid"`, the
    same split as training) or on every row (`rows="all"`); writes evaluation.json,
    validation_predictions.jsonl and evaluation_telemetry.json into the run dir."""
    if run_dir is None and checkpoint is None:
        raise TrainError("val needs --run-dir or --checkpoint")
    if rows not in ("valid", "all"):
        raise TrainError(f"--rows must be 'valid' or 'all', got {rows!r}")
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint or run_dir, dev)
    out_dir = Path(run_dir) if run_dir is not None else folder.parent
    data_path = _data_path(data or config.data)
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("evaluation", dev)
    with telemetry:
        order = list_order or config.list_order  # default: the order the model was trained with
        if rows == "valid":
            loader = _loader(data_path, schema, batch_size=batch_size, mode="sweep", split=config.split,
                             side="valid", valid_ratio=config.valid_ratio, training=True, list_order=order)
        else:
            loader = _loader(data_path, schema, batch_size=batch_size, mode="sweep", training=True, list_order=order)
        preds = predict_batches(model, loader, dev, use_amp)
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
                "score": _finite_or_none(float(preds["probability"][i])),
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
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint, dev)
    out_dir = Path(result_dir) if result_dir is not None else folder.parent
    data_path = _data_path(data or config.data)
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("inference", dev)
    with telemetry:
        loader = _loader(data_path, schema, batch_size=batch_size, mode="sweep", training=False,
                         list_order=list_order or config.list_order)
        preds = predict_batches(model, loader, dev, use_amp)
        telemetry.rows, telemetry.batches = len(preds["row_index"]), preds["batches"]
    keys = [str(int(k)) for k in preds["row_index"]]
    if len(set(keys)) != len(keys):
        raise TrainError(f"{data_path}: duplicate sample keys in the inference output")
    payload = {
        "sample_key": "row_index",
        "predictions": {k: _finite_or_none(float(p)) for k, p in zip(keys, preds["probability"], strict=True)},
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


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig(model="", data="", run_dir="")
    parser.add_argument("--model", required=True, help="registered model name (baseline, tokenformer, onetrans, ...)")
    parser.add_argument("--data", required=True, help="parquet file")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--schema", help="schema JSON (default: schema.json beside the data)")
    parser.add_argument("--max-lens", help="sequence lengths, e.g. seq_a:64,seq_b:64 (default: schema defaults)")
    parser.add_argument("--model-config", help="JSON object (or file) of model options, e.g. '{\"d_model\": 64}'")
    parser.add_argument("--experiment-name")
    parser.add_argument("--label")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-deterministic", action="store_true")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--dense-optimizer", default=d.dense_optimizer)
    parser.add_argument("--dense-lr", type=float, default=d.dense_lr)
    parser.add_argument("--sparse-lr", type=float, default=d.sparse_lr)
    parser.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    parser.add_argument("--eval-at-init", action="store_true", help="also score the holdout before step 1")
    parser.add_argument("--no-output-prior", action="store_true",
                        help="leave the logit bias at its random init (default: the train labels' log-odds)")
    parser.add_argument("--split", default=d.split)
    parser.add_argument("--valid-ratio", type=float, default=d.valid_ratio)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile (eager fallback, recorded)")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
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
        model_config=_model_config_arg(args.model_config), experiment_name=args.experiment_name,
        label=args.label, seed=args.seed, deterministic=not args.no_deterministic, steps=args.steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, eval_every=args.eval_every,
        dense_optimizer=args.dense_optimizer, dense_lr=args.dense_lr, sparse_lr=args.sparse_lr,
        max_grad_norm=args.max_grad_norm, init_output_prior=not args.no_output_prior, eval_at_init=args.eval_at_init,
        split=args.split,
        valid_ratio=args.valid_ratio, device=args.device,
        amp=args.amp, compile=args.compile, num_workers=args.num_workers, log_every=args.log_every,
        list_order=args.list_order,
    )
    return _guarded(lambda: _print_train(train(config)))


def _print_train(summary: dict) -> None:
    m = summary["validation_metrics"]
    print(f"{summary['run_dir']}: holdout AUC {m['auc']:.4f} logloss {m['logloss']:.4f} "
          f"({m['sample_count']} rows), {summary['skipped_steps']} skipped step(s), "
          f"train {summary['telemetry']['elapsed_sec']:.1f}s; checkpoint {summary['best_checkpoint']}")


def add_val_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="run directory (its latest checkpoint; artifacts written here)")
    parser.add_argument("--checkpoint", help="checkpoint folder or model.safetensors (default: latest in --run-dir)")
    parser.add_argument("--data", help="parquet file (default: the one the model was trained on)")
    parser.add_argument("--rows", choices=["valid", "all"], default="valid",
                        help="holdout side of the training split (default) or every row")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    _add_list_order(parser, None)


def run_val(args: argparse.Namespace) -> int:
    def go():
        ev = validate(args.run_dir, checkpoint=args.checkpoint, data=args.data, rows=args.rows,
                      batch_size=args.batch_size, device=args.device, list_order=args.list_order)
        m = ev["metrics"]
        print(f"{ev['experiment_name']}: AUC {m['auc']:.4f} logloss {m['logloss']:.4f} brier {m['brier']:.4f} "
              f"on {m['sample_count']} rows -> {ev['validation_predictions_path']}")

    return _guarded(go)


def add_infer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="run dir, checkpoint folder or model.safetensors")
    parser.add_argument("--data", help="parquet file (default: the one the model was trained on)")
    parser.add_argument("--result-dir", help="where predictions.json goes (default: the checkpoint's run dir)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    _add_list_order(parser, None)


def run_infer(args: argparse.Namespace) -> int:
    def go():
        t = infer(args.checkpoint, data=args.data, result_dir=args.result_dir, batch_size=args.batch_size,
                  device=args.device, list_order=args.list_order)
        print(f"scored {t['rows']} rows in {t['elapsed_sec']:.2f}s ({t['rows_per_sec']:.0f} rows/s)")

    return _guarded(go)


def _guarded(fn) -> int:
    """Run a command body; expected errors become one clear line and exit code 2. TrainError, DataError,
    SplitError, OptimizerError and the model config / registry errors are all ValueErrors."""
    try:
        fn()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
