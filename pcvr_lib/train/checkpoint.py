"""The run dir's files: their names, JSON writing, and the checkpoints.

A checkpoint `global_step{N}.AUC={auc:.6f}/` (`AUC=undefined` when the holdout held one class only) holds
model.safetensors, schema.json and train_config.json (the complete config), which are all `val` and `infer`
need to rebuild the model: no pickles anywhere.
Training checkpoints also hold the optimizer and RNG state (safetensors + a JSON skeleton) and the
history so far, for `--resume`. checkpoint.json, the sha256 of every file, is written last: a folder
without it is incomplete, skipped when a run dir is searched and refused when named.

Size: the embedding tables change at every step (sparse Adagrad moves the rows each batch touches), so
every checkpoint holds its own model file; what is not needed is not kept. A run keeps the best and the
last checkpoint (`retention`; `keep_checkpoints="all"` keeps every one), and a checkpoint that is no longer
the last loses its optimizer state (`drop_training_state`): only the last one is resumed from. Optimizer
state whose rows are mostly zero (Adagrad's sums of the table rows no batch has touched yet) is stored as
its non-zero rows.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from safetensors.torch import load_file, save_file

from pcvr_lib.models import build_model
from pcvr_lib.schema import SchemaError, parse_schema
from pcvr_lib.train.config import TrainConfig, TrainError

CHECKPOINT_RE = re.compile(r"^global_step(\d+)\.AUC=([0-9.]+|nan|undefined)$")
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


# ------------------------------------------------------------------------------------------- JSON
def write_json(path: Path, payload: Any) -> None:
    """Write `payload` as strict JSON (no NaN), atomically: a temporary file renamed into place."""
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


def finite_or_none(value):
    """A non-finite float as None (JSON null), anything else as it is."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def read_json_file(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise TrainError(f"{path}: not a valid {what} JSON file ({exc})") from exc


# ------------------------------------------------------------------------------------------- save
def checkpoint_name(step: int, auc: float | None) -> str:
    """`global_step{N}.AUC={auc:.6f}`, or `AUC=undefined` when there is no AUC (None or NaN: one class only)."""
    value = "undefined" if auc is None or not np.isfinite(auc) else f"{auc:.6f}"
    return f"global_step{step}.AUC={value}"


def save_checkpoint(run_dir: Path, model, schema, config: TrainConfig, step: int, auc: float | None,
                    optimizers=None, train_state: dict | None = None) -> Path:
    """Write `global_step{N}.AUC={auc}/` atomically: every file goes to a hidden temporary folder, then
    MANIFEST_FILE (the sha256 of each file) is written last and the folder is renamed into place. A folder
    without a manifest is incomplete and never loaded. With `optimizers` and `train_state`, the optimizer
    state, the RNG state and the run's history so far are saved too, so that `--resume` can continue."""
    folder = run_dir / checkpoint_name(step, auc)
    tmp = run_dir / f"{TMP_PREFIX}{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        state = raw_model(model).state_dict()
        tensors = dict(zip(state, host_copies(list(state.values())), strict=True))
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"model": config.model, "global_step": str(step)})
        (tmp / SCHEMA_FILE).write_text(json.dumps(dict(schema.raw), indent=2) + "\n")
        full = config.to_dict()
        full["model_config"] = raw_model(model).config.to_dict()  # every model option, defaults included
        full["global_step"] = step
        write_json(tmp / CONFIG_FILE, full)
        if optimizers is not None:
            state_tensors: dict[str, torch.Tensor] = {}
            structure = _split_tensors(_on_host(optimizers.state_dict()), "optimizer", state_tensors, compact=True)
            rng = {"torch": _split_tensors(torch.get_rng_state(), "rng.torch", state_tensors)}
            if torch.cuda.is_available():
                rng["cuda"] = _split_tensors(torch.cuda.get_rng_state_all(), "rng.cuda", state_tensors)
            save_file(state_tensors, str(tmp / OPTIMIZER_FILE))
            write_json(tmp / STATE_FILE, dict(train_state or {}, global_step=step, optimizer=structure, rng=rng))
        names = sorted(p.name for p in tmp.iterdir())
        auc = None if auc is None else finite_or_none(float(auc))
        write_json(tmp / MANIFEST_FILE, {"global_step": step, "auc": auc,
                                         "sha256": files_sha256(tmp, names)})
        if folder.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def checkpoint_auc(name: str) -> float:
    """The holdout AUC a checkpoint folder's name carries; -inf where it carries none (an undefined AUC)."""
    m = CHECKPOINT_RE.match(name)
    try:
        value = float(m.group(2)) if m else math.nan
    except ValueError:
        value = math.nan
    return value if math.isfinite(value) else -math.inf


