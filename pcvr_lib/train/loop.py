"""`train(TrainConfig) -> summary`: seeded training with holdout validation and checkpoints, writing
training_summary.json and training_telemetry.json into the run dir.

- Seeded (python, numpy, torch; deterministic algorithms on request), BCE with logits, the optimizers of
  `pcvr_lib.optim` (AdamW lr 1e-4 betas (0.9, 0.98) for dense parameters, sparse Adagrad lr 0.05 for the
  embedding tables), global grad-norm clipping at 1.0 over dense and sparse gradients; a step with a
  non-finite loss (or gradient norm) is skipped and counted. Optional bf16 autocast (`amp`) and
  a mode (`compile`): auto (the default: captured on a CUDA device where the step can be captured, else
  eager), eager, compile / graph (torch.compile: models.compiled) or captured (the whole step, optimizers
  included, one CUDA graph: models.captured; AdamW runs fused and capturable there, a non-finite step is
  skipped on the device); a compile or capture that fails on the first step falls back to eager, recorded.
  Batches
  come from `pcvr_lib.data.loader` (`steps` mode: seeded draws of batch keys on the training side of the
  split).
- Validation after the last step (and every `eval_every` steps) on the holdout side; each writes a
  checkpoint (`pcvr_lib.train.checkpoint`). The run keeps the best of them by holdout AUC (the one
  `val` and `infer` use) and the last (the one `--resume` continues, the only one with optimizer state),
  or every one with `keep_checkpoints="all"`.
- On a CPU device the process's C heap keeps freed memory for reuse (`pcvr_lib.heap.keep_freed_heap`,
  process-wide, `cpu_heap_kept` in the telemetry): a step's 50-120 MB temporaries were otherwise faulted in fresh
  on every step, as much system time as compute.
- `threads`: torch's intra-op threads while training (restored afterwards). On a small CPU shared with
  other work one thread is often several times faster than one per core: OpenMP workers spin while a
  core they wait for runs something else (`--quick` uses one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from pcvr_lib.data.convert import labels_from_label_type
from pcvr_lib.errors import Interrupted, check_writable, warn
from pcvr_lib.heap import keep_freed_heap
from pcvr_lib.metrics import auc_text, classification_metrics, undefined_auc_reason
from pcvr_lib.models import build_model
from pcvr_lib.models.captured import CapturedTraining
from pcvr_lib.models.compiled import CompiledModel, mode_problem
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.optim import build_optimizer_set, train_step
from pcvr_lib.progress import StepProgress
from pcvr_lib.train.checkpoint import (
    CHECKPOINT_RE,
    CONFIG_FILE,
    RUN_ARTIFACTS,
    SUMMARY_FILE,
    TMP_PREFIX,
    checkpoint_name,
    complete_checkpoints,
    drop_training_state,
    finite_or_none,
    load_train_state,
    raw_model,
    read_json_file,
    read_manifest,
    resumable,
    retention,
    save_checkpoint,
    verify_checkpoint,
    write_json,
)
from pcvr_lib.train.config import (
    TrainConfig,
    TrainError,
    autocast,
    check_names,
    check_threads,
    resolve_device,
    torch_threads,
)
from pcvr_lib.train.evaluate import predict_batches
from pcvr_lib.train.inputs import (
    check_batch_rows,
    check_data,
    data_path,
    make_loader,
    read_schema,
    reading,
    schema_path,
)
from pcvr_lib.train.telemetry import Telemetry

# where a resumed run must agree with the checkpoint it continues (the rest may change: steps, device, ...)
RESUME_MUST_MATCH = ("model", "schema", "max_lens", "model_config", "seed", "deterministic", "batch_size",
                     "dense_optimizer", "dense_lr", "betas", "weight_decay", "sparse_lr", "max_grad_norm",
                     "init_output_prior", "split", "valid_ratio", "amp")


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


def train(config: TrainConfig, progress=None, *, overwrite: bool = False, resume: bool = False) -> dict[str, Any]:
    """Train, validate, checkpoint and write training_summary.json + training_telemetry.json.

    Everything is checked before the first step: options, device, data, schema, and the run dir, which
    must be empty or new unless `overwrite` (the previous run's artifacts are removed first) or `resume`
    (training continues after the run dir's last complete checkpoint, with its optimizer and RNG state).
    `progress(step, steps, loss)` is called after each step when given. Ctrl-C raises
    `pcvr_lib.errors.Interrupted` saying where training stopped and which checkpoint is the last good one."""
    if config.steps < 1:
        raise TrainError(f"steps must be >= 1, got {config.steps}")
    if config.batch_size < 1 or config.eval_batch_size < 1:
        raise TrainError("batch sizes must be >= 1")
    if config.eval_every < 0 or config.log_every < 0:
        raise TrainError("--eval-every and --log-every must be >= 0")
    check_threads(config.threads)
    if overwrite and resume:
        raise TrainError("--overwrite and --resume exclude each other: replace the run or continue it")
    check_names(config)
    device = resolve_device(config.device)
    problem = mode_problem(config.compile, device) if config.compile != "auto" else None
    if problem:
        raise TrainError(f"--{config.compile}: {problem} (--device {config.device})")
    _training_mode(config, device)  # an explicit --captured that cannot be captured fails here
    data = data_path(config.data).resolve()  # stored absolute: val and infer find it from any folder
    config = dataclasses.replace(config, data=str(data))
    schema_file = schema_path(data, config.schema)
    schema = read_schema(schema_file, config.max_lens)
    data_warnings = check_data(
        data, schema, labels=True, dense=True,
        what=f"--schema {config.schema}" if config.schema else f"the schema.json beside it ({schema_file})",
        fix="train with the data's own schema (leave out --schema) or on data of this schema")
    run_dir = Path(config.run_dir)
    start = _prepare_run_dir(run_dir, config, overwrite=overwrite, resume=resume)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    seed_everything(config.seed, config.deterministic)
    try:
        with reading(data), torch_threads(config.threads):
            return _train(config, device, data, schema, run_dir, progress, start, data_warnings)
    finally:  # the deterministic switch is process-wide: give the caller its setting back
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _prepare_run_dir(run_dir: Path, config: TrainConfig, *, overwrite: bool, resume: bool) -> Path | None:
    """Refuse a non-empty run dir unless overwrite/resume; returns the checkpoint to resume from."""
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
    candidates = [f for _, f in complete_checkpoints(run_dir) if resumable(f)]
    if not candidates:
        raise TrainError(f"--resume: {run_dir} holds no complete checkpoint with optimizer state to continue from "
                         "(train without --resume, or with --overwrite)")
    folder = candidates[-1]
    verify_checkpoint(folder)
    saved = read_json_file(folder / CONFIG_FILE, "train config")
    now = config.to_dict()
    for key in RESUME_MUST_MATCH:
        theirs = saved.get(key)
        if key == "model_config":  # the saved one lists every option; the command's only overrides
            theirs = {k: v for k, v in (theirs or {}).items() if k in now[key]}
        if theirs != now[key]:
            raise TrainError(f"--resume: {folder} was trained with {key}={saved.get(key)!r}, this command asks for "
                             f"{now[key]!r}; use the same options (or --overwrite to start again)")
    step = int(read_manifest(folder)["global_step"])
    if step >= config.steps:
        raise TrainError(f"--resume: {folder.name} is already at step {step}; ask for more --steps than that")
    return folder


# dense optimizers a captured step can run: AdamW, as torch's fused kernel with its step count on the device
CAPTURABLE_DENSE = ("adamw", "fused_adamw")


def _training_mode(config: TrainConfig, device: torch.device) -> tuple[str, str | None]:
    """(the mode the run trains in, why mode auto does not capture, or None). `auto` is captured on a CUDA
    device with a capturable dense optimizer, else eager; an explicit `captured` that cannot be is an error."""
    if config.compile not in ("auto", "captured"):
        return config.compile, None
    why = None
    if device.type != "cuda":
        why = f"the step is captured only on a CUDA device (--device {config.device})"
    elif config.dense_optimizer not in CAPTURABLE_DENSE:
        why = (f"--dense-optimizer {config.dense_optimizer} cannot be captured in a CUDA graph "
               f"({' and '.join(CAPTURABLE_DENSE)} can)")
    if why and config.compile == "captured":
        raise TrainError(f"--captured: {why}; train without --captured (eagerly) or change that option")
    return ("eager", why) if why else ("captured", None)


# The options a captured step does not depend on: a run differing from the kept one only in these reuses its
# graph (`keeping_captured_steps`). Any other option, a new one included, keeps a capture to its own run.
NOT_CAPTURED_OPTIONS = ("data", "run_dir", "experiment_name", "label", "seed", "steps", "eval_batch_size",
                        "eval_every", "keep_checkpoints", "init_output_prior", "eval_at_init", "log_every", "threads",
                        "num_workers")
_KEPT_STEPS: dict | None = None  # capture key -> (model, optimizers, CapturedTraining), inside the scope below


@contextlib.contextmanager
def keeping_captured_steps():
    """Within this scope a run trained in mode captured leaves its model, optimizers and CUDA graph for the next
    run whose options differ only in NOT_CAPTURED_OPTIONS (another seed, the same model, schema and data
    shapes): that run copies its freshly initialised weights into the kept model and resets the kept optimizers'
    state in place (the memory the graph reads), then replays the kept graph instead of capturing its own. It
    trains as with its own capture: the same weights, optimizer state and random state at its first step. One
    run is kept at a time (its GPU memory too), released when the scope ends. A capture costs ~0.7 s: 21 of
    them were 14.5 s of the GPU smoke (H100, notes/models.md)."""
    global _KEPT_STEPS
    outer, _KEPT_STEPS = _KEPT_STEPS, {}
    try:
        yield
    finally:
        _KEPT_STEPS = outer


def _capture_key(config: TrainConfig, model, schema) -> str:
    """What a captured step of this run fixes: its options (but NOT_CAPTURED_OPTIONS), the model's resolved
    config and the schema, as one JSON text."""
    options = {k: v for k, v in config.to_dict().items() if k not in NOT_CAPTURED_OPTIONS}
    return json.dumps({"options": options, "model": raw_model(model).config.to_dict(), "schema": dict(schema.raw)},
                      sort_keys=True, default=str)


def _reuse_kept_step(key: str, model):
    """The kept (model, optimizers, runner) of `key` with `model`'s weights and fresh optimizer state, or None."""
    if not _KEPT_STEPS or key not in _KEPT_STEPS:
        return None
    kept_model, kept_optimizers, runner = _KEPT_STEPS.pop(key)
    with torch.no_grad():
        kept_model.load_state_dict(model.state_dict())  # copied into the parameters' memory, which the graph reads
    kept_optimizers.reset_state_()
    runner.eager_steps = 0
    return kept_model, kept_optimizers, runner


def _runner(model, optimizers, mode: str, config: TrainConfig, device, meta: dict):
    """What a training step calls: the model (eager), the model compiled in `mode`, or in mode captured the
    whole step as a CUDA graph (`CapturedTraining`)."""
    meta["compile_mode"] = mode
    meta["compile_active"] = mode != "eager"
    if mode == "captured":
        return CapturedTraining(model, optimizers, lambda batch: _device_step(model, batch, optimizers, config, device),
                                rows=config.batch_size)  # captured at a full batch; short ones run eagerly
    return model if mode == "eager" else CompiledModel(model, mode)


# the step numbers a captured run leaves on the device before reading them in one sync: without a read per
# step the host builds the next batch while the device runs this one (the GPU smoke waited 24 s on per-step reads)
READ_EVERY = 16
STEP_NUMBERS = ("loss", "grad_norm", "clip_coef", "skipped")


def _step(runner, batch, optimizers, config: TrainConfig, device) -> dict:
    """One training step: forward (under autocast), loss, backward and the optimizers. The step's numbers
    come back as floats (one host read), or, from a captured step, as `numbers`: a device tensor of
    STEP_NUMBERS copied out of the graph's outputs (no read: `_read_steps` reads several at once)."""
    if isinstance(runner, CapturedTraining):
        info = runner(batch)
        return {"numbers": torch.stack([info[key].float() for key in STEP_NUMBERS])}
    with autocast(device, config.amp):
        logits = runner(batch)
    loss = F.binary_cross_entropy_with_logits(logits.float().squeeze(-1), batch.label.float())
    return train_step(loss, optimizers, max_grad_norm=config.max_grad_norm, skip_nonfinite=True,
                      after_backward=getattr(runner, "after_backward", None))


def _read_steps(unread: list[tuple[int, int, dict]], history: dict, bar: StepProgress, progress,
                steps: int) -> None:
    """Read back the numbers of the steps in `unread` (one host read for the captured ones), record them in
    the history, the progress callback and the bar, in step order, and empty `unread`."""
    device_numbers = [info["numbers"] for _, _, info in unread if "numbers" in info]
    floats = iter(torch.stack(device_numbers).tolist() if device_numbers else [])
    for step, rows, info in unread:
        if "numbers" in info:
            info = dict(zip(STEP_NUMBERS, next(floats), strict=True))
        history["skipped"] += int(info["skipped"])
        history["clipped"] += int(info["clip_coef"] < 1.0)
        history["losses"].append(finite_or_none(info["loss"]))
        history["grad_norms"].append(finite_or_none(info["grad_norm"]))
        if progress is not None:
            progress(step, steps, info["loss"])
        bar.update(step, rows, info["loss"], info["grad_norm"])
    unread.clear()


def _device_step(model, batch, optimizers, config: TrainConfig, device) -> dict:
    """The eager step with nothing read back (what mode captured captures): sequences at their static
    lengths, the non-finite skip decided on the device, the numbers left as device tensors."""
    with at_static_lengths(), autocast(device, config.amp, cache=False):
        logits = model(batch)
    loss = F.binary_cross_entropy_with_logits(logits.float().squeeze(-1), batch.label.float())
    return train_step(loss, optimizers, max_grad_norm=config.max_grad_norm, skip_nonfinite=True, read=False)


def _first_step(runner, model, batch, optimizers, config: TrainConfig, device, meta: dict):
    """The first training step, which compiles a compiled model's forward and (at its backward) its backward
    graph, or captures the step. A failure falls back to eager: the half-done step's gradients are dropped
    (no optimizer has stepped yet: they step after the backward; a failed capture puts back what its warm-up
    runs changed) and the step runs again eagerly, with a warning line and the reason in the telemetry.
    Returns the runner for the next steps and the step's info."""
    if runner is model:
        return runner, _step(model, batch, optimizers, config, device)
    t0 = time.perf_counter()
    captured = isinstance(runner, CapturedTraining)
    if captured:  # torch.cuda.graph collects garbage before it captures: with the process's objects frozen
        gc.freeze()  # it scans only the new ones (a smoke process holds many: 0.5 s a capture otherwise)
    try:
        info = _step(runner, batch, optimizers, config, device)
    except Exception as exc:  # noqa: BLE001 - compile problems fall back to eager, recorded
        optimizers.zero_grad(set_to_none=True)
        meta["compile_active"] = False
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        cause = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "backend='x' raised:" + the cause
        meta["compile_fallback_reason"] = f"{type(exc).__name__}: {cause}"[:300]
        what = "the CUDA graph capture" if captured else "torch.compile"
        warn(f"--{meta['compile_mode']}: {what} failed on the first step ({meta['compile_fallback_reason']});"
             " training continues eagerly")
        return model, _step(model, batch, optimizers, config, device)
    finally:
        if captured:
            gc.unfreeze()
    meta["first_step_sec_with_compile"] = round(time.perf_counter() - t0, 3)
    return runner, info


def _train(config: TrainConfig, device, data, schema, run_dir: Path, progress, resume_from: Path | None,
           data_warnings: list[str]):
    with torch.device(device):  # initialised where it trains (on a GPU much faster than on one CPU thread)
        model = build_model(config.model, schema, config.model_config)
    meta: dict[str, Any] = {"model": config.model, "seed": config.seed, "amp": config.amp}
    # on a CPU the step's large temporaries would be mapped fresh (and zeroed by the kernel) on every step
    meta["cpu_heap_kept"] = device.type == "cpu" and keep_freed_heap()
    mode, not_captured = _training_mode(config, device)
    dense_options = {"lr": config.dense_lr, "betas": tuple(config.betas), "weight_decay": config.weight_decay}
    dense = config.dense_optimizer
    if mode == "captured":  # torch's fused AdamW, its step count on the device: the one a graph can hold
        dense, dense_options = "fused_adamw", dict(dense_options, capturable=True)
    meta["dense_optimizer"] = dense
    optimizers = build_optimizer_set(model.dense_parameters(), model.sparse_parameters(), dense=dense,
                                     dense_options=dense_options, sparse_options={"lr": config.sparse_lr})
    train_loader = make_loader(
        data, schema, config, for_training=True, batch_size=config.batch_size, mode="steps", steps=config.steps,
        seed=config.seed,
        split=config.split, side="train", valid_ratio=config.valid_ratio, training=True,
        num_workers=config.num_workers,
    )
    split = train_loader.split
    for text in data_warnings:  # once the model and the loader are built: a bad option stays the only line
        warn(text)
    data_warnings = data_warnings + check_batch_rows(train_loader, config.batch_size, data)
    history: dict[str, Any] = {"losses": [], "grad_norms": [], "skipped": 0, "clipped": 0, "checkpoints": [],
                               "init_metrics": None}
    start = 0
    if resume_from is not None:  # model, optimizer, RNG and history as they were at that checkpoint
        state = load_train_state(resume_from, model, optimizers)
        history.update(state["history"])
        meta["train_positive_rate"] = state.get("train_positive_rate")
        start = int(state["global_step"])
        meta["resumed_from"] = resume_from.name
        train_loader.skip(start)
    elif config.init_output_prior:
        meta["train_positive_rate"] = _positive_rate(data, split.train_mask)
        raw_model(model).set_output_prior(meta["train_positive_rate"])
    capture_key = _capture_key(config, model, schema) if mode == "captured" and resume_from is None else None
    kept = _reuse_kept_step(capture_key, model) if capture_key else None
    if kept is not None:
        del model, optimizers  # this run's own: their weights (the fresh ones) are now the kept model's
        model, optimizers, runner = kept
        meta.update(compile_mode=mode, compile_active=True, capture_reused=True)
    else:
        runner = _runner(model, optimizers, mode, config, device, meta)
    if not_captured and device.type == "cuda" and config.log_every:
        print(f"train: mode auto trains eagerly: {not_captured}", file=sys.stderr, flush=True)
    val_result = None
    telemetry = Telemetry("train", device)
    eval_seconds = 0.0
    if config.log_every:
        cap = raw_model(model).config.vocab_cap
        print(f"train: {config.model} on {data} ({int(split.train_mask.sum())} train / {int(split.valid_mask.sum())} "
              f"holdout rows), steps {start + 1}..{config.steps} of {config.batch_size} rows, run dir {run_dir}; "
              f"tables {f'capped at {cap} rows' if cap else 'uncapped'}, sequences "
              f"{','.join(f'{d.name}:{d.max_len}' for d in schema.domains)}, {torch.get_num_threads()} thread(s)",
              file=sys.stderr, flush=True)
    bar = StepProgress(config.steps, start, f"train {config.model}", every=config.log_every)
    done = start  # the last step completed (what Ctrl-C reports)
    unread: list[tuple[int, int, dict]] = []  # (step, rows, info) of the steps not yet read back
    try:
        with telemetry:
            if config.eval_at_init and resume_from is None:
                t0 = time.perf_counter()
                m = _holdout(model, data, schema, config, split, device)["metrics"]
                history["init_metrics"] = {k: m[k] for k in ("auc", "logloss", "sample_count")}
                eval_seconds += time.perf_counter() - t0
            for step, batch in enumerate(train_loader, start=start + 1):
                if not model.training:  # back from a holdout; `train()` walks every module (0.2-0.7 ms)
                    model.train()
                batch = batch.to(device, non_blocking=True)
                # the step that compiles, or captures (the first full batch in mode captured), may fall back
                if step == start + 1 or (isinstance(runner, CapturedTraining) and runner.graph is None):
                    runner, info = _first_step(runner, model, batch, optimizers, config, device, meta)
                else:
                    info = _step(runner, batch, optimizers, config, device)
                telemetry.rows += batch.batch_size
                telemetry.batches += 1
                telemetry.steps += 1
                done = step
                unread.append((step, batch.batch_size, info))
                evaluate = step == config.steps or (config.eval_every and step % config.eval_every == 0)
                if "numbers" not in info or evaluate or len(unread) >= READ_EVERY:
                    _read_steps(unread, history, bar, progress, config.steps)
                if evaluate:
                    t0 = time.perf_counter()
                    val_result = _holdout(model, data, schema, config, split, device)
                    _save(run_dir, model, schema, config, step, val_result["metrics"], optimizers, history, meta,
                          bar, t0)
                    eval_seconds += time.perf_counter() - t0
            _read_steps(unread, history, bar, progress, config.steps)  # none left unless the loader ended early
            telemetry.excluded = eval_seconds  # elapsed_sec and the rates cover the training steps only
    except KeyboardInterrupt:
        good = [f.name for _, f in complete_checkpoints(run_dir)]
        last = f"last good checkpoint {run_dir / good[-1]}" if good else "no checkpoint saved yet"
        raise Interrupted(f"training stopped after step {done} of {config.steps}; {last}"
                          + ("; continue with the same command plus --resume" if good else "")) from None
    finally:
        bar.close()
    if isinstance(runner, CapturedTraining):
        meta["captured_eager_steps"] = runner.eager_steps  # batches of another shape than the captured one
        if _KEPT_STEPS is not None and capture_key and runner.graph is not None:
            _KEPT_STEPS.clear()  # one kept at a time: the earlier one's GPU memory goes
            _KEPT_STEPS[capture_key] = (model, optimizers, runner)
    train_meta = dict(meta, skipped_steps=history["skipped"], clipped_steps=history["clipped"],
                      holdout_eval_sec=eval_seconds, loader=train_loader.stats())
    train_telemetry = telemetry.to_dict(model, train_meta)
    write_json(run_dir / "training_telemetry.json", train_telemetry)
    metrics = val_result["metrics"]
    undefined = undefined_auc_reason(metrics)
    if undefined:
        data_warnings = [*data_warnings, f"holdout {undefined}: the checkpoint is named AUC=undefined"]
        warn(data_warnings[-1])
    checkpoints = [str(run_dir / name) for name in history["checkpoints"]]
    best = str(run_dir / retention(history["checkpoints"], config.keep_checkpoints)[1])
    summary = {
        "run_dir": str(run_dir),
        "experiment_name": config.experiment_name or config.model,
        "label": config.label or run_dir.name,
        "model": config.model,
        "seed": config.seed,
        "data_path": str(data),
        "data_warnings": data_warnings,
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
        "best_checkpoint": best,  # the highest holdout AUC: what val and infer use
        "last_checkpoint": checkpoints[-1],  # what --resume continues
        "checkpoint_sha256": read_manifest(Path(best))["sha256"],
        "train_config": config.to_dict(),
        "model_config": model.config.to_dict(),
        "telemetry": train_telemetry,
    }
    write_json(run_dir / SUMMARY_FILE, summary)
    return summary


def _save(run_dir: Path, model, schema, config: TrainConfig, step: int, metrics: dict, optimizers, history: dict,
          meta: dict, bar: StepProgress, t0: float) -> None:
    """Save the checkpoint of `step`, then apply the retention: checkpoints that are neither the best nor
    the last are removed, and the previous last loses its optimizer state when it stays as the best.
    The history saved with the checkpoint already lists what is kept, so a resumed run agrees with the disk."""
    name = checkpoint_name(step, metrics["auc"])
    before = [c for c in history["checkpoints"] if c != name]
    kept, _ = retention([*before, name], config.keep_checkpoints)
    history["checkpoints"] = kept
    folder = save_checkpoint(run_dir, model, schema, config, step, metrics["auc"], optimizers=optimizers,
                             train_state={"history": history, "train_positive_rate": meta.get("train_positive_rate")})
    dropped = [c for c in before if c not in kept]
    for old in dropped:
        shutil.rmtree(run_dir / old, ignore_errors=True)
    if config.keep_checkpoints != "all" and before and before[-1] in kept:
        drop_training_state(run_dir / before[-1])  # still the best, no longer the last
    size = sum(f.stat().st_size for f in folder.iterdir())
    bar.note(f"validated after step {step}: holdout AUC {auc_text(metrics['auc'])} on {metrics['sample_count']} "
             f"rows; saved {name} ({size / 2**20:,.0f} MiB){f', removed {len(dropped)} older' if dropped else ''} "
             f"in {time.perf_counter() - t0:.1f}s")


def _positive_rate(data: Path, rows: np.ndarray) -> float:
    """Share of positive labels (the converter's label rule) among the given rows."""
    label_type = pq.read_table(data, columns=["label_type"]).column("label_type").combine_chunks()
    labels = labels_from_label_type(label_type)
    return float(labels[rows].mean(dtype=np.float64)) if rows.any() else 0.5


def _holdout(model, data, schema, config: TrainConfig, split, device) -> dict:
    loader = make_loader(data, schema, config, batch_size=config.eval_batch_size, mode="sweep", split=split,
                         side="valid", training=True, num_workers=0)
    preds = predict_batches(model, loader, device, config.amp)
    return {"predictions": preds, "metrics": classification_metrics(preds["target"], preds["probability"])}
