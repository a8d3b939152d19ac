"""tools/smoke_compare.py on synthetic smoke folders: pairing by (model, seed), the seed-noise verdict, the
loss agreement, a cut smoke's unpaired runs, and the errors."""

from __future__ import annotations

import json
import pathlib

import pytest

from smoke_tests.tool_loader import load_tool


def _run(folder: pathlib.Path, model: str, seed: int, auc: float, losses, train_sec: float = 2.0):
    run = folder / f"{model}_seed{seed}"
    run.mkdir(parents=True)
    (run / "evaluation.json").write_text(json.dumps({"model": model, "seed": seed, "metrics": {"auc": auc}}))
    (run / "training_summary.json").write_text(json.dumps({"losses": losses, "telemetry": {"elapsed_sec": train_sec}}))


def test_verdicts_losses_and_cost(tmp_path, capsys):
    tool = load_tool("smoke_compare")
    base, other = tmp_path / "torch", tmp_path / "triton"
    for seed, auc in [(1, 0.50), (2, 0.55), (3, 0.60)]:  # seed noise (SD) 0.05
        _run(base, "close", seed, auc, [0.40, 0.30], train_sec=2.0)
        _run(other, "close", seed, auc + 0.01, [0.404, 0.33], train_sec=1.0)
        _run(base, "far", seed, auc, [0.40, 0.30])
        _run(other, "far", seed, auc + (0.08 if seed == 2 else 0.0), [0.40, 0.30])
    _run(base, "cut", 1, 0.5, [0.4])
    _run(other, "cut", 1, 0.5, [0.4])
    _run(base, "cut", 2, 0.6, [0.4])  # the other smoke stopped before this run
    result = tool.compare(tool.load_runs(base), tool.load_runs(other))
    close, far, cut = result["close"], result["far"], result["cut"]
    assert close["verdict"] == "same" and close["seed_noise"] == pytest.approx(0.05)
    assert close["max_abs_auc_diff"] == pytest.approx(0.01)
    assert close["first_loss_rel_diff"] == pytest.approx(0.01) and close["max_loss_rel_diff"] == pytest.approx(0.1)
    assert close["train_sec_ratio"] == pytest.approx(0.5)
    assert far["verdict"] == "differs" and far["max_abs_auc_diff"] == pytest.approx(0.08)
    assert cut["seeds"] == [1] and cut["verdict"] == "unclear" and cut["unpaired"] == ["base seed 2"]
    assert tool.main([str(base), str(other), "--json", str(tmp_path / "c.json")]) == 0
    printed = capsys.readouterr().out
    assert "| far | 1,2,3 |" in printed and "differs" in printed
    assert json.loads((tmp_path / "c.json").read_text())["models"]["close"]["verdict"] == "same"


def test_errors_name_the_folder(tmp_path):
    tool = load_tool("smoke_compare")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        tool.main([str(empty), str(tmp_path / "missing")])
    _run(tmp_path / "a", "m", 1, 0.5, [0.4])
    (tmp_path / "a" / "m_seed1" / "training_summary.json").unlink()
    with pytest.raises(SystemExit, match="no training_summary.json"):
        tool.load_runs(tmp_path / "a")
    _run(tmp_path / "b", "m", 1, 0.5, [0.4, 0.3])
    _run(tmp_path / "c", "m", 1, 0.5, [0.4])
    with pytest.raises(SystemExit, match="m seed 1 trained 2 steps in one smoke and 1 in the other"):
        tool.compare(tool.load_runs(tmp_path / "b"), tool.load_runs(tmp_path / "c"))
