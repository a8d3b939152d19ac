"""The reduced smoke of CI: every registered model, one seed, two steps, then the diagnostics
(the full one is `make smoke`)."""

from __future__ import annotations

import json

from pcvr_lib.diagnostics import FIGURES
from pcvr_lib.models import model_names
from pcvr_lib.smoke import SMOKE_LOADER_PRESET, smoke
from pcvr_lib.train.config import cpu_computes_bf16_natively


def test_reduced_smoke(tmp_path):
    out = tmp_path / "smoke"
    lines = []

    class Stream:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    summary = smoke(model_names(), [17], steps=2, out=out, batch_size=32, max_lens="seq_a:8,seq_b:8,seq_c:8,seq_d:8",
                    jobs=1, model_config={"vocab_cap": 256}, data_rows=200, stream=Stream())
    text = "".join(lines)
    assert [r["model"] for r in summary["runs"]] == model_names()
    for r in summary["runs"]:
        assert 0.0 <= r["auc"] <= 1.0 and r["train_sec"] > 0 and r["infer_rows_per_sec"] > 0
        run_dir = out / f"{r['model']}_seed17"
        for name in ("training_summary.json", "evaluation.json", "validation_predictions.jsonl",
                     "predictions.json", "inference_telemetry.json"):
            assert (run_dir / name).is_file(), (run_dir, name)
    assert all((out / "diagnostics" / f"{name}.png").is_file() for name in FIGURES)
    diag = json.loads((out / "diagnostics" / "pcvr_diagnostics_summary.json").read_text())
    assert set(diag["groups"]) == set(model_names())
    saved = json.loads((out / "smoke_summary.json").read_text())
    assert saved["steps"] == 2 and len(saved["runs"]) == len(model_names())
    # the precision's default on a CPU: bf16 autocast where it has bf16 matmul instructions, recorded per run
    assert saved["amp"] is cpu_computes_bf16_natively()
    assert ("bf16 autocast" if saved["amp"] else "fp32 (no autocast)") in text
    for r in summary["runs"]:
        training = json.loads((out / f"{r['model']}_seed17" / "training_summary.json").read_text())
        assert training["train_config"]["amp"] is saved["amp"]
    # training batches through the OPT cache (the same batches, each converted once), recorded as such
    assert saved["loader_preset"] == SMOKE_LOADER_PRESET == "opt"
    for r in summary["runs"]:
        telemetry = json.loads((out / f"{r['model']}_seed17" / "training_telemetry.json").read_text())
        assert telemetry["metadata"]["loader"]["preset"] == "opt"
    assert "1/" in text and "AUC at step 0" in text and "smoke finished" in text
    assert all(0.0 <= r["init_auc"] <= 1.0 for r in summary["runs"])


def test_smoke_bad_options_exit_2(tmp_path, capsys):
    from pcvr_lib.cli import main

    assert main(["smoke", "--models", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model(s) ['nope']" in capsys.readouterr().err
    assert main(["smoke", "--seeds", "a,b", "--out", str(tmp_path)]) == 2
    assert main(["smoke", "--steps", "0", "--out", str(tmp_path)]) == 2


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    flags = "fpu sse2 avx2 fma avx512f avx512bw"
    plain, native, amx = tmp_path / "plain", tmp_path / "native", tmp_path / "amx"
    plain.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    native.write_text(f"processor\t: 0\nflags\t\t: {flags} avx512_bf16 avx512_vnni\n")
    amx.write_text(f"processor\t: 0\nflags\t\t: {flags} amx_bf16 amx_tile\n")
    assert not cpu_computes_bf16_natively(plain)
    assert cpu_computes_bf16_natively(native) and cpu_computes_bf16_natively(amx)
    assert not cpu_computes_bf16_natively(tmp_path / "missing")


def test_smoke_precision_options():
    import argparse

    from pcvr_lib.smoke import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).amp is None  # the smoke picks: bf16 on a CPU with bf16 instructions
    assert parser.parse_args(["--amp"]).amp is True and parser.parse_args(["--no-amp"]).amp is False
