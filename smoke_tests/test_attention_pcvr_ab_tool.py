"""tools/attention_pcvr_ab.py (the interleaved per-call comparison at the PCVR shape) on the CPU: the rounds'
rotation and per-call arithmetic with a fake clock, the paired verdict on synthetic times, and the case code
(check first, a wrong implementation never timed) as a dry run with the torch backend standing in for ours."""

from __future__ import annotations

import json
import random

import torch

from smoke_tests.tool_loader import load_tool


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_interleave_rotates_and_divides_by_calls():
    tool = load_tool("attention_pcvr_ab")
    clock = FakeClock()
    cost = {"A": 3e-6, "B": 5e-6, "C": 7e-6}
    round_of = {"n": 0}
    log = []

    def block(name):
        def call():
            log.append(name)
            clock.now += cost[name] * (1 + 0.1 * round_of["n"])  # a slow drift over the rounds
        return call

    blocks = {name: block(name) for name in cost}
    syncs = []

    def sync():
        syncs.append(clock.now)
        if len(syncs) % (2 * len(cost)) == 0:  # every block syncs twice: the round is over
            round_of["n"] += 1

    entered = []

    class Ctx:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            entered.append("exit")

    times, orders = tool.interleave(blocks, calls=4, rounds=3, warmup_rounds=1, clock=clock, sync=sync,
                                    enter=lambda name: Ctx(name) if name == "B" else None)
    assert orders == [["B", "C", "A"], ["C", "A", "B"], ["A", "B", "C"]]  # round 0 (warm-up) ran A, B, C
    assert log[:12] == ["A"] * 4 + ["B"] * 4 + ["C"] * 4
    for name in cost:
        assert len(times[name]) == 3  # the warm-up round dropped
        for r, t in enumerate(times[name], start=1):
            assert abs(t - cost[name] * (1 + 0.1 * r)) < 1e-15
    assert entered == ["B", "exit"] * 4  # B's context around each of its four blocks only


def test_interleave_stops_after_seconds():
    tool = load_tool("attention_pcvr_ab")
    clock = FakeClock()

    def call():
        clock.now += 1.0

    times, orders = tool.interleave({"A": call, "B": call}, calls=1, rounds=100, seconds=5.0, clock=clock)
    # 2 s per round; the warm-up round counts towards the time: stops after the round that passes 5 s
    assert len(orders) == 2 and len(times["A"]) == 2


def test_summarise_verdicts():
    tool = load_tool("attention_pcvr_ab")
    rng = random.Random(0)
    rounds = 40
    sdpa = [300e-6 * (1 + 0.05 * rng.random()) for _ in range(rounds)]
    worse = [400e-6 * (1 + 0.05 * rng.random()) for _ in range(rounds)]
    times = {
        "sdpa_efficient": sdpa,
        "sdpa_cudnn": worse,
        "triton": [t * 0.8 for t in sdpa],  # 20% faster than the best SDPA in every round
        "tilelang": [t * 1.25 for t in sdpa],  # 25% slower
    }
    s = tool.summarise(times)
    assert s["best_sdpa"] == "sdpa_efficient" and s["rounds"] == rounds
    tri, tl = s["ours"]["triton"], s["ours"]["tilelang"]
    assert abs(tri["ratio"] - 0.8) < 1e-3 and tri["verdict"] == "met" and tri["ci95"][1] <= 1.0
    assert abs(tl["ratio"] - 1.25) < 1e-3 and tl["verdict"] == "missed" and tl["ci95"][0] > 1.0
    # equal on average, noisy per round: the interval spans 1
    noisy = {"sdpa_math": sdpa, "triton": [t * (1.3 if i % 2 else 0.75) for i, t in enumerate(sdpa)]}
    assert tool.summarise(noisy)["ours"]["triton"]["verdict"] == "unclear"
    # no SDPA result: no best, no ratio
    assert tool.summarise({"triton": sdpa})["best_sdpa"] is None
    text = tool.table({"case,dir=fwd+bwd": s})
    assert "| triton | " in text and "met |" in text and "missed |" in text


def test_dry_run_checks_first_and_writes_json(tmp_path, monkeypatch):
    """The whole tool on the CPU (our torch backend as "ours", SDPA's math backend as the peer): every
    implementation checked against fp64 before timing, JSON and table written; then one deliberately wrong
    implementation of ours is reported, never timed, and the tool exits 1."""
    tool = load_tool("attention_pcvr_ab")
    argv = ["--device", "cpu", "--impls", "torch,sdpa_math,sdpa_flash", "--dtypes", "bf16", "--directions",
            "fwd+bwd", "--rounds", "2", "--calls", "1", "--out", str(tmp_path)]
    assert tool.main(argv) == 0
    result = json.loads((tmp_path / "pcvr_ab.json").read_text())
    case = "B8xH8xS128xD64,mask=key_lengths,dtype=bf16,dir=fwd+bwd"
    assert result["rounds"] == 2 and not result["wrong"]
    assert set(result["per_call_s"]) == {f"{case}|torch", f"{case}|sdpa_math"}
    assert "no attention mask" in result["skipped"][f"{case}|sdpa_flash"]
    assert result["summary"][case]["best_sdpa"] == "sdpa_math"
    assert result["summary"][case]["ours"]["torch"]["verdict"] in ("met", "missed", "unclear")

    from perf_tests import test_attention as bench

    real = bench.flash_attention

    def off_by_five_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.05

    monkeypatch.setattr(bench, "flash_attention", off_by_five_percent)
    assert tool.main(argv) == 1
    result = json.loads((tmp_path / "pcvr_ab.json").read_text())
    assert "check failed" in result["wrong"][f"{case}|torch"]
    assert f"{case}|torch" not in result["per_call_s"]
    assert torch.is_grad_enabled()
