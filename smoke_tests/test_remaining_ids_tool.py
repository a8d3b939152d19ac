"""tools/remaining_ids.py: after a benchmark process died, the plan's ids it did not reach, without the crashed
model x backend x mode (or, after a kill at the step's time limit, with it)."""

from __future__ import annotations

import json

from smoke_tests.tool_loader import load_tool

TOOL = load_tool("remaining_ids")
P = "perf_tests/test_models.py::test_model[model={},backend={},mode=graph,phase={}]"
PLAN = [P.format(m, b, ph) for m in ("onetrans", "dualq", "queryformer") for b in ("torch", "triton")
        for ph in ("train_step", "infer")]


def checkpoint(done, failed=(), reason="the process died (crash, SIGKILL or out of memory) before the run ended"):
    return {"cut": {"reason": reason}, "benchmarks": [{"fullname": node} for node in done],
            "failed": {node: "check failed" for node in failed}}


def test_the_ids_after_the_crashed_group_are_run_again(tmp_path, capsys):
    run = checkpoint(PLAN[:5], failed=[PLAN[5]])  # onetrans both, dualq torch train timed; dualq torch infer failed
    left, crashed = TOOL.remaining(PLAN, run)
    assert crashed == PLAN[6:8]  # dualq triton graph: both phases left out
    assert left == PLAN[8:]
    (tmp_path / "plan.txt").write_text("\n".join(PLAN) + "\n")
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert TOOL.main([str(tmp_path / "plan.txt"), str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr()
    assert out.out.split() == PLAN[8:] and "died in " + PLAN[6] in out.err


def test_a_run_that_did_not_die_leaves_nothing(tmp_path, capsys):
    assert TOOL.remaining(PLAN, {"cut": None, "benchmarks": []}) == ([], [])
    assert TOOL.remaining(PLAN, checkpoint(PLAN[:2], reason="SIGINT")) == ([], [])
    assert TOOL.remaining(PLAN, checkpoint(PLAN)) == ([], [])
    (tmp_path / "bad.json").write_text("")
    (tmp_path / "plan.txt").write_text(PLAN[0])
    assert TOOL.main([str(tmp_path / "plan.txt"), str(tmp_path / "bad.json")]) == 2


def test_it_knows_the_checkpoint_of_a_process_that_died():
    from perf_tests.bench_plugin import DIED

    assert DIED.startswith(TOOL.DIED_PREFIX)


def test_a_process_killed_at_its_time_limit_runs_its_last_id_again(tmp_path, capsys):
    run = checkpoint(PLAN[:5], failed=[PLAN[5]])
    assert TOOL.remaining(PLAN, run, time_limit=True) == (PLAN[6:], [])
    (tmp_path / "plan.txt").write_text("\n".join(PLAN) + "\n")
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert TOOL.main([str(tmp_path / "plan.txt"), str(tmp_path / "run.json"), "--time-limit"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == PLAN[6:] and "time limit in " + PLAN[6] in out.err and "died" not in out.err


def test_a_later_call_runs_what_no_earlier_run_timed_or_failed(tmp_path, capsys):
    first = checkpoint(PLAN[:3], failed=[PLAN[3]], reason="SIGINT")  # cut, not died: the crash mode leaves nothing
    second = {"cut": None, "benchmarks": [{"fullname": PLAN[6]}]}
    assert TOOL.untimed(PLAN, [first, second]) == PLAN[4:6] + PLAN[7:]
    for name, run in (("first.json", first), ("second.json", second)):
        (tmp_path / name).write_text(json.dumps(run))
    (tmp_path / "plan.txt").write_text("\n".join(PLAN) + "\n")
    runs = [str(tmp_path / n) for n in ("first.json", "second.json", "kept_nowhere.json")]  # a fresh machine's
    assert TOOL.main([str(tmp_path / "plan.txt"), *runs, "--untimed"]) == 0
    assert capsys.readouterr().out.split() == PLAN[4:6] + PLAN[7:]
    assert TOOL.main([str(tmp_path / "plan.txt"), *runs[:2]]) == 2  # several runs only with --untimed
    assert "--untimed" in capsys.readouterr().err
