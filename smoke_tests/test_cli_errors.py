"""The command line keeps its word: every case a new user hit, run in-process through
`pcvr_lib.cli.main`. Bad input ends in exit 2 and one line `pcvr <command>: error: ...` naming the file or
option at fault, before any long work; never a traceback, a hang or a wrong number."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pcvr_lib.train as trainer
from pcvr_lib.cli import COMMANDS, build_parser
from pcvr_lib.cli import main as cli_main
from pcvr_lib.train import commands, evaluate, loop
from pcvr_lib.workloads.models import DEMO_SCHEMA
from smoke_tests.cli_runs import (
    ROWS,
    TRAIN,
    best_checkpoint,
    copy_of,
    demo_data,
    finished_run,
    one_error_line,
    without_notices,
)

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """A finished run: 3 steps, checkpoints at steps 2 and 3."""
    return finished_run(data, tmp_path_factory.mktemp("runs") / "base", "--steps", "3", "--eval-every", "2")


@pytest.fixture
def run_copy(run, tmp_path):
    return copy_of(run, tmp_path)


# ------------------------------------------------------------------------------------- the boundary
def test_version_and_debug(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli_main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("pcvr 0.")
    assert cli_main(["val", "--run-dir", str(tmp_path)]) == 2
    one_error_line(capsys, "val", "no complete checkpoint under", str(tmp_path))
    assert cli_main(["val", "--run-dir", str(tmp_path), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "TrainError" in err and err.strip().endswith("(run `pcvr train` first)")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "--model", "baseline"])
    assert exc.value.code == 2
    one_error_line(capsys, "train", "required", "--data", "see pcvr train --help")


def test_every_flag_has_help():
    for command in COMMANDS:
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        missing = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert not missing, f"pcvr {command}: flags without help: {missing}"


def test_unexpected_errors_are_labelled_bugs(capsys, monkeypatch, data, tmp_path):
    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "train", boom)
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("pcvr train: internal error RuntimeError: a bug (a bug; rerun with --debug for the "
                           "traceback and report it)")


# ------------------------------------------------------------------------------------------ generate
def _schema_variants(tmp_path: Path) -> dict[str, tuple[str, str]]:
    raw = json.loads(Path(DEMO_SCHEMA).read_text())

    def changed(fn):
        copy = json.loads(json.dumps(raw))
        fn(copy)
        return json.dumps(copy)

    def dup(c):
        c["user_int"][1][0] = c["user_int"][0][0]

    return {
        "wrong type": (changed(lambda c: c["user_int"][0].__setitem__(1, "five")), "vocab_size must be an integer"),
        "negative vocab": (changed(lambda c: c["user_int"][0].__setitem__(1, -5)), "got -5"),
        "duplicate fid": (changed(dup), "duplicate fid"),
        "missing key": (changed(lambda c: c.pop("seq")), "missing key(s) ['seq']"),
        "not JSON": ("{", "not valid JSON"),
        "empty": ("", "not valid JSON"),
    }


@pytest.mark.parametrize("case", ["wrong type", "negative vocab", "duplicate fid", "missing key", "not JSON", "empty"])
def test_generate_bad_schema(case, tmp_path, capsys):
    text, message = _schema_variants(tmp_path)[case]
    schema = tmp_path / "schema.json"
    schema.write_text(text)
    assert cli_main(["generate", "--schema", str(schema), "--rows", "5", "--out", str(tmp_path / "o.parquet")]) == 2
    one_error_line(capsys, "generate", str(schema), message)
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("args, message", [
    (["--schema", "no/such/schema.json"], "schema file not found: no/such/schema.json"),
    (["--rows", "0"], "--rows must be >= 1, got 0"),
    (["--multiplier", "0"], "--multiplier must be >= 1, got 0"),
    (["--row-group-size", "0"], "--row-group-size must be >= 1, got 0"),
    (["--out", "{exists}"], "exists; pass --force"),
    (["--out", "{file}/x.parquet"], "is a file, not a folder"),
    (["--out", "{dir}"], "is a folder; give the parquet file's path"),
])
def test_generate_bad_arguments(args, message, tmp_path, capsys):
    (tmp_path / "exists").write_text("x")
    (tmp_path / "file").write_text("x")
    args = [a.format(exists=tmp_path / "exists", file=tmp_path / "file", dir=tmp_path) for a in args]
    if "--schema" not in args:
        args = ["--schema", str(DEMO_SCHEMA), *args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "new.parquet")]
    assert cli_main(["generate", "--rows", "5", *args]) == 2
    one_error_line(capsys, "generate", message)
    assert not (tmp_path / "new.parquet").exists()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FAST
@given(value=json_values)
def test_generate_random_json_schema(value, tmp_path, capsys):
    schema = tmp_path / "random.json"
    schema.write_text(json.dumps(value))
    out = tmp_path / "o.parquet"
    assert cli_main(["generate", "--schema", str(schema), "--rows", "5", "--out", str(out)]) == 2
    one_error_line(capsys, "generate", str(schema))
    assert not out.exists()


@FAST
@given(group=st.sampled_from(["user_int", "item_int", "user_dense"]), index=st.integers(0, 9),
       field=st.integers(0, 2), value=st.none() | st.text(max_size=4) | st.integers(-(10**3), -1) | st.lists(
           st.integers(), max_size=2))
def test_generate_schema_with_one_bad_value(group, index, field, value, tmp_path, capsys):
    raw = json.loads(Path(DEMO_SCHEMA).read_text())
    entry = raw[group][index]
    entry[min(field, len(entry) - 1)] = value  # a fid, vocab size or dim that cannot be right
    schema = tmp_path / "one_bad.json"
    schema.write_text(json.dumps(raw))
    assert cli_main(["generate", "--schema", str(schema), "--rows", "5", "--out", str(tmp_path / "o.parquet")]) == 2
    one_error_line(capsys, "generate", str(schema), group)


# ------------------------------------------------------------------------------------- damaged inputs
def test_parquet_damaged_mid_file_names_the_file(run, data, tmp_path, capsys):
    bad = tmp_path / "damaged.parquet"
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 4096] = bytes(4096)  # the footer stays intact: the file still opens
    bad.write_bytes(bytes(raw))
    code = cli_main(["infer", "--checkpoint", str(run), "--data", str(bad), "--result-dir", str(tmp_path / "res")])
    assert code == 2
    one_error_line(capsys, "infer", str(bad))
    assert not (tmp_path / "res" / "predictions.json").exists()


@FAST
@given(payload=st.binary(max_size=2048))
def test_random_bytes_as_parquet(payload, run, tmp_path, capsys):
    bad = tmp_path / "random.parquet"
    bad.write_bytes(payload)
    assert cli_main(["infer", "--checkpoint", str(run), "--data", str(bad), "--result-dir", str(tmp_path)]) == 2
    one_error_line(capsys, "infer", str(bad))


@pytest.mark.parametrize("damage", ["truncated", "empty", "bad header", "4 KB overwritten"])
@pytest.mark.parametrize("command", ["val", "infer"])
def test_damaged_checkpoint_is_refused(damage, command, run_copy, capsys):
    model = best_checkpoint(run_copy) / trainer.MODEL_FILE
    raw = bytearray(model.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 3]
    elif damage == "empty":
        raw = bytearray()
    elif damage == "bad header":
        raw[:8] = b"\xff" * 8
    else:
        middle = len(raw) // 2
        raw[middle:middle + 4096] = os.urandom(4096)
    model.write_bytes(bytes(raw))
    args = ["--run-dir", str(run_copy)] if command == "val" else ["--checkpoint", str(run_copy)]
    assert cli_main([command, *args]) == 2
    one_error_line(capsys, command, str(model), "is damaged", "sha256")
    assert not (run_copy / "predictions.json").exists() and not (run_copy / "evaluation.json").exists()


def test_val_checks_the_files_it_reads_and_resume_checks_the_optimizer_state(run_copy, data, capsys):
    """val and infer read the weights, the schema and the config (each checked against its sha256), not
    the optimizer state: a damaged state file does not stop them, and --resume, which reads it, refuses it."""
    last = trainer.complete_checkpoints(run_copy)[-1][1]
    state = last / trainer.OPTIMIZER_FILE
    assert state.is_file()
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    assert cli_main(["val", "--run-dir", str(run_copy), "--checkpoint", str(last)]) == 0
    capsys.readouterr()
    code = cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(run_copy), "--resume",
                     "--steps", "5", "--eval-every", "2"])
    assert code == 2
    one_error_line(capsys, "train", str(state), "is damaged", "sha256")


@FAST
@given(payload=st.binary(max_size=4096))
def test_random_bytes_as_checkpoint(payload, run, tmp_path, capsys):
    """Random bytes with a manifest that matches them (as an older or hand-made checkpoint would have):
    the safetensors reader's refusal becomes the one line."""
    folder = tmp_path / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(best_checkpoint(run), folder)
    (folder / trainer.MODEL_FILE).write_bytes(payload)
    manifest = json.loads((folder / trainer.MANIFEST_FILE).read_text())
    manifest["sha256"][trainer.MODEL_FILE] = trainer.file_sha256(folder / trainer.MODEL_FILE)
    (folder / trainer.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert cli_main(["infer", "--checkpoint", str(folder), "--result-dir", str(tmp_path / "res")]) == 2
    one_error_line(capsys, "infer", str(folder / trainer.MODEL_FILE))


def test_incomplete_checkpoint_folders_are_skipped(run_copy, capsys):
    (run_copy / "training_summary.json").unlink()  # as after an interrupted run
    newest = _checkpoint_named(run_copy, 3)
    (newest / trainer.MANIFEST_FILE).unlink()  # an unfinished save
    assert trainer.find_checkpoint(run_copy).name.startswith("global_step2.")
    assert cli_main(["val", "--run-dir", str(run_copy)]) == 0
    assert json.loads((run_copy / "evaluation.json").read_text())["checkpoint_path"].startswith(
        str(run_copy / "global_step2."))
    assert cli_main(["val", "--checkpoint", str(newest)]) == 2
    one_error_line(capsys, "val", str(newest), "is incomplete")


def _checkpoint_named(run_dir: Path, step: int) -> Path:
    return next(p for p in run_dir.iterdir() if p.name.startswith(f"global_step{step}."))


# -------------------------------------------------------------------------------- unwritable outputs
def test_unwritable_outputs_fail_before_the_work(run, data, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")

    def no_work(*args, **kwargs):
        raise AssertionError("the work started although the output cannot be written")

    monkeypatch.setattr(loop, "_train", no_work)
    monkeypatch.setattr(evaluate, "predict_batches", no_work)
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(blocker / "run")]) == 2
    one_error_line(capsys, "train", "--run-dir", f"{blocker} is a file, not a folder")
    assert cli_main(["infer", "--checkpoint", str(run), "--result-dir", str(blocker / "out")]) == 2
    one_error_line(capsys, "infer", "--result-dir", str(blocker))
    assert cli_main(["smoke", "--models", "baseline", "--seeds", "1", "--out", str(blocker / "s")]) == 2
    one_error_line(capsys, "smoke", "--out", str(blocker))
    assert cli_main(["plot-diagnostics", "--run", str(run), "--output-dir", str(blocker / "f")]) == 2
    one_error_line(capsys, "plot-diagnostics")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_locked_folder(run, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert cli_main(["infer", "--checkpoint", str(run), "--result-dir", str(locked)]) == 2
        one_error_line(capsys, "infer", f"--result-dir {locked} is not writable")
    finally:
        locked.chmod(0o700)


# ---------------------------------------------------------------------------------------- run dirs
def test_reused_run_dir_is_refused_then_overwritten(run_copy, data, capsys):
    old = sorted(p.name for p in run_copy.iterdir() if p.name.startswith("global_step"))
    args = ["train", *TRAIN, "--data", str(data), "--run-dir", str(run_copy), "--steps", "1", "--seed", "9"]
    assert cli_main(args) == 2
    one_error_line(capsys, "train", str(run_copy), "is not empty", "--overwrite", "--resume")
    assert cli_main([*args, "--overwrite"]) == 0
    now = sorted(p.name for p in run_copy.iterdir() if p.name.startswith("global_step"))
    assert len(now) == 1 and now[0].startswith("global_step1.") and not set(now) & set(old)
    assert not (run_copy / "evaluation.json").exists()  # the old run's evaluation went with it
    assert cli_main(["val", "--run-dir", str(run_copy)]) == 0
    evaluation = json.loads((run_copy / "evaluation.json").read_text())
    assert evaluation["checkpoint_path"] == str(run_copy / now[0] / trainer.MODEL_FILE)


def test_val_uses_the_checkpoint_the_summary_names(run_copy):
    named = best_checkpoint(run_copy)
    stray = run_copy / "global_step99.AUC=0.890000"  # a later-looking checkpoint of another run
    shutil.copytree(named, stray)
    assert cli_main(["val", "--run-dir", str(run_copy)]) == 0
    evaluation = json.loads((run_copy / "evaluation.json").read_text())
    assert evaluation["checkpoint_path"] == str(named / trainer.MODEL_FILE)


def test_resume_continues_exactly(data, tmp_path):
    """3 steps straight == 2 steps, then --resume to 3 (optimizer, RNG and data order carried over)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train", *TRAIN, "--data", str(data), "--eval-every", "2"]
    assert cli_main([*common, "--run-dir", str(straight), "--steps", "3"]) == 0
    assert cli_main([*common, "--run-dir", str(resumed), "--steps", "2"]) == 0
    assert cli_main([*common, "--run-dir", str(resumed), "--steps", "3", "--resume"]) == 0
    a = json.loads((straight / "training_summary.json").read_text())
    b = json.loads((resumed / "training_summary.json").read_text())
    assert b["resumed_from"].startswith("global_step2.") and a["losses"] == b["losses"]
    assert a["validation_metrics"]["auc"] == b["validation_metrics"]["auc"]
    assert [Path(c).name for c in a["checkpoints"]] == [Path(c).name for c in b["checkpoints"]]


def test_resume_refuses_other_options(run_copy, data, capsys):
    args = ["train", *TRAIN, "--data", str(data), "--run-dir", str(run_copy), "--resume"]
    assert cli_main([*args, "--steps", "5", "--dense-lr", "0.5"]) == 2
    one_error_line(capsys, "train", "--resume", "dense_lr")
    assert cli_main([*args, "--steps", "3"]) == 2
    one_error_line(capsys, "train", "already at step 3")


def test_ctrl_c_says_where_it_stopped(data, tmp_path, capsys, monkeypatch):
    real = loop.train_step
    calls = {"n": 0}

    def interrupted_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", interrupted_at_step_3)
    run_dir = tmp_path / "stopped"
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(run_dir), "--steps", "4",
                     "--eval-every", "2"]) == 130
    err = "\n".join(without_notices(capsys.readouterr().err))
    good = _checkpoint_named(run_dir, 2)
    assert err == (f"pcvr train: interrupted: training stopped after step 2 of 4; last good checkpoint {good}; "
                   "continue with the same command plus --resume")
    assert not any(p.name.startswith(trainer.TMP_PREFIX) for p in run_dir.iterdir())


def test_non_finite_scores_are_an_error(run_copy, tmp_path, capsys):
    model, schema, config, folder = trainer.load_checkpoint(run_copy)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and name.endswith("bias"):
                param.fill_(float("nan"))  # a model that scores NaN
    broken = trainer.save_checkpoint(tmp_path / "nan_run", model, schema, config, step=1, auc=0.5)
    assert cli_main(["infer", "--checkpoint", str(broken), "--result-dir", str(tmp_path / "res")]) == 2
    line = one_error_line(capsys, "infer", f"{ROWS} of {ROWS} scores are not finite", str(broken))
    assert "nothing was written" in line and not (tmp_path / "res" / "predictions.json").exists()
    assert cli_main(["val", "--checkpoint", str(broken), "--run-dir", str(tmp_path / "v")]) == 2
    one_error_line(capsys, "val", "scores are not finite")


# ------------------------------------------------------------------------------------ unknown names
@pytest.mark.parametrize("flag, value, valid", [
    ("--max-lens", "seq_a:6,seq_z:8", "seq_a, seq_b, seq_c, seq_d"),
    ("--model", "nope", "baseline"),
    ("--dense-optimizer", "sgd", "adamw"),
    ("--loader-preset", "fast", "opt-augment"),
    ("--split", "random", "timestamp_auto"),
])
def test_unknown_names_list_the_valid_ones(flag, value, valid, data, tmp_path, capsys):
    args = ["train", *TRAIN, "--data", str(data), "--run-dir", str(tmp_path / "r"), flag, value]
    assert cli_main(args) == 2
    one_error_line(capsys, "train", repr(value.split(",")[-1].split(":")[0]), valid)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_smoke_unknown_model(capsys, tmp_path):
    assert cli_main(["smoke", "--models", "nope", "--out", str(tmp_path)]) == 2
    one_error_line(capsys, "smoke", "'nope'", "baseline")


# ------------------------------------------------------------------------------ batch size and preset
def test_batch_size_means_what_it_says_and_presets_reach_training(run, data, tmp_path):
    summary = json.loads((run / "training_summary.json").read_text())
    # 3 steps of --batch-size 32 on the training side: 96 rows, not 21-29 per batch
    assert summary["telemetry"]["rows"] == 3 * 32
    run_dir = tmp_path / "augmented"
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(run_dir), "--steps", "1",
                     "--loader-preset", "augment", "--no-strict-time-filter"]) == 0
    loader = json.loads((run_dir / "training_telemetry.json").read_text())["metadata"]["loader"]
    assert loader["preset"] == "augment" and loader["augmentations"] and loader["strict_time_filter"] is False
    saved = json.loads((best_checkpoint(run_dir) / trainer.CONFIG_FILE).read_text())
    assert saved["loader_preset"] == "augment" and saved["strict_time_filter"] is False
    assert np.isfinite(json.loads((run_dir / "training_summary.json").read_text())["validation_metrics"]["auc"])


# ------------------------------------------------------------------------------------------- progress
def test_training_progress_off_a_terminal(data, tmp_path, capsys):
    """Logs get plain lines (no bar): one before step 1, then per --log-every with rate and ETA."""
    args = ["train", *TRAIN[:-2], "--log-every", "2", "--data", str(data), "--run-dir", str(tmp_path / "r"),
            "--steps", "3"]
    assert cli_main(args) == 0
    lines = without_notices(capsys.readouterr().err)
    assert lines[0].startswith("train: baseline on ") and "steps 1..3 of 32 rows" in lines[0]
    assert [line.split()[1] for line in lines[1:-1]] == ["1/3", "2/3", "3/3"]
    assert all(" rows/s ETA " in line and "loss" in line for line in lines[1:-1])
    assert lines[-1].startswith("validated after step 3: holdout AUC ") and "saved global_step3." in lines[-1]
    assert not any("\r" in line or "%|" in line for line in lines)


def test_disk_errors_are_not_blamed_on_the_data(data, tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "r" / "x"))

    monkeypatch.setattr(loop, "save_checkpoint", disk_full)
    assert cli_main(["train", *TRAIN, "--data", str(data), "--run-dir", str(tmp_path / "r"), "--steps", "1"]) == 2
    line = one_error_line(capsys, "train", f"{tmp_path / 'r' / 'x'}: no space left on device")
    assert str(data) not in line
