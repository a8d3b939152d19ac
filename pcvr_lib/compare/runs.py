"""Reading stored runs: their cases (the numbers each carries, its workload fingerprint) and their machine,
shared by `pcvr diff`, `pcvr noise` and `pcvr compare`; the commands' exit codes."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pcvr_lib.report import ReportError, load_benchmark_json
from pcvr_lib.timing import PROBE_NOMINAL_S
from pcvr_lib.timing.work import COUNTS

EXIT_OK, EXIT_REGRESSED = 0, 1  # and pcvr_lib.report.EXIT_REFUSED (2): unreadable input, refused request
EXIT_INCONCLUSIVE = 3  # pcvr compare: a gated case still "unclear" after the last pair
# extra_info keys that describe the workload (not its timing): a change in any of them under one case id
# means two different workloads, which are flagged and never compared. `returns` says what the timed call
# returns (e.g. a coalesced or a raw sparse gradient): same shapes and bytes, another job.
WORKLOAD_KEYS = ("op", "shape", "dtype", "dir", "bytes", "flops", "tensors", "parameters", "measured_rows",
                 "measured_batches", "batch_size", "bytes_per_batch", "passes", "scale", "preset", "mode",
                 "strict_time_filter", "cache_capacity", "l2", "rotations", "returns")


def fingerprint(extra_info: dict) -> str:
    """Short hash of the workload keys of a case's extra_info (WORKLOAD_KEYS)."""
    workload = {k: extra_info[k] for k in WORKLOAD_KEYS if k in extra_info}
    return hashlib.sha256(json.dumps(workload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stat_kind(bench: dict) -> str:
    """What `stats` hold: "device" (GPU cases), "cpu" (CPU cases) or "median" (older stored runs, whose
    statistic mixes host and device time)."""
    return (bench.get("extra_info") or {}).get("stat") or "median"


@dataclass
class Case:
    id: str
    group: str
    kind: str  # device | cpu | median
    gated: bool
    fingerprint: str
    values: dict[str, float]  # metric -> seconds (median of the run)
    rounds: dict[str, list[float]] = field(default_factory=dict)  # metric -> per-round seconds, when stored
    work: dict = field(default_factory=dict)  # counted work per call (timing.work.count_work), when recorded
    sources_digest: str | None = None  # digest of the library files the case ran (pcvr_lib.sources), when recorded


def cpu_seconds(stats: dict, extra: dict) -> float | None:
    """The gated number of a CPU case. CPU time only grows when other jobs share the cores (cache and SMT
    contention), so the least disturbed round (min) holds still, and the calibration probe's median over
    the run rescales it to the machine's own speed (timing.bench_cpu): min(raw) x nominal / median(probe).
    (The min of per-round calibrated times would pick the round whose probe happened to be disturbed.)"""
    if extra.get("cpu_raw_min_s") and extra.get("probe_median_s"):
        return extra["cpu_raw_min_s"] * PROBE_NOMINAL_S / extra["probe_median_s"]
    return stats.get("min")


def case_group(bench: dict) -> str:
    """The group a case's noise is pooled with: its operator (kernels), else pytest-benchmark's group."""
    extra = bench.get("extra_info") or {}
    if extra.get("op"):
        return f"{extra['op']} {extra.get('dir', '')}".strip()
    return bench.get("group") or bench["name"].split("[")[0]


def _bad_number(value) -> bool:
    return not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0


def cases_of(data: dict, source: str = "run") -> dict[str, Case]:
    """The cases of a run. A case whose gated statistic is missing, NaN, infinite or not positive, or whose
    host or per-call time is present but such a number, is an error naming the case (ReportError): a broken
    or hand-edited run is refused, never compared as if it held a number."""
    out = {}
    for bench in data["benchmarks"]:
        cid = bench.get("fullname") or bench.get("name") or "?"
        extra = bench.get("extra_info") or {}
        kind = stat_kind(bench)
        stats = bench.get("stats") or {}
        value, where = ((cpu_seconds(stats, extra), "stats.min (or the calibrated CPU minimum)") if kind == "cpu"
                        else (stats.get("median"), "stats.median"))
        if _bad_number(value):
            raise ReportError(f"{source}: case {short_id(cid)}: {where} is {value!r}, not a positive number of "
                              "seconds (a broken or edited run: run the case again)")
        values = {kind: value}
        if kind == "device":
            for metric in ("host", "per_call"):
                us = extra.get(f"{metric}_us")
                if us is None:
                    continue
                if _bad_number(us):
                    raise ReportError(f"{source}: case {short_id(cid)}: extra_info.{metric}_us is {us!r}, not a "
                                      "positive number (a broken or edited run: run the case again)")
                values[metric] = us / 1e6
        # per-round samples of the gated number, for the interleaved comparison: a CPU case's raw CPU seconds of
        # every timed round (timing.bench_cpu keeps them), else nothing (the run's one value is its sample)
        rounds = {kind: extra["cpu_raw_rounds_s"]} if kind == "cpu" and extra.get("cpu_raw_rounds_s") else {}
        work = extra.get("work") or {}
        for name in COUNTS:
            if name in work and (not isinstance(work[name], int) or isinstance(work[name], bool) or work[name] < 0):
                raise ReportError(f"{source}: case {short_id(cid)}: extra_info.work.{name} is {work[name]!r}, not a "
                                  "count (a broken or edited run: run the case again)")
        out[cid] = Case(cid, case_group(bench), kind, extra.get("gated", True) is not False,
                        extra.get("fingerprint") or fingerprint(extra), values, rounds, work,
                        extra.get("sources_digest"))
    return out


def align_cases(old: dict[str, Case], new: dict[str, Case]) -> tuple[dict[str, Case], dict[str, str]]:
    """The new run's cases keyed like the base's: by full id, else by test id (the part after "::") where that
    is unique in both runs, so a benchmark file renamed between the runs (perf_tests/test_kernels.py ->
    test_norms.py) keeps its cases comparable. Returns (the new cases so keyed, {base id: new id} of those
    matched by test id)."""
    tests_old = Counter(short_id(cid) for cid in old)
    tests_new = Counter(short_id(cid) for cid in new)
    by_test = {short_id(cid): cid for cid in new if tests_new[short_id(cid)] == 1 and cid not in old}
    aligned, renamed = dict(new), {}
    for cid in old:
        test = short_id(cid)
        if cid not in new and tests_old[test] == 1 and test in by_test:
            aligned[cid] = aligned.pop(by_test[test])
            renamed[cid] = by_test[test]
    return aligned, renamed


def machine_of(data: dict) -> dict[str, str]:
    """The CPU model, its core count and the accelerator of a run: what must match for two runs to compare."""
    info = data.get("machine_info") or {}
    gpu = info.get("gpu") or {}
    return {"cpu": (info.get("cpu") or {}).get("brand_raw") or info.get("processor") or "unknown CPU",
            "cpus": str(info.get("cpu_count") or (info.get("cpu") or {}).get("count") or "?"),
            "gpu": gpu.get("name") or "no GPU"}


def machine_name(data: dict) -> str:
    """Folder name under .benchmarks/ for a run's machine: "h200" for an NVIDIA H200, else "cpu"."""
    gpu = machine_of(data)["gpu"]
    match = re.search(r"\b([A-Z]\d{2,4})\b", gpu)
    return match.group(1).lower() if match else ("cpu" if gpu == "no GPU" else re.sub(r"\W+", "-", gpu).lower())


def check_same_machine(a: dict, b: dict, what_a: str, what_b: str) -> None:
    ma, mb = machine_of(a), machine_of(b)
    diffs = [f"{k}: {ma[k]!r} vs {mb[k]!r}" for k in ma if ma[k] != mb[k]]
    if diffs:
        raise ReportError(f"refusing to compare {what_a} with {what_b}: measured on different machines "
                          f"({'; '.join(diffs)})")


def load_run(path: str | Path) -> dict:
    """A stored run, checked: it holds cases, and every case a usable statistic (`cases_of`)."""
    data = load_benchmark_json(path)
    if not data["benchmarks"]:
        raise ReportError(f"{path}: holds no benchmark results")
    cases_of(data, str(path))
    return data


def host_probe_us(run: dict) -> float | None:
    """The run's host-speed probe (timing.host_probe: a fixed torch call's host time), when it has one."""
    probe = (run.get("machine_info") or {}).get("host_probe") or {}
    value = probe.get("us")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def current_machine() -> dict:
    """This machine as a run's machine_info would describe it (checked before running a suite)."""
    import cpuinfo
    import torch

    gpu = {"name": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else None
    return {"machine_info": {"cpu": {"brand_raw": cpuinfo.get_cpu_info().get("brand_raw")},
                             "cpu_count": os.cpu_count(), "gpu": gpu}}


def short_id(cid: str) -> str:
    return cid.split("::", 1)[-1]


def pct(x: float | None) -> str:
    """A relative change as a signed percentage ("-" when there is none)."""
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"
