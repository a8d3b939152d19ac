"""What a run is asked to do: `TrainConfig` (saved complete in every checkpoint, so that `val` and
`infer` rebuild the model from it), the checks of its names, and the device and precision it runs in."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pcvr_lib.data.loader import PRESETS
from pcvr_lib.data.split import SPLIT_METHODS
from pcvr_lib.models import model_names
from pcvr_lib.models.compiled import MODES
from pcvr_lib.optim.registry import DENSE_OPTIMIZERS

# `pcvr train --quick` (the first run) and the CPU smoke scale the reference settings down the same way: no
# embedding table above this many rows (hashed), the newest events per sequence domain, one torch thread
QUICK_TABLE_CAP = 8192
QUICK_MAX_LEN = 32
QUICK_THREADS = 1
# which checkpoints a run keeps: the best holdout AUC and the last (the one --resume continues), or all
KEEP_CHECKPOINTS = ("best-and-last", "all")

TRAIN_MODES = ("auto", *MODES)  # auto: captured on a CUDA device where the step can be captured, else eager


class TrainError(ValueError):
    """A bad path or option for train / val / infer; the message names it."""


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
    keep_checkpoints: str = "best-and-last"  # KEEP_CHECKPOINTS
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
    threads: int | None = None  # torch intra-op threads while training (None: torch's default, one per core)
    amp: bool = False  # bf16 autocast
    # TRAIN_MODES: auto (captured on CUDA where it works, else eager), or one of models.compiled.MODES: eager,
    # compile (torch.compile), graph (+ inductor's CUDA graphs), captured (the whole step as one CUDA graph)
    compile: str = "auto"
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
        if isinstance(values.get("compile"), bool):  # runs saved when compile was on/off
            values["compile"] = "compile" if values["compile"] else "eager"
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return cls(**values)


def check_names(config: TrainConfig) -> None:
    """Unknown model, optimizer or split names fail before any work, listing the valid ones."""
    if config.model not in model_names():
        raise TrainError(f"unknown model {config.model!r}; registered: {', '.join(model_names())}")
    if config.dense_optimizer not in DENSE_OPTIMIZERS:
        raise TrainError(f"unknown --dense-optimizer {config.dense_optimizer!r}; one of {', '.join(DENSE_OPTIMIZERS)}")
    if config.split not in SPLIT_METHODS:
        raise TrainError(f"unknown --split {config.split!r}; one of {', '.join(SPLIT_METHODS)}")
    if config.loader_preset not in PRESETS:
        raise TrainError(f"unknown --loader-preset {config.loader_preset!r}; one of {', '.join(PRESETS)}")
    if config.compile not in TRAIN_MODES:
        raise TrainError(f"unknown compile mode {config.compile!r}; one of {', '.join(TRAIN_MODES)}")
    if config.keep_checkpoints not in KEEP_CHECKPOINTS:
        raise TrainError(f"unknown --keep-checkpoints {config.keep_checkpoints!r}; one of "
                         f"{', '.join(KEEP_CHECKPOINTS)}")


def strict_time_filter(config: TrainConfig) -> bool:
    """The converter's time filter: the config's when set, else its loader preset's."""
    if config.strict_time_filter is not None:
        return bool(config.strict_time_filter)
    return PRESETS[config.loader_preset].strict_time_filter


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TrainError(f"--device {name!r} is not a torch device name (cpu, cuda, cuda:0, ...)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def check_threads(count: int | None) -> int | None:
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise TrainError(f"--threads must be an integer >= 1, got {count!r}")
    return count


@contextlib.contextmanager
def torch_threads(count: int | None):
    """torch's intra-op threads set to `count` inside the block (None: left as they are), then restored:
    the setting is process-wide."""
    before = torch.get_num_threads()
    if check_threads(count) is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# x86 CPU flags of bf16 matmul instructions: with them torch's bf16 matmul runs about 2x its fp32 one (one thread of
# the 2-core AMD EPYC development machine: 194-211 against 91-96 GFLOP/s); without them bf16 is emulated
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_computes_bf16_natively(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matmul instructions (`NATIVE_BF16_CPU_FLAGS`, read from Linux's cpuinfo;
    False where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in NATIVE_BF16_CPU_FLAGS)


def autocast(device: torch.device, amp: bool, cache: bool = True):
    """bf16 autocast on `device` when `amp`, else a context that does nothing. `cache=False` inside a CUDA
    graph capture (autocast's cache of cast weights would be freed after the capture, torch's rule)."""
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)


def at_precision(device: torch.device, precision: str, captured: bool = False):
    """The context a model step runs in at `precision` ("fp32", or "bf16": under bf16 autocast, as `--amp`);
    `captured`: the call may capture a CUDA graph (autocast then without its cache)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    return autocast(device, precision == "bf16", cache=not captured)
