"""Counted work per call (pcvr_lib/timing/work.py), what `pcvr diff` gates host regressions on: the same in two
countings of one process and in two processes, and a planted host-only slowdown (perf_tests/planted.py,
PCVR_PLANTED_HOST_US) is flagged in exactly the cases it touches. (bench_gpu recording it:
accuracy_tests/test_timing.py.)

On this CPU the norm calls are the perf suite's (`perf_tests/test_norms.py`: fwd, or fwd + torch.autograd.grad)
at a small shape, the Triton kernels under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pcvr_lib import compare, timing
from pcvr_lib.kernels import layer_norm, rms_norm
from pcvr_lib.kernels.testing import triton_interpreter_problem
from pcvr_lib.workloads import norms as workload
from perf_tests.planted import HOST_ENV, plant_host_delay, planted_host_us

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (64, 128)
PLANTED = {"op=rms_norm,backend=triton,shape=64x128,dtype=fp32,dir=fwd",
           "op=rms_norm,backend=triton,shape=64x128,dtype=fp32,dir=fwd+bwd"}


def _backends() -> list[str]:
    return ["torch"] + ([] if triton_interpreter_problem() else ["triton"])


def norm_call(op: str, backend: str, direction: str):
    """The perf suite's call of one norm case (perf_tests/test_norms.py) on CPU tensors."""
    eps = workload.EPS[op]
    fn = ((lambda x, w: rms_norm(x, w, eps, backend=backend)) if op == "rms_norm"
          else (lambda x, w, b: layer_norm(x, w, b, eps, backend=backend)))
    grad = direction == "fwd+bwd"
    tensors = workload.inputs(op, SHAPE, torch.float32, "cpu", seed=1234, requires_grad=grad)
    if not grad:
        return lambda: fn(*tensors)
    dy = workload.grad_output(SHAPE, torch.float32, "cpu")
    return lambda: torch.autograd.grad(fn(*tensors), tensors, dy)


def count_cases(backends: list[str]) -> dict[str, dict]:
    """Case id -> count_work of its call, for both norms x `backends` x both directions."""
    out = {}
    for op in ("rms_norm", "layer_norm"):
        for backend in backends:
            for direction in ("fwd", "fwd+bwd"):
                case = f"op={op},backend={backend},shape={SHAPE[0]}x{SHAPE[1]},dtype=fp32,dir={direction}"
                out[case] = timing.count_work(norm_call(op, backend, direction), cuda=False)
    return out


class _SetAttr:
    """The part of pytest's monkeypatch that plant_host_delay uses, for a process of its own."""

    def setattr(self, target, name, value):
        setattr(target, name, value)


def child_main(backends: str, twice: bool) -> None:
    """In a fresh process: the cases counted (twice: two countings), printed as JSON; with PCVR_PLANTED_HOST_US
    set, planted first (as perf_tests/conftest.py does for the perf suite)."""
    us = planted_host_us()
    if us is not None:
        plant_host_delay(_SetAttr(), us)
    first = count_cases(backends.split(","))
    print(json.dumps({"first": first, "second": count_cases(backends.split(",")) if twice else None}))


