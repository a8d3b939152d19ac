"""Train / validate / infer a PCVR model and write the run-dir artifacts (models-smoke.md section 3).

Python API: `train(TrainConfig) -> summary`, `validate(run_dir=..., ...) -> evaluation`,
`infer(checkpoint=..., ...) -> telemetry`. Commands: `pcvr train | val | infer` (`commands`).

- config: `TrainConfig`, `TrainError`, the name checks, the device and autocast.
- inputs: the data file, its schema and the loaders that read them.
- loop: `train` (seeded training, holdout validation, checkpoints, the training summary).
- evaluate: `validate` and `infer` (and `predict_batches`, which training's validation shares).
- checkpoint: the run dir's file names, JSON writing, checkpoints saved, found, verified and loaded.
- telemetry: wall time, peak memory and throughput of a phase.
- commands: the argparse side of the three commands.
"""

from pcvr_lib.train.checkpoint import (
    CHECKPOINT_RE,
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_ARTIFACTS,
    SCHEMA_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    TMP_PREFIX,
    complete_checkpoints,
    file_sha256,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from pcvr_lib.train.commands import add_backend_arguments, backend_overrides
from pcvr_lib.train.config import TrainConfig, TrainError, resolve_device
from pcvr_lib.train.evaluate import infer, predict_batches, validate
from pcvr_lib.train.loop import keeping_captured_steps, train

__all__ = [
    "CHECKPOINT_RE", "CONFIG_FILE", "MANIFEST_FILE", "MODEL_FILE", "OPTIMIZER_FILE", "RUN_ARTIFACTS", "SCHEMA_FILE",
    "STATE_FILE", "SUMMARY_FILE", "TMP_PREFIX", "TrainConfig", "TrainError", "add_backend_arguments",
    "backend_overrides", "complete_checkpoints", "file_sha256", "find_checkpoint", "infer", "keeping_captured_steps",
    "load_checkpoint",
    "predict_batches", "resolve_device", "save_checkpoint", "train", "validate", "verify_checkpoint",
]
