"""Workloads: what the accuracy tests, the benchmarks and precompile run, per op and per model.

`OPS` maps each kernel op to the files that make it up, so everything about an op is one lookup away;
`python -m pcvr_lib.workloads` prints the table (the README's layout section is that output, checked by
smoke_tests/test_layout.py, which also checks that every path exists).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpFiles:
    op: str
    package: str  # the op's kernels: entry point, config, reference, triton_impl, tilelang_impl
    workload: str  # shapes, inputs, bytes / FLOPs, TileLang manifest
    accuracy_test: str
    benchmark: str
    notes: str


OPS: dict[str, OpFiles] = {entry.op: entry for entry in (
    OpFiles("rms_norm", "pcvr_lib/kernels/norms", "pcvr_lib/workloads/norms.py", "accuracy_tests/test_norms.py",
            "perf_tests/test_norms.py", "notes/kernels.md"),
    OpFiles("layer_norm", "pcvr_lib/kernels/norms", "pcvr_lib/workloads/norms.py", "accuracy_tests/test_norms.py",
            "perf_tests/test_norms.py", "notes/kernels.md"),
    OpFiles("flash_attention", "pcvr_lib/kernels/attention", "pcvr_lib/workloads/attention.py",
            "accuracy_tests/test_attention.py", "perf_tests/test_attention.py", "notes/attention.md"),
    OpFiles("embedding_bag_mean", "pcvr_lib/kernels/embedding_bag", "pcvr_lib/workloads/embedding_bag.py",
            "accuracy_tests/test_embedding_bag.py", "perf_tests/test_embedding_bag.py", "notes/kernels-embedding.md"),
)}


def markdown_table() -> str:
    """The OPS table as the README shows it."""
    rows = ["| op | kernels | workload | accuracy test | benchmark | notes |", "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {e.op} | `{e.package}/` | `{e.workload}` | `{e.accuracy_test}` | `{e.benchmark}` | `{e.notes}` |"
             for e in OPS.values()]
    return "\n".join(rows)