def retention(names: list[str], keep: str) -> tuple[list[str], str]:
    """(the checkpoints a run keeps, its best) of `names`, oldest first: the best is the highest holdout AUC
    (the newest of equal ones, the last when none has an AUC); "best-and-last" keeps it and the last."""
    best = max(reversed(names), key=checkpoint_auc)
    kept = list(names) if keep == "all" else [n for n in names if n in (best, names[-1])]
    return kept, best


def drop_training_state(folder: Path) -> None:
    """Remove the optimizer and RNG state of a complete checkpoint that is no longer the last (val and
    infer need none of it; --resume continues from the last). The manifest is rewritten without those
    files before they go, so an interruption leaves a complete checkpoint either way."""
    manifest = read_manifest(folder)
    state_files = (OPTIMIZER_FILE, STATE_FILE)
    if manifest is None or not any(name in manifest["sha256"] for name in state_files):
        return
    manifest["sha256"] = {k: v for k, v in manifest["sha256"].items() if k not in state_files}
    write_json(folder / MANIFEST_FILE, manifest)
    for name in state_files:
        (folder / name).unlink(missing_ok=True)


def resumable(folder: Path) -> bool:
    """A complete checkpoint whose manifest lists the optimizer and RNG state that --resume needs."""
    manifest = read_manifest(folder)
    return manifest is not None and all(name in manifest["sha256"] for name in (OPTIMIZER_FILE, STATE_FILE))


