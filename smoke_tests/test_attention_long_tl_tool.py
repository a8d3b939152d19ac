"""tools/attention_long_tl.py (the H200 sweep of the TileLang long-sequence candidates) on the CPU: its case
logic with SDPA standing in for the kernels (one candidate deliberately wrong), the timer replaced: every
candidate is checked against fp64 first, a wrong one is reported and never timed, the table is printed."""

from __future__ import annotations

import json
import types

import torch
import torch.nn.functional as F

from pcvr_lib.kernels.attention import config
from pcvr_lib.workloads import attention as workload
from smoke_tests.tool_loader import load_tool

WRONG_FWD = workload.TILELANG_FWD_LONG[64][1]


def _stand_in(wrong_config=None):
    def forward(q, k, v, key_lengths, mode, scale, seed, p, store_lse, config=None):
        o = F.scaled_dot_product_attention(q, k, v)
        return (o * 1.05 if config == wrong_config and config is not None else o), None

    def backward(do, q, k, v, o, lse, key_lengths, mode, scale, seed, p, config=None):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(F.scaled_dot_product_attention(qs, ks, vs), (qs, ks, vs), do)

    return types.SimpleNamespace(forward=forward, backward=backward)


def test_sweep_case_checks_before_timing(tmp_path, monkeypatch):
    tool = load_tool("attention_long_tl")
    monkeypatch.setattr(tool, "tr", _stand_in())
    monkeypatch.setattr(tool, "ti", _stand_in(WRONG_FWD))
    timed = []
    monkeypatch.setattr(tool, "device_seconds", lambda fn, calls: timed.append(fn) or 1e-3)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    record = tool.Recorder(2, str(tmp_path / "attention_long_tl.json"))
    tool.sweep_case(record, 1, 2, 600, 64, "bf16", device="cpu")  # S 600: the long bucket's configs

    rows = {(r["dir"], r["backend"], r["config"]): r for r in record.rows}
    fwd_tl = [r for r in record.rows if r["dir"] == "fwd" and r["backend"] == "tilelang"]
    fwd_configs = {config.TILELANG_FWD_CONFIGS[(64, 2)], *workload.TILELANG_FWD_LONG[64]}
    assert len(fwd_tl) == len(fwd_configs)  # the default, then every other candidate
    wrong = rows[("fwd", "tilelang", str(WRONG_FWD))]
    assert "max error" in wrong["error"] and "device_us" not in wrong
    good = [r for r in record.rows if r["backend"] in ("triton", "tilelang") and r["config"] != str(WRONG_FWD)]
    assert all(r.get("device_us") == 1000.0 and r["max_err"] >= 0 for r in good), good
    bwd_tl = [r for r in record.rows if r["dir"] == "fwd+bwd" and r["backend"] == "tilelang"]
    assert len(bwd_tl) == len({config.TILELANG_BWD_CONFIGS[(64, 2)], *workload.TILELANG_BWD_LONG[64]})
    assert len(timed) == len(good)  # the wrong candidate was never timed; cuDNN fails on the CPU
    assert json.loads((tmp_path / "attention_long_tl.json").read_text())["rows"] == record.rows
    table = tool.table(record.rows)
    assert "FAILED" in table and "1000.0" in table
