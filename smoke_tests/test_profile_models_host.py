"""tools/profile_models.py --host on the CPU (the torch backend, a tiny model): the host-time views are filled
and consistent (cProfile's packages sum to its CPU total, the functions carry own <= inclusive time, the
step's own code is attributed to pcvr_lib modules), the JSON round-trips through --from, and the tables print;
--precision bf16 runs the steps under bf16 autocast."""

from __future__ import annotations

import json

import pytest
import torch

from smoke_tests.tool_loader import load_tool

TINY = {"vocab_cap": 64, "d_model": 48, "num_heads": 2, "num_blocks": 1, "emb_dim": 16}


def test_host_profile_cpu(tmp_path, capsys):
    tool = load_tool("profile_models")
    from pcvr_lib.workloads.models import demo_schema, random_batch

    schema = demo_schema(8)
    batch = random_batch(schema, batch=4, seed=3)
    r = tool.host_profile("baseline", "torch", schema, batch, 1, "cpu", 5, config=TINY)
    assert r["host_cpu_us"] > 0 and r["wall_us"] > 0
    assert abs(sum(r["packages_us"].values()) - r["cprofile_cpu_us"]) < 1.0 + 1e-3 * r["cprofile_cpu_us"]
    assert "built-in" in r["packages_us"]
    assert any(p.startswith("pcvr_lib.models") for p in r["packages_us"]), r["packages_us"]
    assert any(p.startswith("pcvr_lib.optim") for p in r["packages_us"]), r["packages_us"]
    for label, (own, inclusive, calls) in r["functions"].items():
        assert 0 <= own <= inclusive + 0.2 and calls > 0, label
    assert any("pcvr_lib/models/step.py" in f for f in r["functions"])  # train_step's frame, by file:line
    assert any(op.startswith("aten::") for op in r["ops_self_us"])
    assert r["sync_wall_us"] == 0.0  # no CUDA runtime on the CPU

    saved = {"kind": "host", "models": {"baseline": {"torch": r, "triton": {"error": "RuntimeError: no CUDA"}}}}
    path = tmp_path / "profile_host.json"
    path.write_text(json.dumps(saved))
    assert tool.main(["--from", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "== baseline train_step: torch host" in out and "triton: RuntimeError: no CUDA" in out
    assert "package, own CPU us per call (cProfile)" in out and "op, self CPU us per call" in out


def test_package_of():
    tool = load_tool("profile_models")
    root = tool.ROOT
    assert tool.package_of("~") == "built-in"
    assert tool.package_of(f"{root}/pcvr_lib/kernels/attention/__init__.py") == "pcvr_lib.kernels.attention"
    assert tool.package_of(f"{root}/pcvr_lib/kernels/_triton.py") == "pcvr_lib.kernels._triton"
    assert tool.package_of("/usr/lib/python3/site-packages/torch/autograd/function.py") == "torch.autograd"
    assert tool.package_of("/usr/lib/python3/site-packages/triton/runtime/jit.py") == "triton"
    # a virtual environment inside the checkout holds libraries, not our modules
    assert tool.package_of(f"{root}/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py") == "torch.nn"


def test_bf16_precision_runs_the_steps_under_autocast():
    tool = load_tool("profile_models")
    from pcvr_lib.models.step import ModelStep
    from pcvr_lib.workloads.models import demo_schema, random_batch

    schema = demo_schema(8)
    batch = random_batch(schema, batch=4, seed=3)
    step = ModelStep("baseline", schema, batch, "torch", config=TINY)
    with tool.at_precision(step, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with tool.at_precision(step, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="fp32 or bf16"):
        tool.at_precision(step, "fp16")
    casts = {}
    for precision in ("fp32", "bf16"):
        r = tool.host_profile("baseline", "torch", schema, batch, 1, "cpu", 40, config=TINY, precision=precision)
        assert r["host_cpu_us"] > 0 and any(op.startswith("aten::") for op in r["ops_self_us"])
        casts[precision] = r["ops_self_us"].get("aten::_to_copy", [0.0, 0.0])[1]
    assert casts["bf16"] > casts["fp32"], f"the profiled steps' casts per step {casts}: bf16 ran without autocast"


def test_backend_specs_name_a_mode_and_single_operator_switches(capsys):
    tool = load_tool("profile_models")
    assert tool.parse_backend("triton") == ("triton", "eager", {})
    assert tool.parse_backend("torch:graph") == ("torch", "graph", {})
    assert tool.parse_backend("triton:graph/rms_norm_backend=torch") == ("triton", "graph",
                                                                        {"rms_norm_backend": "torch"})
    for bad in ("triton:graph/norms=torch", "triton/rms_norm_backend", "triton/rms_norm_backend="):
        with pytest.raises(ValueError, match="is not SWITCH=BACKEND"):
            tool.parse_backend(bad)
    with pytest.raises(ValueError, match="mode 'grpah' is not one of"):
        tool.parse_backend("triton:grpah")
    with pytest.raises(SystemExit) as exit_info:  # refused before any model is built
        tool.main(["--backends", "torch,torch:graph", "--host", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--backends torch:graph: mode 'graph' replays CUDA graphs" in err
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--backends", "triton:grpah", "--host", "--device", "cpu"])
    assert exit_info.value.code == 2 and "mode 'grpah' is not one of" in capsys.readouterr().err


def test_the_infer_phase_profiles_inference_passes():
    tool = load_tool("profile_models")
    from pcvr_lib.workloads.models import demo_schema, random_batch

    schema = demo_schema(8)
    batch = random_batch(schema, batch=4, seed=3)
    train = tool.host_profile("baseline", "torch", schema, batch, 1, "cpu", 40, config=TINY)
    infer = tool.host_profile("baseline", "torch", schema, batch, 1, "cpu", 40, config=TINY, phase="infer")
    assert any("step.py" in f and "(infer)" in f for f in infer["functions"]), list(infer["functions"])[:10]
    assert not any("(train_step)" in f for f in infer["functions"])
    assert "pcvr_lib.optim" not in "".join(infer["packages_us"])  # no optimizer step in an inference pass
    assert any(p.startswith("pcvr_lib.optim") for p in train["packages_us"])
    # a spec's switch reaches the model built (not called here), the other switches keep the spec's backend
    switched = tool.build_step("baseline", "torch/rms_norm_backend=triton", schema, batch, "cpu", TINY)
    assert switched.model.config.rms_norm_backend == "triton" and switched.model.config.embedding_backend == "torch"