# (st_dev, st_ino) -> (size, mtime_ns, ctime_ns, sha256) of files this process hashed, for a file whose size and
# times are unchanged since: any write, truncation or replacement changes its ctime. A file is remembered only
# when its last change was at least SETTLED_NS before it was read: a file system stamps times at a coarse tick
# (up to 10 ms), so a write within one tick of an earlier one could keep its times. On the GPU smoke, validation
# and inference verify each checkpoint that training saved in the same process (4.2 s of the smoke's 11.5 s of
# hashing on an H100, notes/models.md).
_HASHED: dict[tuple[int, int], tuple[int, int, int, str]] = {}
SETTLED_NS = 50_000_000


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content (hex); a file unchanged since this process hashed it is not read again."""
    started = time.time_ns()
    before = os.stat(path)
    key = (before.st_dev, before.st_ino)
    stamp = (before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    known = _HASHED.get(key)
    if known is not None and known[:3] == stamp:
        return known[3]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    after = os.stat(path)
    settled = started - max(before.st_mtime_ns, before.st_ctime_ns) >= SETTLED_NS
    if settled and (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == stamp:
        _HASHED[key] = (*stamp, hexdigest)
    return hexdigest


def files_sha256(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: file_sha256(folder / name)}, the files hashed at once on threads (hashlib and file reads let
    go of the GIL): a checkpoint save waits for its largest file's hash, not for the sum of them."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(folder / name), names), strict=True))


def host_copies(tensors: list[torch.Tensor], batched=("cuda",), chunk_bytes: int = 256 << 20) -> list[torch.Tensor]:
    """Host copies of `tensors` (detached, contiguous, each in its own memory, in order). Those on a device of
    a `batched` type come over in a few large copies per device and dtype (joined there in chunks of about
    `chunk_bytes`, split again on the host) instead of one synchronising copy each: a checkpoint holds
    hundreds of small tensors (every parameter's optimizer state), and one copy each took 3.8 s of the H100
    smoke's 92.8 s under cProfile (about 800 copies a save). Tensors elsewhere are copied as before."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type in batched and t.numel() and t.layout == torch.strided:
            groups.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = t.detach().contiguous().cpu()
    chunks: list[list[int]] = []
    for indices in groups.values():
        chunks.append([])
        size = 0
        for i in indices:
            if chunks[-1] and size + tensors[i].nbytes > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += tensors[i].nbytes
    for chunk in chunks:
        joined = torch.cat([tensors[j].detach().reshape(-1) for j in chunk]).cpu()
        for j, piece in zip(chunk, joined.split([tensors[j].numel() for j in chunk]), strict=True):
            out[j] = piece.view(tensors[j].shape).clone()  # its own memory: safetensors refuses shared storage
    return out


def _on_host(obj):
    """`obj` (a nested state dict) with its tensors replaced by host_copies of them."""
    leaves, spec = pytree.tree_flatten(obj)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    for i, copy in zip(at, host_copies([leaves[i] for i in at]), strict=True):
        leaves[i] = copy
    return pytree.tree_unflatten(leaves, spec)


def _split_tensors(obj, prefix: str, tensors: dict[str, torch.Tensor], compact: bool = False):
    """A JSON-able copy of a (nested) state dict whose tensors are moved into `tensors` by name: optimizer
    state is saved as safetensors + JSON, no pickles. Int dict keys and tuples survive the round trip.
    With `compact`, a tensor of which at most half the rows are non-zero is stored as those rows and their
    indices (bit for bit: a row is zero when all its bytes are)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().cpu()
        rows = _nonzero_rows(t) if compact else None
        if rows is not None and 2 * len(rows) <= t.shape[0]:
            tensors[prefix + ".rows"] = rows
            tensors[prefix + ".values"] = t.index_select(0, rows)
            return {"__rows__": prefix, "shape": list(t.shape)}
        tensors[prefix] = t
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__items__": [[k, _split_tensors(v, f"{prefix}.{k}", tensors, compact)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split_tensors(v, f"{prefix}.{i}", tensors, compact) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split_tensors(v, f"{prefix}.{i}", tensors, compact) for i, v in enumerate(obj)]
    return obj


def _nonzero_rows(t: torch.Tensor) -> torch.Tensor | None:
    """Indices of the rows of `t` with any non-zero byte (-0.0 counts as non-zero), or None for a tensor
    without rows to drop (fewer than 2 dimensions, or no elements)."""
    if t.dim() < 2 or t.numel() == 0:
        return None
    as_bytes = t.reshape(t.shape[0], -1).view(torch.uint8)
    return torch.nonzero(as_bytes.any(dim=1)).reshape(-1)


def _join_tensors(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__rows__" in obj:
            values = tensors[obj["__rows__"] + ".values"]
            full = values.new_zeros(obj["shape"])
            full[tensors[obj["__rows__"] + ".rows"]] = values
            return full
        if "__tuple__" in obj:
            return tuple(_join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: _join_tensors(v, tensors) for k, v in obj["__items__"]}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def raw_model(model):
    """The model itself, also when wrapped by torch.compile."""
    return getattr(model, "_orig_mod", model)


# ------------------------------------------------------------------------------------------- find
def read_manifest(folder: Path) -> dict | None:
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
        if m and child.is_dir() and read_manifest(child) is not None:
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
        summary = read_json_file(p / SUMMARY_FILE, "training summary")
        named = summary.get("best_checkpoint") if isinstance(summary, dict) else None
        if not isinstance(named, str) or not named:
            raise TrainError(f"{p / SUMMARY_FILE} names no best_checkpoint: retrain into a fresh --run-dir")
        folder = p / Path(named).name  # the run dir may have moved since: the name is what counts
        if not folder.is_dir():
            raise TrainError(f"{p / SUMMARY_FILE} names checkpoint {folder.name}, which is not in {p}")
        _check_summary_digests(p / SUMMARY_FILE, summary, folder)
    else:
        found = complete_checkpoints(p)
        if not found:
            raise TrainError(
                f"no complete checkpoint under {p}: expected global_step<N>.AUC=<auc>/ with {MODEL_FILE} and "
                f"{MANIFEST_FILE} (run `pcvr train` first)"
            )
        folder = found[-1][1]
    if read_manifest(folder) is None:
        raise TrainError(f"checkpoint {folder} is incomplete (no readable {MANIFEST_FILE}: an interrupted save "
                         "or an older pcvr); use another checkpoint or retrain")
    return folder


def _check_summary_digests(summary_path: Path, summary: dict, folder: Path) -> None:
    """The summary's checkpoint_sha256 must be the checkpoint manifest's: then the files verify_checkpoint
    checks against the manifest are the ones training recorded (an edit of either is refused)."""
    recorded = summary.get("checkpoint_sha256")
    manifest = read_manifest(folder)
    if not isinstance(recorded, dict) or manifest is None:
        raise TrainError(f"{summary_path} records no checkpoint_sha256 for {folder.name}: restore the run dir from a "
                         "copy or retrain")
    for name in sorted(set(recorded) | set(manifest["sha256"])):
        if recorded.get(name) != manifest["sha256"].get(name):
            raise TrainError(f"{summary_path}: the sha256 of {folder.name}/{name} it records differs from "
                             f"{folder.name}/{MANIFEST_FILE}'s: the summary or the checkpoint changed after training; "
                             "restore the run dir from a copy or retrain")


def check_output_run_dir(out_dir: Path, folder: Path, checkpoint_option: str, out_option: str) -> None:
    """Refuse to write a checkpoint's evaluation into another run's dir: `out_dir` must be the checkpoint's own
    run dir, or hold no run (no training summary, checkpoint or evaluation of its own)."""
    if out_dir.resolve() == folder.parent.resolve() or not out_dir.is_dir():
        return
    own = [p.name for p in out_dir.iterdir() if p.name in RUN_ARTIFACTS or CHECKPOINT_RE.match(p.name)]
    if own:
        raise TrainError(f"{checkpoint_option} {folder} is not a checkpoint of {out_option} {out_dir}, which holds "
                         f"another run ({', '.join(sorted(own)[:3])}): its evaluation would replace that run's files; "
                         f"leave out {out_option} (the files go to {folder.parent}) or give an empty one")


def verify_checkpoint(folder: Path, files: tuple[str, ...] | None = None) -> dict:
    """Check every file (or only `files`, the ones a caller reads) against the sha256 recorded when the
    checkpoint was saved; returns the manifest."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise TrainError(f"checkpoint {folder} is incomplete (no readable {MANIFEST_FILE})")
    for name in (MODEL_FILE, SCHEMA_FILE, CONFIG_FILE):
        if name not in manifest["sha256"]:
            raise TrainError(f"checkpoint {folder}: {MANIFEST_FILE} lists no {name}")
    for name, expected in manifest["sha256"].items():
        if files is not None and name not in files:
            continue
        file = folder / str(name)
        if not file.is_file():
            raise TrainError(f"checkpoint {folder} lacks {name}: use another checkpoint or retrain")
        if file_sha256(file) != expected:
            raise TrainError(f"checkpoint file {file} is damaged: its sha256 differs from the one recorded when "
                             "it was saved; use another checkpoint or retrain")
    return manifest


# ------------------------------------------------------------------------------------------- load
def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """Rebuild (model, schema, TrainConfig, folder) from a checkpoint's files, after checking the sha256 of
    the files it reads (weights, schema, config; not the optimizer state) against the manifest. The model is
    built on `device` (its random initialisation there, before the weights replace it, is fast on a GPU)."""
    folder = find_checkpoint(path)
    verify_checkpoint(folder, (MODEL_FILE, SCHEMA_FILE, CONFIG_FILE))
    raw_config = read_json_file(folder / CONFIG_FILE, "train config")
    if not isinstance(raw_config, dict):
        raise TrainError(f"{folder / CONFIG_FILE}: not a JSON object")
    raw_config.pop("global_step", None)
    config = TrainConfig.from_dict(raw_config)
    try:
        schema = parse_schema(read_json_file(folder / SCHEMA_FILE, "schema"), max_lens=config.max_lens)
    except SchemaError as exc:
        raise TrainError(f"{folder / SCHEMA_FILE}: {exc}") from exc
    with torch.device(device):
        model = build_model(config.model, schema, config.model_config)
    state = _load_safetensors(folder / MODEL_FILE)
    _check_state_fits(folder, state, model, config.model)
    model.load_state_dict(state)
    return model.to(device), schema, config, folder


def _check_state_fits(folder: Path, state: dict[str, torch.Tensor], model, name: str) -> None:
    """The weights must be the model the checkpoint's config and schema describe: a file of another model
    (or of the same model under other options or another schema) is named with its first differences."""
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    shapes = [(k, list(state[k].shape), list(expected[k].shape)) for k in sorted(state.keys() & expected.keys())
              if state[k].shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return
    saved_by = _saved_model_name(folder / MODEL_FILE)
    found = []
    if shapes:
        k, got, want = shapes[0]
        found.append(f"{k} is {got} in the file, {want} in {name!r}" + (f" (and {len(shapes) - 1} more shapes)"
                                                                        if len(shapes) > 1 else ""))
    if missing:
        found.append(f"{len(missing)} tensor(s) of {name!r} missing (first {missing[0]})")
    if unexpected:
        found.append(f"{len(unexpected)} tensor(s) {name!r} does not have (first {unexpected[0]})")
    whose = (f"model {name!r} under other options or another schema" if saved_by == name
             else f"saved by model {saved_by!r}, its config says {name!r}")
    raise TrainError(f"checkpoint {folder}: {MODEL_FILE} holds another model than its {CONFIG_FILE} and "
                     f"{SCHEMA_FILE} describe ({whose}): {'; '.join(found)}; keep a checkpoint's files together, "
                     "or retrain")


def _saved_model_name(path: Path) -> str:
    """The model name save_checkpoint wrote into the safetensors metadata ("unknown" without one)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("model", "unknown")


def load_train_state(folder: Path, model, optimizers) -> dict[str, Any]:
    """Put the model, the optimizers and the RNG back as `save_checkpoint` saved them in `folder`;
    returns the rest of the saved train state (history, global_step, ...)."""
    state = read_json_file(folder / STATE_FILE, "train state")
    tensors = _load_safetensors(folder / OPTIMIZER_FILE)
    raw_model(model).load_state_dict(_load_safetensors(folder / MODEL_FILE))
    optimizers.load_state_dict(_join_tensors(state["optimizer"], tensors))
    torch.set_rng_state(_join_tensors(state["rng"]["torch"], tensors))
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(_join_tensors(state["rng"]["cuda"], tensors))
    return state


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError (not importable by a stable name)
        raise TrainError(f"{path}: not a readable safetensors file ({exc}); use another checkpoint or "
                         "retrain") from exc
