"""Score a checkpoint: `validate` (metrics on the holdout or every row: evaluation.json,
validation_predictions.jsonl) and `infer` (every row, labels unread: predictions.json).

Predictions are keyed by the row position in the data file (`Batch.row_index`), so rows sharing a user id
never overwrite each other (the reference keyed predictions.json by user id).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pcvr_lib.errors import check_writable, warn
from pcvr_lib.metrics import classification_metrics, sigmoid, undefined_auc_reason
from pcvr_lib.progress import bar
from pcvr_lib.train.checkpoint import MODEL_FILE, SCHEMA_FILE, check_output_run_dir, load_checkpoint, write_json
from pcvr_lib.train.config import TrainError, autocast, resolve_device, torch_threads
from pcvr_lib.train.inputs import check_data, make_loader, reading, trained_data_path
from pcvr_lib.train.telemetry import Telemetry


@torch.no_grad()
def predict_batches(model, batches, device: torch.device, amp: bool = False) -> dict[str, np.ndarray]:
    """Run the model over batches; returns row_index, user_id, timestamp, target, logit, probability."""
    model.eval()
    out: dict[str, list] = {k: [] for k in ("row_index", "user_id", "timestamp", "target", "logit")}
    count = 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with autocast(device, amp):
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


def _score(model, loader, device, amp: bool, folder: Path, data: Path, desc: str) -> dict[str, np.ndarray]:
    """predict_batches with a progress bar; non-finite scores are an error, never a silent gap."""
    with bar(loader.planned_batches, desc, unit="batch") as progress, reading(data):
        preds = predict_batches(model, _counted(loader, progress), device, amp)
    bad = int((~np.isfinite(preds["probability"])).sum())
    if bad:
        raise TrainError(f"{bad} of {len(preds['probability'])} scores are not finite: checkpoint {folder} on "
                         f"{data} gives NaN/inf; nothing was written (retrain, or check the data)")
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
    threads: int | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (default: the one the run dir's training summary names) on the holdout side
    (`rows="valid"`, the same split as training) or on every row (`rows="all"`); writes evaluation.json,
    validation_predictions.jsonl and evaluation_telemetry.json into the run dir. `threads`: torch threads
    while scoring (default: those the run was trained with, when it set them)."""
    if run_dir is None and checkpoint is None:
        raise TrainError("val needs --run-dir or --checkpoint")
    if rows not in ("valid", "all"):
        raise TrainError(f"--rows must be 'valid' or 'all', got {rows!r}")
    if batch_size < 1:
        raise TrainError(f"--batch-size must be >= 1, got {batch_size}")
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint or run_dir, dev)
    out_dir = Path(run_dir) if run_dir is not None else folder.parent
    if run_dir is not None and checkpoint is not None:
        check_output_run_dir(out_dir, folder, "--checkpoint", "--run-dir")
    path = trained_data_path(data, config, folder)
    check_writable(out_dir, "--run-dir" if run_dir is not None else "the checkpoint's run dir")
    data_warnings = _check_scored_data(path, schema, folder, labels=True)
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("evaluation", dev)
    with telemetry, torch_threads(threads if threads is not None else config.threads):
        if rows == "valid":
            loader = make_loader(path, schema, config, batch_size=batch_size, mode="sweep", split=config.split,
                                 side="valid", valid_ratio=config.valid_ratio, training=True, list_order=list_order)
        else:
            loader = make_loader(path, schema, config, batch_size=batch_size, mode="sweep", training=True,
                                 list_order=list_order)
        preds = _score(model, loader, dev, use_amp, folder, path, "val")
        metrics = classification_metrics(preds["target"], preds["probability"])
        telemetry.rows, telemetry.batches = len(preds["target"]), preds["batches"]
    undefined = undefined_auc_reason(metrics)
    if undefined:
        data_warnings.append(f"{path}: {undefined}")
        warn(data_warnings[-1])
    eval_telemetry = telemetry.to_dict(model, {"rows_scope": rows, "checkpoint": str(folder)})
    predictions_path = out_dir / "validation_predictions.jsonl"
    _write_prediction_lines(predictions_path, preds)
    evaluation = {
        "experiment_name": config.experiment_name or config.model,
        "label": config.label or Path(config.run_dir).name,
        "model": config.model,
        "seed": config.seed,
        "checkpoint_path": str(folder / MODEL_FILE),
        "data_path": str(path),
        "rows_scope": rows,
        "metrics": metrics,
        "data_warnings": data_warnings,
        "validation_predictions_path": str(predictions_path),
        "telemetry": eval_telemetry,
    }
    write_json(out_dir / "evaluation_telemetry.json", eval_telemetry)
    write_json(out_dir / "evaluation.json", evaluation)
    return evaluation


def _check_scored_data(path: Path, schema, folder: Path, labels: bool) -> list[str]:
    """check_data for data scored by a checkpoint (its schema must be the checkpoint's); the warnings printed."""
    warnings = check_data(path, schema, labels=labels, dense=False,
                          what=f"the checkpoint's schema ({folder / SCHEMA_FILE})",
                          fix="score data of the schema the model was trained on")
    for text in warnings:
        warn(text)
    return warnings


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


def infer(
    checkpoint: str | Path,
    *,
    data: str | Path | None = None,
    result_dir: str | Path | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    amp: bool | None = None,
    list_order: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Score every row of the data (labels not read) and write predictions.json
    {"predictions": {sample_key: probability}, "user_ids": {sample_key: user_id}} and
    inference_telemetry.json into result_dir (default: the checkpoint's run dir). `threads` as in
    `validate`."""
    if batch_size < 1:
        raise TrainError(f"--batch-size must be >= 1, got {batch_size}")
    dev = resolve_device(device)
    model, schema, config, folder = load_checkpoint(checkpoint, dev)
    out_dir = Path(result_dir) if result_dir is not None else folder.parent
    path = trained_data_path(data, config, folder)
    check_writable(out_dir, "--result-dir" if result_dir is not None else "the checkpoint's run dir")
    data_warnings = _check_scored_data(path, schema, folder, labels=False)
    use_amp = config.amp if amp is None else amp
    telemetry = Telemetry("inference", dev)
    with telemetry, torch_threads(threads if threads is not None else config.threads):
        loader = make_loader(path, schema, config, batch_size=batch_size, mode="sweep", training=False,
                             list_order=list_order)
        preds = _score(model, loader, dev, use_amp, folder, path, "infer")
        telemetry.rows, telemetry.batches = len(preds["row_index"]), preds["batches"]
    keys = [str(int(k)) for k in preds["row_index"]]
    if len(set(keys)) != len(keys):
        raise TrainError(f"{path}: duplicate sample keys in the inference output")
    payload = {
        "sample_key": "row_index",
        "predictions": {k: float(p) for k, p in zip(keys, preds["probability"], strict=True)},
        "user_ids": {k: int(u) for k, u in zip(keys, preds["user_id"], strict=True)},
    }
    inf_telemetry = telemetry.to_dict(model, {"checkpoint": str(folder), "data_path": str(path),
                                              "data_warnings": data_warnings})
    write_json(out_dir / "predictions.json", payload)
    write_json(out_dir / "inference_telemetry.json", inf_telemetry)
    return inf_telemetry
