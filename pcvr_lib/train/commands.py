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
from pcvr_lib.train.config import (
    KEEP_CHECKPOINTS,
    QUICK_MAX_LEN,
    QUICK_TABLE_CAP,
    QUICK_THREADS,
    TrainConfig,
    TrainError,
)
from pcvr_lib.train.evaluate import infer, validate
from pcvr_lib.train.inputs import data_path, read_schema, schema_path
from pcvr_lib.train.loop import train

# what a run costs, measured on this project's 2-core CPU (notes/models.md, "The first run")
TRAIN_EPILOG = (
    "Expected cost of baseline's 20 steps of 128 rows on a 2-core CPU: with --quick about 16 s in all (12 s of "
    "training; 34 s while other jobs kept both cores busy), 1.6 GB peak memory, a 111 MB checkpoint; at the "
    "reference settings (the defaults: full tables and sequence lengths) 5-12 minutes, 8 GB peak memory, a 0.8 GB "
    "checkpoint (the last one, with its optimizer state; a best-only one 0.6 GB). The other models cost up to "
    "10x more (notes/models.md)."
)


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
    add("--quick", action="store_true",
        help=f"a first run that fits a small CPU: embedding tables capped at {QUICK_TABLE_CAP} rows (hashed), the "
             f"newest {QUICK_MAX_LEN} events per sequence domain, {QUICK_THREADS} torch thread; --table-cap, "
             "--max-lens and --threads given with it win (default: the reference settings)")
    add("--table-cap", type=int,
        help="most rows per embedding table, larger vocabularies hashed (model option vocab_cap; 0: no cap; "
             f"default: none, {QUICK_TABLE_CAP} with --quick)")
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
    add("--keep-checkpoints", choices=KEEP_CHECKPOINTS, default=d.keep_checkpoints,
        help="best-and-last: the best holdout AUC (what val and infer use) and the last (what --resume continues, "
             f"the only one with optimizer state); all: every one, each with its optimizer state "
             f"(default {d.keep_checkpoints})")
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
    add("--threads", type=int,
        help=f"torch threads while training (default: one per core; {QUICK_THREADS} with --quick: on a busy small "
             "CPU one thread is often several times faster)")
    add("--amp", action="store_true", help="bf16 autocast")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--captured", dest="compile", action="store_const", const="captured", default="auto",
                       help="the whole step (forward, backward, clipping, optimizers) as one CUDA graph, replayed "
                            "per batch (CUDA only; dense optimizer adamw, run as torch's fused AdamW). The "
                            "default on a CUDA device where the step can be captured; a capture that fails on "
                            "the first step falls back to eager, with a warning")
    modes.add_argument("--eager", dest="compile", action="store_const", const="eager",
                       help="plain eager PyTorch (the default on the CPU)")
    modes.add_argument("--compile", dest="compile", action="store_const", const="compile",
                       help="run the model under torch.compile (one graph for forward and backward; the first "
                            "steps compile, about a minute a model on a CPU); falls back to eager, with a "
                            "warning, where it fails")
    modes.add_argument("--graph", dest="compile", action="store_const", const="graph",
                       help="--compile with inductor's CUDA graphs (CUDA devices only)")
    add("--num-workers", type=int, default=0, help="data loader worker processes (default 0: in-process)")
    add("--log-every", type=int, default=5,
        help="without a terminal, or on one that reports no width (logs, CI): a progress line every N steps and "
             "after any step that ends 10 s after the last line; 0 for none (default 5)")
    _add_list_order(parser, "auto")
    parser.epilog = TRAIN_EPILOG


