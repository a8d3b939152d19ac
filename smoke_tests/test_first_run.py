"""The first run: `pcvr train --quick` and README's first-run commands, progress on any terminal, the
checkpoint retention (best and last; all on request) and what a checkpoint stores."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shlex
import struct
import sys
import termios
from pathlib import Path

import pytest
import torch

import pcvr_lib.train as trainer
from pcvr_lib import progress
from pcvr_lib.cli import build_parser
from pcvr_lib.cli import main as cli_main
from pcvr_lib.data.generate import generate_dataset
from pcvr_lib.train import TrainConfig, TrainError, checkpoint, loop, train, validate
from pcvr_lib.train.config import QUICK_MAX_LEN, QUICK_TABLE_CAP, QUICK_THREADS
from pcvr_lib.workloads.models import DEMO_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
ROWS = 120
MAX_LENS = "seq_a:6,seq_b:6,seq_c:6,seq_d:6"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_dataset(DEMO_SCHEMA, rows=ROWS, seed=5, out=tmp_path_factory.mktemp("data") / "d.parquet",
                            progress=False)


def _config(data, run_dir, **kw):
    base = dict(model="onetrans", data=str(data), run_dir=str(run_dir), max_lens=MAX_LENS, steps=4, batch_size=32,
                eval_batch_size=64, eval_every=1, model_config={"vocab_cap": 128}, seed=1)
    base.update(kw)
    return TrainConfig(**base)


def _on_disk(run_dir: Path) -> list[str]:
    return sorted((p.name for p in run_dir.iterdir() if checkpoint.CHECKPOINT_RE.match(p.name)),
                  key=lambda name: int(checkpoint.CHECKPOINT_RE.match(name).group(1)))


# ------------------------------------------------------------------------------------------ retention
def test_retention_keeps_the_best_and_the_last():
    names = ["global_step1.AUC=0.500000", "global_step2.AUC=0.700000", "global_step3.AUC=0.600000",
             "global_step4.AUC=0.650000"]
    assert checkpoint.retention(names, "best-and-last") == ([names[1], names[3]], names[1])
    assert checkpoint.retention(names, "all") == (names, names[1])
    assert checkpoint.retention(names[:3], "best-and-last") == ([names[1], names[2]], names[1])
    assert checkpoint.retention(names[:2], "best-and-last") == ([names[1]], names[1])  # the best is the last
    # equal AUCs: the newest is the best, so a run that stops improving keeps one checkpoint
    same = ["global_step1.AUC=0.600000", "global_step2.AUC=0.600000"]
    assert checkpoint.retention(same, "best-and-last") == ([same[1]], same[1])
    # an AUC that is not a number never wins; with none defined, the last is the best
    undefined = ["global_step1.AUC=nan", "global_step2.AUC=0.400000", "global_step3.AUC=nan"]
    assert checkpoint.retention(undefined, "best-and-last")[1] == undefined[1]
    assert checkpoint.retention([undefined[0], undefined[2]], "best-and-last") == ([undefined[2]], undefined[2])


def test_a_run_keeps_its_best_and_last_checkpoint(data, tmp_path, monkeypatch):
    """Four validations whose AUCs are planted: on disk stay the best (without optimizer state) and the last
    (with it); the summary names both, val uses the best, and --resume continues from the last."""
    planted = iter([0.55, 0.75, 0.60, 0.65, 0.70])
    real = loop.classification_metrics

    def metrics_with_planted_auc(*args, **kwargs):
        return dict(real(*args, **kwargs), auc=next(planted))

    monkeypatch.setattr(loop, "classification_metrics", metrics_with_planted_auc)
    run_dir = tmp_path / "run"
    summary = train(_config(data, run_dir))
    best, last = "global_step2.AUC=0.750000", "global_step4.AUC=0.650000"
    assert _on_disk(run_dir) == [best, last]
    assert [Path(c).name for c in summary["checkpoints"]] == [best, last]
    assert Path(summary["best_checkpoint"]).name == best and Path(summary["last_checkpoint"]).name == last
    assert summary["checkpoint_sha256"] == checkpoint.read_manifest(run_dir / best)["sha256"]
    assert not (run_dir / best / trainer.OPTIMIZER_FILE).exists() and not (run_dir / best / trainer.STATE_FILE).exists()
    assert (run_dir / last / trainer.OPTIMIZER_FILE).is_file()
    for name in (best, last):  # both complete: every file they list is there and matches its digest
        trainer.verify_checkpoint(run_dir / name)
    assert set(checkpoint.read_manifest(run_dir / best)["sha256"]) == {
        trainer.MODEL_FILE, trainer.SCHEMA_FILE, trainer.CONFIG_FILE}
    monkeypatch.undo()
    assert Path(validate(run_dir)["checkpoint_path"]).parent.name == best
    resumed = train(_config(data, run_dir, steps=5), resume=True)
    assert resumed["resumed_from"] == last
    assert len(resumed["losses"]) == 5 and resumed["losses"][:4] == summary["losses"]


def test_every_step_trains_in_train_mode_after_holdouts(data, tmp_path, monkeypatch):
    """A holdout scores in eval mode (dropout off); the loop switches back only when it has to, and every
    step, the first and each one after a holdout, runs in train mode."""
    modes, real_step = [], loop._step

    def spy(runner, batch, *args, **kwargs):
        modes.append(all(module.training for module in runner.modules()))
        return real_step(runner, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "_step", spy)
    train(_config(data, tmp_path / "run", eval_at_init=True, eval_every=1))
    assert modes == [True] * 4


def test_keep_all_keeps_every_checkpoint_with_its_state(data, tmp_path):
    run_dir = tmp_path / "all"
    summary = train(_config(data, run_dir, steps=3, keep_checkpoints="all"))
    names = _on_disk(run_dir)
    assert [n.split(".")[0] for n in names] == ["global_step1", "global_step2", "global_step3"]
    assert [Path(c).name for c in summary["checkpoints"]] == names
    assert all((run_dir / n / trainer.OPTIMIZER_FILE).is_file() for n in names)
    aucs = [checkpoint.checkpoint_auc(n) for n in names]
    assert Path(summary["best_checkpoint"]).name == names[max(range(3), key=lambda i: (aucs[i], i))]


def test_unknown_keep_and_bad_threads_are_refused(data, tmp_path):
    with pytest.raises(TrainError, match="unknown --keep-checkpoints 'some'; one of best-and-last, all"):
        train(_config(data, tmp_path / "a", keep_checkpoints="some"))
    with pytest.raises(TrainError, match="--threads must be an integer >= 1, got 0"):
        train(_config(data, tmp_path / "b", threads=0))


def test_threads_apply_while_training_and_scoring_and_are_restored(data, tmp_path, monkeypatch):
    """--threads holds while training; val and infer use the run's unless told otherwise; the caller's
    setting comes back after each."""
    from pcvr_lib.train import evaluate

    seen = []
    real = evaluate.predict_batches

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "predict_batches", recording)
    monkeypatch.setattr(evaluate, "predict_batches", recording)
    before = torch.get_num_threads()
    run_dir = tmp_path / "threads"
    train(_config(data, run_dir, steps=1, threads=2))
    validate(run_dir)
    validate(run_dir, threads=1)
    trainer.infer(run_dir, threads=3)
    assert seen == [2, 2, 1, 3] and torch.get_num_threads() == before


def test_sparse_optimizer_state_is_stored_as_its_rows_bit_for_bit():
    """A state tensor with few non-zero rows goes to disk as those rows and comes back bit for bit
    (a row holding only -0.0 is not a zero row); a dense one is stored whole."""
    table = torch.zeros(1000, 8)
    table[[3, 500, 999]] = torch.randn(3, 8)
    table[7, 2] = -0.0
    dense = torch.randn(10, 4)
    state = {"state": {0: {"sum": table, "step": torch.tensor(3.0)}, 1: {"exp_avg": dense}}, "param_groups": []}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = checkpoint._split_tensors(state, "optimizer", tensors, compact=True)
    assert tensors["optimizer.state.0.sum.rows"].tolist() == [3, 7, 500, 999]
    assert "optimizer.state.0.sum" not in tensors and "optimizer.state.1.exp_avg" in tensors
    back = checkpoint._join_tensors(json.loads(json.dumps(skeleton)), tensors)
    restored = back["state"][0]["sum"]
    assert restored.shape == table.shape and torch.equal(restored.view(torch.int32), table.view(torch.int32))
    assert torch.equal(back["state"][1]["exp_avg"], dense) and back["state"][0]["step"].item() == 3.0


# ------------------------------------------------------------------------------------------ --quick
class _Stop(Exception):
    """Raised by the stand-in for train(): the test only needs the config the command built."""


def test_quick_fills_in_the_reductions_the_command_leaves_open(data, tmp_path, monkeypatch):
    from pcvr_lib.train import commands

    seen = []

    def record(config, **kwargs):
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(commands, "train", record)

    def config_of(*extra):
        args = build_parser("train").parse_args(["train", "--model", "baseline", "--data", str(data),
                                                 "--run-dir", str(tmp_path / "q"), *extra])
        with pytest.raises(_Stop):
            commands.run_train(args)
        return seen[-1]

    quick = config_of("--quick")
    assert quick.model_config == {"vocab_cap": QUICK_TABLE_CAP} and quick.threads == QUICK_THREADS
    assert quick.max_lens == ",".join(f"seq_{d}:{QUICK_MAX_LEN}" for d in "abcd")
    given = config_of("--quick", "--table-cap", "64", "--max-lens", "seq_a:4", "--threads", "2")
    assert (given.model_config, given.max_lens, given.threads) == ({"vocab_cap": 64}, "seq_a:4", 2)
    assert config_of("--quick", "--model-config", '{"vocab_cap": 99}').model_config == {"vocab_cap": 99}
    plain = config_of()
    assert (plain.model_config, plain.max_lens, plain.threads) == ({}, None, None)
    assert config_of("--table-cap", "0").model_config == {"vocab_cap": None}


def test_table_cap_contradicting_model_config_is_refused(data, tmp_path, capsys):
    assert cli_main(["train", "--model", "baseline", "--data", str(data), "--run-dir", str(tmp_path / "r"),
                     "--table-cap", "64", "--model-config", '{"vocab_cap": 32}']) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pcvr train: error: --table-cap 64 contradicts --model-config's vocab_cap=32; give it once"


def test_help_states_the_expected_time_and_memory(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quick" in text and "Expected cost" in text
    assert re.search(r"with --quick about \d+ s in all", text) and re.search(r"\d+(\.\d+)? GB peak memory", text)


def _readme_first_run() -> list[list[str]]:
    """The commands of README's "First run" block (`pcvr ...` lines)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## First run\n.*?```\n(.*?)```", text, re.S)
    assert block, "README.md has no '## First run' section with a command block"
    commands = [shlex.split(line.split("#")[0]) for line in block.group(1).splitlines() if line.startswith("pcvr ")]
    assert [c[1] for c in commands] == ["generate", "train", "val", "infer"]
    return [c[1:] for c in commands]