@pytest.fixture(scope="module")
def processes():
    """Counts from fresh processes (PYTHONHASHSEED 1 and 2, and one with the planted host delay): what the perf
    suite's runs are. Counts are compared between processes of the same kind only: on CPU tensors the Triton
    interpreter scans the kernel's module namespaces at every launch, so its count depends on what the process
    imported before (this pytest process's earlier tests), which the GPU's launch path never does."""
    backends = _backends()
    runs = {}
    for name, extra in (("seed1", {"PYTHONHASHSEED": "1"}), ("seed2", {"PYTHONHASHSEED": "2"}),
                        ("planted", {"PYTHONHASHSEED": "1", HOST_ENV: "5"})):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from accuracy_tests.test_work_counts import child_main; "
                f"child_main(sys.argv[2], twice={name == 'seed1'})")
        env = {**{k: v for k, v in os.environ.items() if k != HOST_ENV}, "TRITON_INTERPRET": "1", **extra}
        proc = subprocess.run([sys.executable, "-c", code, str(ROOT), ",".join(backends)], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return backends, runs


@pytest.mark.slow
def test_counts_are_the_same_in_two_countings_and_in_two_processes(processes):
    assert count_cases(["torch"]) == count_cases(["torch"])  # in this process too, whatever ran before
    _, runs = processes
    first = runs["seed1"]["first"]
    assert first == runs["seed1"]["second"]
    assert first == runs["seed2"]["first"]
    for work in first.values():
        assert "unstable" not in work and work["calls_counted"] == timing.work.WORK_CALLS
        assert work["python_calls"] > 0 and work["torch_ops"] > 0 and work["host_reads"] == 0
        assert "launches" not in work  # counted on CUDA only


def test_counts_see_one_more_call_and_every_host_read():
    x = torch.arange(6.0)

    def plain():
        return (x * 2).sum()

    def one_more():
        return abs((x * 2).sum())

    def reads():
        return float((x * 2).sum()) + int(x.nonzero().shape[0])

    base = timing.count_work(plain, cuda=False)
    assert timing.count_work(one_more, cuda=False)["python_calls"] == base["python_calls"] + 1
    work = timing.count_work(reads, cuda=False)
    assert work["host_reads"] == 2 and work["torch_ops"] == base["torch_ops"] + 2


def test_a_count_that_differs_between_calls_is_recorded_as_unstable():
    calls = []

    def growing():
        calls.append(None)
        for _ in calls:
            len(calls)

    work = timing.count_work(growing, cuda=False, calls=3)
    assert "python_calls" not in work and len(set(work["unstable"]["python_calls"])) == 3
    assert work["torch_ops"] == 0


def _as_run(counts: dict[str, dict]) -> dict:
    """A stored GPU run holding these counts (device and host times are not measured here: one value for all)."""
    cases = [{"group": "g", "name": f"test_norm[{cid}]", "fullname": f"perf_tests/test_norms.py::test_norm[{cid}]",
              "stats": {"median": 10e-6}, "extra_info": {"stat": "device", "op": cid.split(",")[0][3:],
                                                        "dir": cid.rsplit("dir=", 1)[1], "host_us": 12.0,
                                                        "per_call_us": 15.0, "work": work}}
             for cid, work in counts.items()]
    return {"machine_info": {"gpu": {"name": "NVIDIA H200"}}, "benchmarks": cases}


@pytest.mark.slow
def test_a_planted_host_delay_is_flagged_by_counts_in_exactly_its_cases(processes):
    """A run with PCVR_PLANTED_HOST_US=5 against one without: exactly the planted cases (Triton RMSNorm, forward
    and forward+backward) are REGRESSED, by python_calls and nothing else; A/A: nothing."""
    backends, runs = processes
    if "triton" not in backends:
        pytest.skip(f"the planted wrapper is Triton's: {triton_interpreter_problem()}")
    clean, planted = runs["seed1"]["first"], runs["planted"]["first"]
    rows = compare.diff_runs(_as_run(clean), _as_run(planted), None)
    flagged = {(compare.short_id(r.case)[10:-1], r.metric) for r in rows if r.verdict == "REGRESSED"}
    assert flagged == {(case, "python_calls") for case in PLANTED}, flagged
    for case in PLANTED:  # the wrapper and its spin: 2 calls more, whatever the spin's length
        assert planted[case]["python_calls"] == clean[case]["python_calls"] + 2
        assert {k: v for k, v in planted[case].items() if k != "python_calls"} == {
            k: v for k, v in clean[case].items() if k != "python_calls"}
    assert compare.failed(rows)
    assert not compare.failed(compare.diff_runs(_as_run(clean), _as_run(runs["seed2"]["first"]), None))


def test_counting_leaves_a_compiled_function_compiled():
    """A TorchDispatchMode cannot run inside a compiled graph: counting a torch.compile'd call without care made
    dynamo drop its compiled code for good, so that every later call ran eagerly (torch 2.11: the model
    benchmark's graph-mode inference, timed after its train step had been counted, measured eager code) or
    raised (torch 2.13, fullgraph). The count runs it eagerly instead, and the function stays compiled."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(x) * 2 + 1, fullgraph=True, backend="eager")
    x = torch.randn(16)
    expected = torch.relu(x) * 2 + 1

    def regions():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert torch.equal(compiled(x), expected)
        return [e.key for e in prof.key_averages() if "Torch-Compiled Region" in e.key]

    assert regions()
    work = timing.count_work(lambda: compiled(x), cuda=False)
    assert work["torch_ops"] == 3 and "unstable" not in work  # relu, mul, add: the eager form's ops
    assert regions(), "counting dropped the function's compiled code"
    torch._dynamo.reset()