def _add_list_order(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument(
        "--list-order", choices=LIST_ORDERS, default=default,
        help="sequence list order: auto tells it per row from the event times; newest-first / newest-last for "
        "data without usable times (default: " + (default or "the order the model was trained with") + ")",
    )


def _reductions(args: argparse.Namespace, model_config: dict) -> tuple[dict, str | None, int | None]:
    """(model_config, max_lens, threads) after --table-cap and --quick: --quick fills in what the command
    leaves open; a --table-cap that contradicts --model-config's vocab_cap is an error."""
    max_lens, threads, table_cap = args.max_lens, args.threads, args.table_cap
    if table_cap is not None and table_cap < 0:
        raise TrainError(f"--table-cap must be >= 0 (0: no cap), got {table_cap}")
    if table_cap is not None:
        cap = table_cap or None
        if "vocab_cap" in model_config and model_config["vocab_cap"] != cap:
            raise TrainError(f"--table-cap {table_cap} contradicts --model-config's vocab_cap="
                             f"{model_config['vocab_cap']!r}; give it once")
        model_config = dict(model_config, vocab_cap=cap)
    if args.quick:
        model_config = {"vocab_cap": QUICK_TABLE_CAP, **model_config}
        if max_lens is None:
            schema = read_schema(schema_path(data_path(args.data), args.schema), None)
            max_lens = ",".join(f"{d.name}:{QUICK_MAX_LEN}" for d in schema.domains)
        threads = QUICK_THREADS if threads is None else threads
    return model_config, max_lens, threads


def run_train(args: argparse.Namespace) -> int:
    model_config, max_lens, threads = _reductions(args, backend_overrides(args, _model_config_arg(args.model_config)))
    config = TrainConfig(
        model=args.model, data=args.data, run_dir=args.run_dir, schema=args.schema, max_lens=max_lens,
        model_config=model_config,
        experiment_name=args.experiment_name,
        label=args.label, seed=args.seed, deterministic=not args.no_deterministic, steps=args.steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, eval_every=args.eval_every,
        keep_checkpoints=args.keep_checkpoints, threads=threads,
        dense_optimizer=args.dense_optimizer, dense_lr=args.dense_lr, sparse_lr=args.sparse_lr,
        max_grad_norm=args.max_grad_norm, init_output_prior=not args.no_output_prior, eval_at_init=args.eval_at_init,
        split=args.split, valid_ratio=args.valid_ratio, loader_preset=args.loader_preset,
        strict_time_filter=args.strict_time_filter, device=args.device,
        amp=args.amp, compile=args.compile, num_workers=args.num_workers, log_every=args.log_every,
        list_order=args.list_order,
    )
    summary = train(config, overwrite=args.overwrite, resume=args.resume)
    m = summary["validation_metrics"]
    best = summary["best_checkpoint"]
    kept = f"best checkpoint {best}" if best != summary["last_checkpoint"] else f"checkpoint {best}"
    print(f"{summary['run_dir']}: holdout AUC {auc_text(m['auc'])} logloss {m['logloss']:.4f} "
          f"({m['sample_count']} rows), {summary['skipped_steps']} skipped step(s), "
          f"train {summary['telemetry']['elapsed_sec']:.1f}s; {kept}")
    return 0


def add_val_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="run directory: the checkpoint its training summary names; artifacts "
                        "written here")
    parser.add_argument("--checkpoint", help="checkpoint folder or model.safetensors (default: the run dir's)")
    parser.add_argument("--data", help="parquet file (default: the one the model was trained on)")
    parser.add_argument("--rows", choices=["valid", "all"], default="valid",
                        help="holdout side of the training split (default) or every row")
    _add_scoring_options(parser)


def _add_scoring_options(parser: argparse.ArgumentParser) -> None:
    """The options val and infer share: batch size, device, threads, list order."""
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--threads", type=int,
                        help="torch threads while scoring (default: the ones the run was trained with, e.g. 1 "
                             "after train --quick; one per core when it set none)")
    _add_list_order(parser, None)


def run_val(args: argparse.Namespace) -> int:
    ev = validate(args.run_dir, checkpoint=args.checkpoint, data=args.data, rows=args.rows,
                  batch_size=args.batch_size, device=args.device, list_order=args.list_order, threads=args.threads)
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
    _add_scoring_options(parser)


def run_infer(args: argparse.Namespace) -> int:
    t = infer(args.checkpoint, data=args.data, result_dir=args.result_dir, batch_size=args.batch_size,
              device=args.device, list_order=args.list_order, threads=args.threads)
    print(f"scored {t['rows']} rows in {t['elapsed_sec']:.2f}s ({t['rows_per_sec']:.0f} rows/s)")
    return 0
