"""tools/prewarm_models.py: a failed build says why in the step's own log (the build's log stays on the GPU
machine), and only compiled cases are built, one process per model x backend x mode."""

from __future__ import annotations

from smoke_tests.tool_loader import load_tool

TOOL = load_tool("prewarm_models")
P = "perf_tests/test_models.py::test_model[model={},backend={},mode={},phase={}]"


def test_builds_group_the_compiled_ids_by_model_backend_and_mode():
    ids = [P.format("dualq", "torch", mode, phase) for mode in ("eager", "graph", "captured", "compile")
           for phase in ("train_step", "infer")]
    groups = TOOL.groups_of(ids)
    assert list(groups) == [("dualq", "torch", "graph"), ("dualq", "torch", "compile")]
    assert groups[("dualq", "torch", "graph")] == ids[2:4]


def test_a_failed_build_names_the_failed_cases(tmp_path):
    log = tmp_path / "prewarm.log"
    log.write_text("F.\n\n=== short test summary info ===\n"
                   f"FAILED {P.format('dualq', 'torch', 'graph', 'train_step')} - AssertionError: loss 0.66 vs 0.65\n"
                   "1 failed, 1 passed in 28.1s\n")
    assert TOOL.why_failed(log) == [f"FAILED {P.format('dualq', 'torch', 'graph', 'train_step')} - "
                                    "AssertionError: loss 0.66 vs 0.65"]


def test_a_crashed_build_gives_its_last_lines(tmp_path):
    log = tmp_path / "prewarm.log"
    log.write_text("collecting ...\n\nFatal Python error: Segmentation fault\n  File \"x.py\", line 3 in f\n"
                   "Segmentation fault\n")
    assert TOOL.why_failed(log) == ["Fatal Python error: Segmentation fault", '  File "x.py", line 3 in f',
                                    "Segmentation fault"]