def test_readme_first_run_commands_parse():
    for command in _readme_first_run():
        build_parser(command[0]).parse_args(command)
    train_args = next(c for c in _readme_first_run() if c[0] == "train")
    assert "--quick" in train_args


@pytest.mark.slow
def test_readme_first_run_runs(tmp_path, monkeypatch, capsys):
    """README's first run as written (the fixtures linked into a fresh folder): exit 0 for each command,
    and the run it describes (the quick reductions, one checkpoint)."""
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PCVR_CACHE_DIR", str(tmp_path / "cache"))
    for command in _readme_first_run():
        assert cli_main(command) == 0, command
    train_args = next(c for c in _readme_first_run() if c[0] == "train")
    run_dir = tmp_path / train_args[train_args.index("--run-dir") + 1]
    summary = json.loads((run_dir / trainer.SUMMARY_FILE).read_text())
    assert summary["model_config"]["vocab_cap"] == QUICK_TABLE_CAP and len(summary["checkpoints"]) == 1
    assert "scored 1000 rows" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ progress
def _pty_with_columns(columns: int):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w", buffering=1)


def _read_until_closed(master: int) -> str:
    """Everything written to the pseudo-terminal: one read may return only the first line (some kernels
    hand out one write per read), so read until the closed slave side reports EIO or end of file, or
    nothing more arrives within a second."""
    chunks = []
    try:
        while select.select([master], [], [], 1.0)[0]:
            chunk = os.read(master, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        pass
    finally:
        os.close(master)
    return b"".join(chunks).decode()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal sizes set with Linux ioctls")
def test_a_terminal_without_width_gets_plain_lines(monkeypatch):
    """tqdm draws nothing on a terminal that reports 0 columns: there, as off a terminal, progress is a
    plain line per N steps; a terminal with a width gets the bar."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    for columns, expect_bar in ((0, False), (80, True)):
        master, stream = _pty_with_columns(columns)
        try:
            assert progress.interactive(stream) is expect_bar
            monkeypatch.setattr(sys, "stderr", stream)
            steps = progress.StepProgress(4, 0, "train test", every=2)
            for step in range(1, 5):
                steps.update(step, 32, 0.5, 0.1)
            steps.note("validated after step 4")
            steps.close()
        finally:
            monkeypatch.setattr(sys, "stderr", sys.__stderr__)
            stream.close()
        written = _read_until_closed(master)
        lines = [line.strip() for line in written.replace("\r", "\n").splitlines() if line.strip()]
        if expect_bar:
            assert any("train test" in line and "%|" in line for line in lines)
        else:
            assert [line.split()[1] for line in lines[:-1]] == ["1/4", "2/4", "4/4"]
            assert lines[-1] == "validated after step 4"
