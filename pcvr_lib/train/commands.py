"""The commands `pcvr train | val | infer`: their flags and what each prints when it is done."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcvr_lib.data.convert import LIST_ORDERS
from pcvr_lib.data.loader import PRESETS
from pcvr_lib.data.split import SPLIT_METHODS
from pcvr_lib.metrics import auc_text
from pcvr_lib.models import model_names
from pcvr_lib.models.common import BACKEND_OPTIONS, BACKENDS
from pcvr_lib.optim.registry import DENSE_OPTIMIZERS
from pcvr_lib.train.config import TrainConfig, TrainError
from pcvr_lib.train.evaluate import infer, validate
from pcvr_lib.train.loop import train


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
    for option in BACKEND_OPTIONS:
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, choices=BACKENDS, help=f"model option {option} (default torch)")


def backend_overrides(args: argparse.Namespace, model_config: dict) -> dict:
    """model_config with the backend flags given on the command line; a flag that contradicts the same
    option in --model-config is an error, not a silent override."""
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
    add("--batch-size", type=int, default=d.batch_size,
        help=f"training rows per step (default {d.batch_size}); a batch never spans parquet row groups, so each row "
             "group's last batch holds fewer (said at the start)")
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
    print(f"{summary['run_dir']}: holdout AUC {auc_text(m['auc'])} logloss {m['logloss']:.4f} "
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
    print(f"{ev['experiment_name']}: AUC {auc_text(m['auc'])} logloss {m['logloss']:.4f} brier {m['brier']:.4f} "
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
