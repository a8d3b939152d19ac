"""What a benchmark case runs (pcvr_lib.sources), the digest of it, and `pcvr report` saying which stored cases
ran code that has changed since (`stale`), which predate digests (`unknown`) and which are peers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pcvr_lib import sources
from pcvr_lib.cli import main
from pcvr_lib.compare import fingerprint

ROOT = Path(__file__).resolve().parents[1]
CACHED = (sources.files, sources.digest, sources.file_digest, sources._direct_files)


def short(paths) -> set[str]:
    return {p.removeprefix("pcvr_lib/") for p in paths}


def test_a_triton_norm_case_runs_its_package_the_triton_runtime_and_the_dispatcher():
    assert short(sources.files("kernel:rms_norm:triton")) == {
        "kernels/norms/__init__.py", "kernels/norms/config.py", "kernels/norms/triton_impl.py",
        "kernels/norms/reference.py", "kernels/_triton.py", "kernels/dispatch.py", "kernels/compile_log.py"}


def test_each_backend_has_its_own_files():
    tilelang = short(sources.files("kernel:layer_norm:tilelang"))
    assert {"kernels/norms/tilelang_impl.py", "kernels/_tilelang.py"} <= tilelang
    assert "kernels/norms/triton_impl.py" not in tilelang
    assert "kernels/embedding_bag/cuembed.cu" in short(sources.files("kernel:embedding_bag_mean:cuembed"))
    torch_norms = short(sources.files("kernel:rms_norm:torch"))
    assert not any(p.endswith("_impl.py") for p in torch_norms) and "kernels/norms/__init__.py" in torch_norms
    assert "kernels/attention/torch_impl.py" in short(sources.files("kernel:flash_attention:torch"))
    assert not any("attention" in p for p in sources.files("kernel:rms_norm:triton"))  # ops are independent


def test_a_model_case_runs_its_model_the_step_and_the_backends_kernels_only():
    files = short(sources.files("model:baseline:triton"))
    assert {"models/baseline.py", "models/step.py", "kernels/norms/triton_impl.py",
            "kernels/attention/triton_impl.py", "optim/muon.py"} <= files
    assert not {"models/dualq.py", "kernels/norms/tilelang_impl.py"} & files
    assert "models/baseline.py" in short(sources.files("model:onetrans:torch"))  # onetrans builds on baseline's


def test_data_and_optim_subjects():
    assert "data/convert_native.c" in short(sources.files("data:convert"))
    assert "data/loader.py" not in short(sources.files("data:convert"))
    assert "data/convert.py" in short(sources.files("data:loader"))
    assert "optim/registry.py" in short(sources.files("optim"))
    assert sources.files("peer:liger") == ()


@pytest.mark.parametrize("subject", ["kernel:rms_norm:cuembed", "kernel:no_such_op:triton", "model:nope:torch",
                                     "data:everything", "optimizers", "peer"])
def test_a_subject_that_names_no_code_is_an_error(subject):
    with pytest.raises(sources.SourcesError):
        sources.files(subject)


@pytest.fixture
def tree_copy(tmp_path, monkeypatch):
    """A copy of pcvr_lib to edit, with the per-process caches emptied before and after."""
    shutil.copytree(ROOT / "pcvr_lib", tmp_path / "pcvr_lib", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sources, "ROOT", tmp_path)
    for fn in CACHED:
        fn.cache_clear()
    yield tmp_path
    for fn in CACHED:
        fn.cache_clear()


def test_the_digest_changes_with_a_file_of_the_subject_only(tree_copy):
    before = {s: sources.digest(s) for s in ("kernel:rms_norm:triton", "kernel:rms_norm:tilelang")}
    recorded = sources.run_file_digests(before)
    stored = sources.stamp("kernel:rms_norm:triton")
    with open(tree_copy / "pcvr_lib/kernels/norms/triton_impl.py", "a") as handle:
        handle.write("# one more line\n")
    for fn in CACHED:
        fn.cache_clear()
    assert sources.digest("kernel:rms_norm:triton") != before["kernel:rms_norm:triton"]
    assert sources.digest("kernel:rms_norm:tilelang") == before["kernel:rms_norm:tilelang"]
    state = sources.case_state(stored, recorded)
    assert state["state"] == sources.STALE and state["changed"] == ["pcvr_lib/kernels/norms/triton_impl.py"]
    assert sources.case_state(sources.stamp("kernel:rms_norm:triton"), recorded)["state"] == sources.FRESH


def test_case_states():
    assert sources.case_state(sources.stamp("optim"))["state"] == sources.FRESH
    assert sources.case_state({"op": "rms_norm"})["state"] == sources.UNKNOWN
    assert sources.case_state(sources.stamp("peer:liger"))["state"] == sources.THIRD_PARTY
    gone = sources.case_state({"sources": "model:retired:torch", "sources_digest": "whatever"})
    assert gone["state"] == sources.STALE and "unknown model" in gone["changed"][0]


def test_the_fingerprint_covers_what_a_call_returns():
    raw = {"op": "embedding_bag_mean", "shape": "B8192", "bytes": 10, "returns": "raw sparse gradient"}
    assert fingerprint(raw) != fingerprint({**raw, "returns": "gradient with duplicate rows summed"})


def _case(name: str, **extra) -> dict:
    return {"group": "g", "name": name, "fullname": f"perf_tests/test_x.py::{name}", "param": name,
            "stats": {"median": 1e-5}, "extra_info": {"stat": "device", "op": "rms_norm", "backend": "triton",
                                                      "shape": "8x8", "dtype": "fp16", "dir": "fwd", **extra}}


def test_report_marks_stale_and_unknown_cases_in_its_tables_and_its_json(tmp_path, capsys):
    fresh = _case("test_a", **sources.stamp("kernel:rms_norm:triton"))
    stale = _case("test_b", sources="kernel:rms_norm:tilelang", sources_digest="not-this-tree")
    stale["extra_info"]["backend"] = "tilelang"
    old = _case("test_c", backend="torch")
    run = {"machine_info": {"cpu": {}, "gpu": None}, "commit_info": {}, "benchmarks": [fresh, stale, old],
           "source_files": {**sources.run_file_digests(["kernel:rms_norm:tilelang"]),
                            "pcvr_lib/kernels/norms/tilelang_impl.py": "not-this-one"},
           "cut": {"reason": "SIGTERM", "collected": 5, "finished": 3, "interrupted": ["x"], "not_run": 1}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert main(["report", str(path), "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert ("sources: 1 fresh, 1 stale (changed: pcvr_lib/kernels/norms/tilelang_impl.py), 1 unknown (no digest "
            "recorded: a run from before source digests)") in out
    assert "cut (SIGTERM): 3 case(s) kept, 3 of 5 finished, 1 interrupted (dropped), 1 not run" in out
    rows = {line.split()[1]: line.split()[5] for line in out.splitlines() if line.startswith("g ")}  # median "10 us"
    assert rows == {"test_a": "fresh", "test_b": "stale", "test_c": "unknown"}
    assert main(["report", str(path), "--view", "cases"]) == 0
    table = capsys.readouterr().out
    assert "[-] stale" in table and table.count("stale") == 2  # the sources line and the tilelang cell
    written = json.loads((tmp_path / "report.json").read_text())
    states = {c["id"].split("::")[1]: c for c in written["cases"]}
    assert [states[k]["state"] for k in ("test_a", "test_b", "test_c")] == ["fresh", "stale", "unknown"]
    assert states["test_b"]["recorded"] == "not-this-tree"
    assert states["test_b"]["current"] == sources.digest("kernel:rms_norm:tilelang")
    assert written["cut"]["reason"] == "SIGTERM"
