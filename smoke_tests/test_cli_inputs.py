"""The inputs a new user gets wrong, through `pcvr_lib.cli.main`: data of another schema, an edited training
summary, another model's weights, one-class labels, lossy values, impossible sizes, paths that moved, and the
comparison commands' run numbers, output paths and noise files. Each ends in exit 2 with one line naming
what is wrong and the fix, or in a counted warning where the input is legal but loses something."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pcvr_lib.cli import main as cli_main
from pcvr_lib.compare import default_noise_path
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.train.checkpoint import file_sha256
from pcvr_lib.workloads.models import DEMO_SCHEMA
from smoke_tests.cli_runs import (
    MAX_LENS,
    ROWS,
    TRAIN,
    best_checkpoint,
    copy_of,
    demo_data,
    finished_run,
    one_error_line,
    run_summary,
)

ROOT = Path(__file__).resolve().parent.parent
ONLINE_SCHEMA = ROOT / "fixtures" / "online.schema.json"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    return finished_run(data, tmp_path_factory.mktemp("runs") / "base", "--steps", "2")


@pytest.fixture
def run_copy(run, tmp_path):
    return copy_of(run, tmp_path)


def _edited(data: Path, folder: Path, column: str, values) -> Path:
    """A copy of the data (its footer schema kept, its schema.json beside it) with one scalar column replaced."""
    table = pq.read_table(data)
    table = table.set_column(table.schema.get_field_index(column), column,
                             pa.array(values, type=table.schema.field(column).type))
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "d.parquet")
    shutil.copy(data.parent / "schema.json", folder / "schema.json")
    return folder / "d.parquet"


# ------------------------------------------------------------------------------------------- the data's schema
def test_data_of_another_schema_is_refused(run, data, tmp_path, capsys):
    other = generate_dataset(ONLINE_SCHEMA, rows=ROWS, out=tmp_path / "online" / "d.parquet", progress=False)
    named = ("holds data of another schema than", "user_int fid 1 vocab_size 5 vs 6",
             "first value the run's, second the data's")
    assert cli_main(["val", "--run-dir", str(run), "--data", str(other)]) == 2
    one_error_line(capsys, "val", str(other), "the checkpoint's schema", *named, "score data of the schema")
    assert cli_main(["infer", "--checkpoint", str(run), "--data", str(other), "--result-dir", str(tmp_path)]) == 2
    one_error_line(capsys, "infer", *named)
    assert cli_main(["train", *TRAIN, "--data", str(other), "--schema", str(DEMO_SCHEMA), "--run-dir",
                     str(tmp_path / "r"), "--steps", "1"]) == 2
    one_error_line(capsys, "train", f"--schema {DEMO_SCHEMA}", *named, "leave out --schema")
    assert not (tmp_path / "r").exists()  # refused before the run dir is made
    assert cli_main(["inspect", str(other), "--schema", str(DEMO_SCHEMA)]) == 2
    one_error_line(capsys, "inspect", *named)
    assert not (tmp_path / "predictions.json").exists()


# ------------------------------------------------------------------------------------------- the run dir
def test_summary_digests_are_cross_checked(run_copy, capsys):
    path = run_copy / "training_summary.json"
    summary = json.loads(path.read_text())
    summary["checkpoint_sha256"] = dict.fromkeys(summary["checkpoint_sha256"], "0" * 64)
    path.write_text(json.dumps(summary))
    for command in (["val", "--run-dir"], ["infer", "--checkpoint"]):
        assert cli_main([*command, str(run_copy)]) == 2
        one_error_line(capsys, command[0], f"{path}: the sha256 of", "it records differs from",
                       "the summary or the checkpoint changed after training")
    assert not (run_copy / "evaluation.json").exists() and not (run_copy / "predictions.json").exists()


def test_weights_of_another_model_under_a_valid_digest(run_copy, data, tmp_path, capsys):
    other = tmp_path / "other"
    assert cli_main(["train", "--model", "onetrans", "--max-lens", MAX_LENS, "--batch-size", "32", "--model-config",
                     '{"vocab_cap": 32}', "--log-every", "0", "--data", str(data), "--run-dir", str(other),
                     "--steps", "1"]) == 0
    folder = best_checkpoint(run_copy)
    shutil.copy(best_checkpoint(other) / "model.safetensors", folder / "model.safetensors")
    manifest = json.loads((folder / "checkpoint.json").read_text())
    manifest["sha256"]["model.safetensors"] = file_sha256(folder / "model.safetensors")
    (folder / "checkpoint.json").write_text(json.dumps(manifest))
    summary = run_summary(run_copy)
    summary["checkpoint_sha256"] = manifest["sha256"]
    (run_copy / "training_summary.json").write_text(json.dumps(summary))
    for command in (["val", "--run-dir"], ["infer", "--checkpoint"]):
        assert cli_main([*command, str(run_copy)]) == 2
        one_error_line(capsys, command[0], "model.safetensors holds another model than its train_config.json",
                       "saved by model 'onetrans', its config says 'baseline'", "in the file,", "missing (first ")


def test_val_never_writes_over_another_run(run, run_copy, tmp_path, capsys):
    assert cli_main(["val", "--run-dir", str(run_copy)]) == 0
    before = (run_copy / "evaluation.json").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(run, other)
    assert cli_main(["val", "--run-dir", str(run_copy), "--checkpoint", str(other)]) == 2
    one_error_line(capsys, "val", f"is not a checkpoint of --run-dir {run_copy}, which holds another run",
                   f"leave out --run-dir (the files go to {other})")
    assert (run_copy / "evaluation.json").read_bytes() == before
    fresh = tmp_path / "fresh"  # an empty (or new) folder takes another run's evaluation
    assert cli_main(["val", "--run-dir", str(fresh), "--checkpoint", str(other)]) == 0
    assert json.loads((fresh / "evaluation.json").read_text())["checkpoint_path"].startswith(str(other))


def test_data_path_is_stored_absolute(data, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "work"
    shutil.copytree(data.parent, folder)
    monkeypatch.chdir(folder)
    assert cli_main(["train", *TRAIN, "--data", "d.parquet", "--run-dir", "r", "--steps", "1"]) == 0
    assert run_summary(folder / "r")["data_path"] == str(folder / "d.parquet")
    monkeypatch.chdir(tmp_path)  # another folder: val finds the data the model was trained on
    assert cli_main(["val", "--run-dir", str(folder / "r")]) == 0
    capsys.readouterr()
    (folder / "d.parquet").rename(folder / "moved.parquet")
    assert cli_main(["val", "--run-dir", str(folder / "r")]) == 2
    one_error_line(capsys, "val", f"{folder / 'd.parquet'}", "is not there (moved or deleted): pass --data FILE")


# ------------------------------------------------------------------------------------------- labels, values
def test_one_class_holdout_has_no_auc(data, tmp_path, capsys):
    negative = _edited(data, tmp_path / "neg", "label_type", np.ones(ROWS, dtype=np.int32))
    run_dir = tmp_path / "r"
    assert cli_main(["train", *TRAIN, "--data", str(negative), "--run-dir", str(run_dir), "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert "holdout AUC undefined" in out and "AUC=0.5" not in out
    assert "warning: holdout AUC is undefined: all 24 scored rows are negative (no positive label)" in err
    summary = run_summary(run_dir)
    assert summary["validation_metrics"]["auc"] is None and summary["best_checkpoint"].endswith("AUC=undefined")
    assert any("AUC is undefined" in w for w in summary["data_warnings"])
    assert cli_main(["val", "--run-dir", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert ": AUC undefined logloss" in out and "AUC is undefined: all 24 scored rows are negative" in err
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert evaluation["metrics"]["auc"] is None and evaluation["metrics"]["auc_ci"]["low"] is None


def test_null_labels_and_nan_dense_values_are_counted(data, tmp_path, capsys):
    labels = pq.read_table(data).column("label_type").to_pylist()
    labels[::10] = [None] * len(labels[::10])
    nulls = _edited(data, tmp_path / "nulls", "label_type", labels)
    run_dir = tmp_path / "r"
    assert cli_main(["train", *TRAIN, "--data", str(nulls), "--run-dir", str(run_dir), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    said = f"warning: {nulls}: 12 of 120 rows have a null label_type, read as negative (not converted)"
    assert said in err and "dense values are NaN or infinite, read as missing, in " in err
    assert said.removeprefix("warning: ") in run_summary(run_dir)["data_warnings"]
    assert cli_main(["val", "--run-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert said in err and "NaN or infinite" not in err  # training said it; scoring reads them the same way


def test_negative_request_timestamps_are_refused(run, data, tmp_path, capsys):
    ts = pq.read_table(data).column("timestamp").to_numpy().copy()
    ts[7] = -ts[7]
    bad = _edited(data, tmp_path / "neg_ts", "timestamp", ts)
    wanted = (f"{bad}: column 'timestamp': 1 negative request timestamp(s) (first in row 7: {ts[7]})",
              "fix or drop those rows")
    assert cli_main(["train", *TRAIN, "--data", str(bad), "--run-dir", str(tmp_path / "r"), "--steps", "1"]) == 2
    one_error_line(capsys, "train", *wanted)
    assert cli_main(["val", "--run-dir", str(tmp_path / "v"), "--checkpoint", str(run), "--data", str(bad)]) == 2
    one_error_line(capsys, "val", *wanted)
    assert cli_main(["infer", "--checkpoint", str(run), "--data", str(bad), "--result-dir", str(tmp_path)]) == 2
    one_error_line(capsys, "infer", *wanted)


# ------------------------------------------------------------------------------------------- schemas, sizes
@pytest.mark.parametrize("vocab", [10**30, 2**63, 2**63 - 1, 2**31])
def test_generate_refuses_vocabularies_train_cannot_take(vocab, tmp_path, capsys):
    raw = json.loads(Path(DEMO_SCHEMA).read_text())
    raw["user_int"][0][1] = vocab
    (tmp_path / "s.json").write_text(json.dumps(raw))
    assert cli_main(["generate", "--schema", str(tmp_path / "s.json"), "--rows", "10", "--out",
                     str(tmp_path / "d.parquet")]) == 2
    one_error_line(capsys, "generate", f"user_int fid 1: vocab_size {vocab} is over 2,147,483,647 (2**31 - 1")


def test_the_largest_vocabulary_generates_and_trains(tmp_path):
    raw = json.loads(Path(DEMO_SCHEMA).read_text())
    raw["user_int"][0][1] = 2**31 - 1
    (tmp_path / "s.json").write_text(json.dumps(raw))
    out = tmp_path / "g" / "d.parquet"
    assert cli_main(["generate", "--schema", str(tmp_path / "s.json"), "--rows", str(ROWS), "--out", str(out)]) == 0
    assert cli_main(["train", *TRAIN, "--data", str(out), "--run-dir", str(tmp_path / "r"), "--steps", "1"]) == 0


def test_generate_estimates_memory_before_a_huge_table(tmp_path, capsys):
    t0 = time.perf_counter()
    assert cli_main(["generate", "--schema", str(DEMO_SCHEMA), "--rows", "100000000", "--out",
                     str(tmp_path / "d.parquet")]) == 2
    assert time.perf_counter() - t0 < 10
    one_error_line(capsys, "generate", "--rows 100,000,000: generating needs about", "TB of memory",
                   "per row of this schema", "available", "use at most --rows", "--multiplier")
    assert not (tmp_path / "d.parquet").exists()


def test_schema_without_sequences_generates_but_no_model_takes_it(tmp_path, capsys):
    raw = json.loads(Path(DEMO_SCHEMA).read_text())
    raw["seq"] = {}
    (tmp_path / "s.json").write_text(json.dumps(raw))
    out = tmp_path / "g" / "d.parquet"
    assert cli_main(["generate", "--schema", str(tmp_path / "s.json"), "--rows", "30", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["train", "--model", "baseline", "--data", str(out), "--run-dir", str(tmp_path / "r")]) == 2
    one_error_line(capsys, "train", "model 'baseline' needs at least one sequence domain", "\"seq\" is empty")


def test_generate_schema_folder_and_cache_env(tmp_path, capsys, monkeypatch):
    assert cli_main(["generate", "--schema", str(tmp_path), "--rows", "10"]) == 2
    one_error_line(capsys, "generate", f"schema path {tmp_path} is a folder, not a schema JSON file")
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("PCVR_CACHE_DIR", str(afile))
    assert cli_main(["generate", "--schema", str(DEMO_SCHEMA), "--rows", "10"]) == 2
    line = one_error_line(capsys, "generate", f"PCVR_CACHE_DIR={afile}: {afile} is a file, not a folder",
                          "point PCVR_CACHE_DIR at a folder or unset it")
    assert "--cache-dir" not in line


def test_rank_mixer_names_the_option(data, tmp_path, capsys):
    assert cli_main(["train", "--model", "baseline", "--max-lens", MAX_LENS, "--model-config",
                     '{"vocab_cap": 64, "d_model": 72}', "--data", str(data), "--run-dir", str(tmp_path / "r")]) == 2
    one_error_line(capsys, "train", "RankMixer mixes 16 tokens (queries_per_domain 2 x 4 domains + 8 field tokens",
                   "model option d_model must be a multiple of 16, got 72",
                   "pass --model-config '{\"d_model\": 80}' (the nearest multiples: 64 or 80)")


def test_batch_sizes_the_file_changes_are_said(data, tmp_path, capsys):
    assert cli_main(["train", *TRAIN[:-4], "--batch-size", "1000", "--log-every", "0", "--data", str(data),
                     "--run-dir", str(tmp_path / "big"), "--steps", "1"]) == 0
    said = ("--batch-size 1000 is more than the 96 training rows of the largest row group of "
            f"{data}: a batch never spans row groups, so every step trains on at most 96 rows")
    assert f"warning: {said}" in capsys.readouterr().err
    assert said in run_summary(tmp_path / "big")["data_warnings"]
    assert cli_main(["train", *TRAIN[:-4], "--batch-size", "40", "--log-every", "0", "--data", str(data),
                     "--run-dir", str(tmp_path / "tails"), "--steps", "1"]) == 0
    assert ("note: --batch-size 40: 2 of 3 batches hold 40 rows, 1 (row groups' last) 16: a batch never spans row "
            "groups") in capsys.readouterr().err


def test_inspect_errors_have_the_command_prefix(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / "none.parquet"), "--schema", str(DEMO_SCHEMA)]) == 2
    one_error_line(capsys, "inspect", f"parquet file not found: {tmp_path / 'none.parquet'}")
    assert cli_main(["inspect", str(tmp_path / "none.parquet"), "--schema", str(tmp_path)]) == 2
    one_error_line(capsys, "inspect", "is a folder, not a schema JSON file")


# ------------------------------------------------------------------------------------------- pcvr diff
def _stored_run(path: Path, cpu: str = "Intel(R) Xeon(R) Processor", cpus: int = 2) -> Path:
    bench = {"group": "data", "name": "test_x[a=1]", "fullname": "perf_tests/test_x.py::test_x[a=1]",
             "param": "a=1", "stats": {"median": 1.0, "min": 1.0}, "extra_info": {"stat": "cpu"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine_info": {"cpu": {"brand_raw": cpu}, "cpu_count": cpus, "gpu": None},
                                "commit_info": {"id": "abc"}, "benchmarks": [bench]}))
    return path


def test_diff_run_numbers_and_json_path(tmp_path, capsys):
    storage = tmp_path / "store"
    first = _stored_run(storage / "Linux-x" / "0001_aaa.json")
    tenth = _stored_run(storage / "Linux-x" / "0010_bbb.json")
    for wanted, path in (("1", first), ("0001", first), ("10", tenth)):
        assert cli_main(["diff", wanted, str(tenth), "--storage", str(storage)]) == 0
        assert capsys.readouterr().out.startswith(f"pcvr diff: {path} -> ")
    assert cli_main(["diff", "2", str(tenth), "--storage", str(storage)]) == 2
    assert "no stored run matches '2'" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli_main(["diff", "1", str(tenth), "--storage", str(storage), "--json", str(afile / "x.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"pcvr diff: error: --json {afile / 'x.json'}: {afile} is a file, not a "
                                         "folder; choose another path")


def test_diff_and_noise_read_gzipped_runs(tmp_path, capsys):
    plain = _stored_run(tmp_path / "a.json")
    other = _stored_run(tmp_path / "b.json")
    other.write_text(json.dumps({**json.loads(other.read_text()), "datetime": "2026-12-06T20:00:00"}))  # another run
    packed = tmp_path / "b.json.gz"
    packed.write_bytes(gzip.compress(other.read_bytes()))
    assert cli_main(["diff", str(plain), str(other)]) == 0
    from_plain = capsys.readouterr().out.replace(str(other), "NEW")
    assert cli_main(["diff", str(plain), str(packed)]) == 0
    assert capsys.readouterr().out.replace(str(packed), "NEW") == from_plain
    noise = tmp_path / "noise.json"
    assert cli_main(["noise", "--from", str(plain), str(packed), "--out", str(noise)]) == 0
    assert json.loads(noise.read_text())["sources"] == [str(plain), str(packed)]
    fake = tmp_path / "c.json.gz"
    fake.write_text(other.read_text())  # plain JSON under a .gz name
    assert cli_main(["diff", str(plain), str(fake)]) == 2
    assert f"{fake}: not a gzip file" in capsys.readouterr().err


def test_noise_files_are_keyed_by_cpu(tmp_path, capsys, monkeypatch):
    committed = sorted((ROOT / ".benchmarks").glob("*/noise-*.json"))
    assert len(committed) >= 2
    for path in committed:  # each committed noise file is where its own machine looks for it
        machine = json.loads(path.read_text())["machine"]
        gpu = None if machine["gpu"] == "no GPU" else {"name": machine["gpu"]}
        run = {"machine_info": {"cpu": {"brand_raw": machine["cpu"]}, "cpu_count": int(machine["cpus"]), "gpu": gpu}}
        assert default_noise_path(run, ROOT / ".benchmarks") == path
    monkeypatch.chdir(ROOT)  # where `make compare` runs diff: .benchmarks/ of the checkout
    same = _stored_run(tmp_path / "a.json"), _stored_run(tmp_path / "b.json")
    assert cli_main(["diff", *map(str, same)]) == 0
    assert "thresholds from the noise floor of 3 runs" in capsys.readouterr().out
    other = (_stored_run(tmp_path / "c.json", cpu="AMD EPYC 9654 96-Core Processor", cpus=4),
             _stored_run(tmp_path / "d.json", cpu="AMD EPYC 9654 96-Core Processor", cpus=4))
    assert cli_main(["diff", *map(str, other)]) == 0
    out, err = capsys.readouterr()
    assert "thresholds from the floors only (no noise file for this machine)" in out
    assert ("pcvr diff: no noise file for this machine (AMD EPYC 9654 96-Core Processor, 4 CPUs, no GPU): no "
            ".benchmarks/cpu/noise-amd-epyc-9654-96-core-processor-4cpus.json; .benchmarks/cpu holds noise of: "
            "Intel(R) Xeon(R) Processor, 2 CPUs, no GPU (noise-intel-xeon-processor-2cpus.json)") in err
