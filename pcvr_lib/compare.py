"""Did this commit make something slower? `pcvr diff`, `pcvr noise` and `pcvr compare`.

Every benchmark case carries up to three numbers (README "Reading the JSON"):

- the gated statistic, pytest-benchmark's `stats.median`: device seconds per call for GPU cases
  (`extra_info.stat == "device"`), CPU seconds for CPU cases (`"cpu"`);
- `extra_info.host_us` for GPU cases: host CPU time to issue one call, gated on its own;
- `extra_info.per_call_us`, what a user sees: it moves with the host's load, so it is compared only by
  interleaved A/B runs in one session (`pcvr compare`), never between two stored runs.

Thresholds come from a measured noise floor (`pcvr noise`: the suite run N times on one machine): a
metric regresses when it grew by more than max(K x the spread seen in A/A runs of that case or group,
a relative floor, an absolute floor). Runs from different CPUs or accelerators are refused.

Exit codes: 0 nothing regressed, 1 a case regressed or went missing, 2 refused (unreadable input,
different machines, nothing comparable), 3 (`pcvr compare` only) inconclusive: a gated case neither within
nor beyond its threshold after the last pair.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pcvr_lib.report import ReportError, format_table, load_benchmark_json

EXIT_OK, EXIT_REGRESSED, EXIT_REFUSED = 0, 1, 2
EXIT_INCONCLUSIVE = 3  # pcvr compare: a gated case still "unclear" after the last pair
NOISE_VERSION = 1
# Thresholds: K x the A/A spread of the case (or its group's 90th percentile, whichever is larger), never
# below the relative floor nor below the absolute floor (a few hundred ns of device time, one us of host
# time cannot be told from nothing however small the spread looked).
K = 2.0
REL_FLOOR = {"device": 0.03, "host": 0.10, "cpu": 0.05, "per_call": 0.05, "median": 0.15}
ABS_FLOOR_S = {"device": 0.2e-6, "host": 1e-6, "cpu": 1e-3, "per_call": 1e-6, "median": 1e-6}
# extra_info keys that describe the workload (not its timing): a change in any of them under one case id
# means two different workloads, which are flagged and never compared
WORKLOAD_KEYS = ("op", "shape", "dtype", "dir", "bytes", "flops", "tensors", "parameters", "measured_rows",
                 "measured_batches", "batch_size", "bytes_per_batch", "passes", "scale", "preset", "mode",
                 "strict_time_filter", "cache_capacity", "l2", "rotations")


# ---------------------------------------------------------------- reading runs


def fingerprint(extra_info: dict) -> str:
    """Short hash of the workload keys of a case's extra_info (WORKLOAD_KEYS)."""
    workload = {k: extra_info[k] for k in WORKLOAD_KEYS if k in extra_info}
    return hashlib.sha256(json.dumps(workload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stat_kind(bench: dict) -> str:
    """What `stats` hold: "device" (GPU cases), "cpu" (CPU cases) or "median" (runs from before the split,
    whose statistic mixed host and device time)."""
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


def cpu_seconds(stats: dict, extra: dict) -> float | None:
    """The gated number of a CPU case. CPU time only grows when other jobs share the cores (cache and SMT
    contention), so the least disturbed round (min) holds still, and the calibration probe's median over
    the run rescales it to the machine's own speed (timing.bench_cpu): min(raw) x nominal / median(probe).
    (The min of per-round calibrated times would pick the round whose probe happened to be disturbed.)"""
    from pcvr_lib.timing import PROBE_NOMINAL_S

    if extra.get("cpu_raw_min_s") and extra.get("probe_median_s"):
        return extra["cpu_raw_min_s"] * PROBE_NOMINAL_S / extra["probe_median_s"]
    return stats.get("min")


def case_group(bench: dict) -> str:
    """The group a case's noise is pooled with: its operator (kernels), else pytest-benchmark's group."""
    extra = bench.get("extra_info") or {}
    if extra.get("op"):
        return f"{extra['op']} {extra.get('dir', '')}".strip()
    return bench.get("group") or bench["name"].split("[")[0]


def cases_of(data: dict) -> dict[str, Case]:
    out = {}
    for bench in data["benchmarks"]:
        extra = bench.get("extra_info") or {}
        kind = stat_kind(bench)
        stats = bench.get("stats") or {}
        values = {kind: cpu_seconds(stats, extra) if kind == "cpu" else stats.get("median")}
        if kind == "device":
            for metric in ("host", "per_call"):
                if extra.get(f"{metric}_us") is not None:
                    values[metric] = extra[f"{metric}_us"] / 1e6
        values = {k: v for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        # per-round samples of the gated number, for the interleaved comparison: a CPU case's raw CPU seconds of
        # every timed round (timing.bench_cpu keeps them), else nothing (the run's one value is its sample)
        rounds = {kind: extra["cpu_raw_rounds_s"]} if kind == "cpu" and extra.get("cpu_raw_rounds_s") else {}
        out[bench["fullname"]] = Case(bench["fullname"], case_group(bench), kind, extra.get("gated", True) is not False,
                                      extra.get("fingerprint") or fingerprint(extra), values, rounds)
    return out


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
    data = load_benchmark_json(path)
    if not data["benchmarks"]:
        raise ReportError(f"{path}: holds no benchmark results")
    return data


# ---------------------------------------------------------------- noise


def spread(values: list[float]) -> float:
    """Relative spread of one case's A/A values: (max - min) / min, the largest A/A change seen."""
    values = [v for v in values if v > 0]
    return max(values) / min(values) - 1 if len(values) >= 2 else float("nan")


def _percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if math.isfinite(v))
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def build_noise(runs: list[dict], sources: list[str]) -> dict:
    """Per-case and per-group spread of every metric over runs of one tree on one machine."""
    if len(runs) < 2:
        raise ReportError(f"a noise floor needs at least 2 runs of the same tree, got {len(runs)}")
    for run, src in zip(runs[1:], sources[1:], strict=True):
        check_same_machine(runs[0], run, sources[0], src)
    per_run = [cases_of(r) for r in runs]
    ids = sorted(set.intersection(*(set(c) for c in per_run)))
    if not ids:
        raise ReportError("the runs share no case: " + ", ".join(sources))
    cases: dict[str, dict] = {}
    groups: dict[str, dict[str, list[float]]] = {}
    for cid in ids:
        first = per_run[0][cid]
        entry = {"group": first.group, "kind": first.kind, "gated": first.gated}
        for metric in first.values:
            vals = [c[cid].values[metric] for c in per_run if metric in c[cid].values]
            s = spread(vals)
            entry[metric] = {"spread": round(s, 5), "median_s": statistics.median(vals), "n": len(vals)}
            if first.gated and math.isfinite(s):
                groups.setdefault(first.group, {}).setdefault(metric, []).append(s)
        cases[cid] = entry
    group_summary = {
        g: {m: {"p50": round(_percentile(v, 0.5), 5), "p90": round(_percentile(v, 0.9), 5),
                "max": round(max(v), 5), "cases": len(v)} for m, v in metrics.items()}
        for g, metrics in sorted(groups.items())
    }
    return {
        "version": NOISE_VERSION,
        "machine": machine_of(runs[0]),
        "machine_name": machine_name(runs[0]),
        "runs": len(runs),
        "sources": sources,
        "k": K,
        "rel_floor": REL_FLOOR,
        "abs_floor_s": ABS_FLOOR_S,
        "groups": group_summary,
        "cases": cases,
    }


def load_noise(path: Path | None) -> dict | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        noise = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not a noise file ({exc})") from exc
    if noise.get("version") != NOISE_VERSION or "cases" not in noise:
        raise ReportError(f"{path}: not a pcvr noise file (version {NOISE_VERSION}); make it with `pcvr noise`")
    return noise


def threshold(noise: dict | None, case: Case, metric: str, base_s: float) -> tuple[float, str]:
    """(relative threshold, where it came from) for one metric of one case."""
    k = (noise or {}).get("k", K)
    rel_floor = (noise or {}).get("rel_floor", REL_FLOOR).get(metric, REL_FLOOR.get(metric, 0.15))
    abs_floor = (noise or {}).get("abs_floor_s", ABS_FLOOR_S).get(metric, 0.0)
    candidates = {"rel floor": rel_floor, "abs floor": abs_floor / base_s if base_s > 0 else 0.0}
    if noise:
        observed = ((noise["cases"].get(case.id) or {}).get(metric) or {}).get("spread")
        if observed is not None and math.isfinite(observed):
            candidates[f"{k:g}x case spread"] = k * observed
        group = ((noise.get("groups") or {}).get(case.group) or {}).get(metric)
        if group and math.isfinite(group["p90"]):
            candidates[f"{k:g}x group p90"] = k * group["p90"]
    source = max(candidates, key=candidates.get)
    return candidates[source], source


# ---------------------------------------------------------------- diff


@dataclass
class Row:
    case: str
    metric: str
    base_us: float | None
    new_us: float | None
    change: float | None  # new / base - 1
    threshold: float | None
    verdict: str  # ok | faster | REGRESSED | MISSING | WORKLOAD CHANGED | STAT CHANGED | informational | new
    why: str = ""


MIN_CASES_FOR_GROUP_FACTOR = 4  # fewer gated cases with host time: the run-wide median is the group's factor
MIN_CASES_FOR_MEDIAN_FACTOR = 8  # without a host probe and fewer cases than this: no host factor at all
# Host time is gated where a user can feel it: when it is at least this fraction of the device time. A call of
# milliseconds on the GPU hides its 50-300 us of issue time, and that host time scatters 3x between runs of
# one tree (the issuing thread waits on a busy GPU): lease A/B, S4096 attention, notes/comparison.md.
HOST_GATED_FRACTION = 0.25


def host_gated(case: Case) -> bool:
    """Whether a case's host time is gated: its host time is >= HOST_GATED_FRACTION x its device time."""
    host, device = case.values.get("host"), case.values.get("device")
    return host is not None and device is not None and host >= HOST_GATED_FRACTION * device


def host_probe_us(run: dict) -> float | None:
    """The run's host-speed probe (timing.host_probe: a fixed torch call's host time), when it has one."""
    probe = (run.get("machine_info") or {}).get("host_probe") or {}
    value = probe.get("us")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def host_factors(old_cases: dict[str, Case], new_cases: dict[str, Case], base: dict,
                 new: dict) -> tuple[dict[str, float], dict[str, float], str]:
    """How much slower the new run's host issues the same calls, per group: (factor by which host ratios are
    divided, common shift left after that division, where the factor came from).

    Host time follows the host's speed, which differs between sessions (lease B's host issued the same calls
    about 2x slower than lease A's, notes/comparison.md). With a host probe in both runs the factor is the
    probe ratio, and a shift of our own code (a slower launcher) stays visible in every case it touches;
    without one it is the median host ratio of the group's gated cases, which also absorbs a shift common to
    the group: the common shift is then reported on its own line (`host shift` rows), never hidden."""
    ratios: dict[str, list[float]] = {}
    for cid, old in old_cases.items():
        now = new_cases.get(cid)
        if (now is None or not (old.gated and now.gated) or now.fingerprint != old.fingerprint
                or not host_gated(old) or "host" not in now.values or old.values["host"] <= 0):
            continue
        ratios.setdefault(old.group, []).append(now.values["host"] / old.values["host"])
    if not ratios:
        return {}, {}, "none"
    every = [r for v in ratios.values() for r in v]
    medians = {g: statistics.median(v if len(v) >= MIN_CASES_FOR_GROUP_FACTOR else every) for g, v in ratios.items()}
    probe_base, probe_new = host_probe_us(base), host_probe_us(new)
    if probe_base and probe_new:
        factor = probe_new / probe_base
        return ({g: factor for g in ratios}, {g: m / factor for g, m in medians.items()},
                f"host probe {probe_base:.2f} -> {probe_new:.2f} us (x{factor:.2f})")
    if len(every) < MIN_CASES_FOR_MEDIAN_FACTOR:  # too few cases to tell the host from the code: as measured
        return {}, {}, "none"
    return medians, medians, "median host ratio of each group's cases (no host probe in both runs)"


def diff_runs(base: dict, new: dict, noise: dict | None, normalise_host: bool = True) -> list[Row]:
    """Compare two stored runs case by case (no running). Host time is gated only where it is felt
    (`host_gated`) and compared after dividing by the host's speed ratio between the runs (`host_factors`);
    each group's common host shift is its own row. `normalise_host=False`: the rule before both (host time
    of every case, as measured), kept to show what they change (tools/validate_comparison.py)."""
    old_cases, new_cases = cases_of(base), cases_of(new)
    factors, shifts, source = host_factors(old_cases, new_cases, base, new) if normalise_host else ({}, {}, "")
    rows = []
    for group in sorted(shifts):
        rows.append(Row(f"group {group}", "host shift", None, None, shifts[group] - 1, None, "host shift",
                        f"host factor x{factors[group]:.2f}: {source}"))
    for cid, old in old_cases.items():
        now = new_cases.get(cid)
        if now is None:
            rows.append(Row(cid, old.kind, None, None, None, None, "MISSING",
                            "in the base run, not (or skipped) in the new one"))
            continue
        if now.fingerprint != old.fingerprint:
            rows.append(Row(cid, old.kind, None, None, None, None, "WORKLOAD CHANGED",
                            f"fingerprint {old.fingerprint} -> {now.fingerprint}: not compared"))
            continue
        if now.kind != old.kind:
            rows.append(Row(cid, old.kind, None, None, None, None, "STAT CHANGED",
                            f"stats hold {old.kind} in the base, {now.kind} now: not compared"))
            continue
        for metric in (old.kind, "host"):
            if metric not in old.values or metric not in now.values:
                continue
            b, n = old.values[metric], now.values[metric]
            # host time on the base run's host speed (new us stays what was measured)
            factor = factors.get(old.group, 1.0) if metric == "host" else 1.0
            change = n / factor / b - 1 if b > 0 else float("inf")
            limit, source = threshold(noise, old, metric, b)
            if metric == "host" and old.group in factors:
                source += f", host x{factors[old.group]:.2f} taken out"
            if metric == "host" and normalise_host and not host_gated(old):
                verdict, source = "informational", f"host < {HOST_GATED_FRACTION:g} x device time: not felt per call"
            elif not (old.gated and now.gated):
                verdict = "informational"
            elif change > limit:
                verdict = "REGRESSED"
            elif change < -limit:
                verdict = "faster"
            else:
                verdict = "ok"
            rows.append(Row(cid, metric, b * 1e6, n * 1e6, change, limit, verdict, source))
    for cid in new_cases.keys() - old_cases.keys():
        rows.append(Row(cid, new_cases[cid].kind, None, None, None, None, "new", "not in the base run"))
    return rows


def failed(rows: list[Row]) -> bool:
    return any(r.verdict in ("REGRESSED", "MISSING") for r in rows)


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def short_id(cid: str) -> str:
    return cid.split("::", 1)[-1]


def diff_table(rows: list[Row], everything: bool = False) -> str:
    order = {"REGRESSED": 0, "MISSING": 1, "WORKLOAD CHANGED": 2, "STAT CHANGED": 3, "host shift": 4, "faster": 5,
             "ok": 6, "informational": 7, "new": 8}
    shown = rows if everything else [r for r in rows if r.verdict not in ("ok", "informational")]
    shown = sorted(shown, key=lambda r: (order.get(r.verdict, 9), r.case, r.metric))
    table = format_table(
        ["case", "metric", "base us", "new us", "change", "threshold", "verdict", "why"],
        [[short_id(r.case), r.metric, _us(r.base_us), _us(r.new_us), _pct(r.change),
          "-" if r.threshold is None else f"{100 * r.threshold:.1f}%", r.verdict, r.why] for r in shown],
    ) if shown else "(no case outside its threshold)"
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return table + "\n" + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], 9)))


def default_noise_path(run: dict, storage: Path = Path(".benchmarks")) -> Path:
    return storage / machine_name(run) / "noise.json"


def diff_files(base_path: str, new_path: str, noise_path: str | None) -> tuple[list[Row], dict | None]:
    base, new = load_run(base_path), load_run(new_path)
    check_same_machine(base, new, base_path, new_path)
    path = Path(noise_path) if noise_path else default_noise_path(base)
    noise = load_noise(path)
    if noise_path and noise is None:
        raise ReportError(f"{noise_path}: no such noise file")
    if noise is not None and noise.get("machine") != machine_of(base):
        message = f"{path}: noise measured on {noise.get('machine')}, the runs on {machine_of(base)}"
        if noise_path:
            raise ReportError(message)
        print(f"pcvr diff: not using {message}", file=sys.stderr)  # the default file is another machine's
        noise = None
    return diff_runs(base, new, noise), noise


def stored_runs(storage: Path) -> list[Path]:
    """Runs `make bench` autosaved under storage/<pytest-benchmark machine id>/, oldest first."""
    return sorted(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json"), key=lambda p: (p.name, str(p)))


def resolve_base(wanted: str, storage: Path) -> Path:
    """The base run: a JSON path, "latest" (the newest autosaved run) or a run number / id prefix."""
    path = Path(wanted)
    if path.is_file():
        return path
    if wanted.endswith(".json"):
        raise ReportError(f"nothing to compare with: {path} does not exist")
    runs = stored_runs(storage)
    if not runs:
        raise ReportError(f"nothing to compare with: no stored run under {storage}/*/; run `make bench` first "
                          "(it stores each run), or pass COMPARE_WITH=path/to/run.json")
    if wanted == "latest":
        return runs[-1]
    matches = [r for r in runs if r.name.startswith(wanted) or r.name[5:].startswith(wanted)]
    if not matches:
        names = ", ".join(r.name for r in runs[-5:])
        raise ReportError(f"nothing to compare with: no stored run matches {wanted!r} (newest: {names})")
    return matches[-1]


def current_machine() -> dict:
    """This machine as a run's machine_info would describe it (checked before running a suite)."""
    import cpuinfo
    import torch

    gpu = {"name": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else None
    return {"machine_info": {"cpu": {"brand_raw": cpuinfo.get_cpu_info().get("brand_raw")},
                             "cpu_count": os.cpu_count(), "gpu": gpu}}


def add_diff_arguments(parser) -> None:
    parser.add_argument("base", help="base run: a pytest-benchmark JSON, 'latest' or a stored run number")
    parser.add_argument("new", nargs="?", help="pytest-benchmark JSON of the new run (or use --run)")
    parser.add_argument("--run", metavar="JSON", help="first run the suite here, writing this JSON, then compare it")
    parser.add_argument("--tests", nargs=argparse.REMAINDER, default=["perf_tests"],
                        help="with --run, last: test paths and pytest args (-k ...)")
    parser.add_argument("--storage", default=".benchmarks", help="where 'latest' and run numbers are looked up")
    parser.add_argument("--noise", help="noise file (default .benchmarks/<machine>/noise.json when it exists)")
    parser.add_argument("--json", dest="json_out", help="also write the comparison rows as JSON here")
    parser.add_argument("--all", action="store_true", help="list every case, not only those outside threshold")


def run_diff(args) -> int:
    try:
        if (args.new is None) == (args.run is None):
            raise ReportError("give the new run's JSON or --run OUT.json (not both)")
        args.base = str(resolve_base(args.base, Path(args.storage)))
        if args.run:
            base = load_run(args.base)
            check_same_machine(base, current_machine(), args.base, "this machine")
            print(f"pcvr diff: running {' '.join(args.tests)} -> {args.run}", flush=True)
            run_suite(Path(args.run), args.tests)
            args.new = args.run
        rows, noise = diff_files(args.base, args.new, args.noise)
    except ReportError as exc:
        print(f"pcvr diff: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"pcvr diff: {args.base} -> {args.new}; thresholds from "
          + (f"the noise floor of {noise['runs']} runs" if noise else "the floors only (no noise file)"))
    print(diff_table(rows, args.all))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"base": args.base, "new": args.new, "failed": failed(rows),
                                                   "rows": [asdict(r) for r in rows]}, indent=1))
    return EXIT_REGRESSED if failed(rows) else EXIT_OK


# ---------------------------------------------------------------- running the suite


def pytest_command(json_out: Path, tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *tests, "--benchmark-only", "-q", "-p", "no:cacheprovider",
            f"--benchmark-json={json_out}"]


def run_suite(json_out: Path, tests: list[str], cwd: Path | None = None,
              extra_env: dict[str, str] | None = None) -> None:
    """One pytest process of the benchmark suite, writing its JSON; a failure to write JSON is an error.
    `extra_env` is set for this process only (`pcvr compare --candidate-env`)."""
    check_suite(start_suite(json_out, tests, cwd, extra_env).wait(), json_out, tests, cwd)


def start_suite(json_out: Path, tests: list[str], cwd: Path | None = None,
                extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start one pytest process of the benchmark suite (see run_suite) without waiting for it."""
    from pcvr_lib.data.generate import default_cache_dir

    json_out.parent.mkdir(parents=True, exist_ok=True)
    # both trees share one data cache: generated files are keyed by content, so a base worktree does not
    # regenerate them (nor rebuild the converter's native code, keyed by its source)
    env = {**os.environ, "PCVR_CACHE_DIR": str(default_cache_dir().resolve()), **(extra_env or {})}
    return subprocess.Popen(pytest_command(json_out.resolve(), tests), cwd=cwd, env=env)


def check_suite(code: int, json_out: Path, tests: list[str], cwd: Path | None = None) -> None:
    """A pytest run that wrote no JSON, or exited with an error other than a failed case, is an error."""
    if not json_out.is_file():
        raise ReportError(f"pytest ({' '.join(tests)}) in {cwd or Path.cwd()} exited {code} without writing {json_out}")
    if code not in (0, 1):  # 1: a failed case is reported by the comparison (it goes missing)
        raise ReportError(f"pytest ({' '.join(tests)}) in {cwd or Path.cwd()} exited {code}")


def add_noise_arguments(parser) -> None:
    parser.add_argument("-n", "--runs", type=int, default=3, help="how many times to run the suite (default 3)")
    parser.add_argument("--from", dest="sources", nargs="+", metavar="JSON",
                        help="build the noise file from these stored runs instead of running anything")
    parser.add_argument("--out", help="noise file (default .benchmarks/<machine>/noise.json)")
    parser.add_argument("--work", default="results/noise", help="where the runs' JSON goes")
    parser.add_argument("tests", nargs=argparse.REMAINDER,
                        help="last: test paths and pytest args, e.g. perf_tests -k x "
                        "(default perf_tests)")


def noise_summary(noise: dict) -> str:
    rows = []
    for group, metrics in noise["groups"].items():
        for metric, s in metrics.items():
            rows.append([group, metric, str(s["cases"]), _pct(s["p50"]), _pct(s["p90"]), _pct(s["max"])])
    return format_table(["group", "metric", "cases", "spread p50", "p90", "max"], rows)


def run_noise(args) -> int:
    try:
        if args.sources:
            sources = list(args.sources)
        else:
            if args.runs < 2:
                raise ReportError(f"--runs {args.runs}: a noise floor needs at least 2 runs")
            sources = []
            args.tests = args.tests or ["perf_tests"]
            for i in range(args.runs):
                out = Path(args.work) / f"run{i + 1}.json"
                print(f"pcvr noise: run {i + 1}/{args.runs} -> {out}", flush=True)
                run_suite(out, args.tests)
                sources.append(str(out))
        noise = build_noise([load_run(s) for s in sources], sources)
    except ReportError as exc:
        print(f"pcvr noise: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    out = Path(args.out) if args.out else Path(".benchmarks") / noise["machine_name"] / "noise.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(noise, indent=1) + "\n")
    print(noise_summary(noise))
    probes = [host_probe_us(load_run(src)) for src in sources]
    if any(probes):  # the host's speed per run (GPU runs): what `pcvr diff` divides host ratios by
        print("host probe per run (us): " + ", ".join(f"{Path(src).name} {'-' if p is None else f'{p:.2f}'}"
                                                      for src, p in zip(sources, probes, strict=True)))
    print(f"pcvr noise: {len(noise['cases'])} cases over {noise['runs']} runs -> {out}")
    return EXIT_OK


# ---------------------------------------------------------------- interleaved A/B


@functools.cache
def t_quantile(q: float, df: int, samples: int = 400_000) -> float:
    """Student's t quantile, from numpy's t sampler (seeded: the same number every time; +-0.01)."""
    import numpy as np

    return float(np.quantile(np.random.default_rng(0).standard_t(df, samples), q))


def paired_interval(base: list[list[float]], new: list[list[float]],
                    level: float = 0.95) -> tuple[float, float, float]:
    """(ratio new/base, low, high) over pairs of runs (base run i with candidate run i, run next to it).

    Per run the value is the median of its samples (its timed rounds, or its one value); per pair the log of
    new / base. The ratio is the geometric mean over the pairs, the interval Student's t over the pairs'
    logs: what differs between two processes of one tree (8% between two side-by-side processes of the
    pipeline's opt case) is in the pairs' scatter, and with 4-8 pairs a bootstrap would be too narrow (it
    undercovers; resampling the rounds within runs instead made single warm-up rounds decide). One pair:
    no interval (unbounded)."""
    import numpy as np

    logs = np.array([np.log(np.median(b) / np.median(a)) for a, b in zip(base, new, strict=False)])
    if logs.size == 0:
        raise ValueError("paired_interval: no pair of runs")
    mean = float(logs.mean())
    if logs.size == 1:
        return math.exp(mean), 0.0, math.inf
    half = t_quantile(0.5 + level / 2, logs.size - 1) * float(logs.std(ddof=1)) / math.sqrt(logs.size)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def abba_order(rounds: int) -> list[str]:
    """A-B-B-A per round: drift over the session hits both sides alike."""
    return ["base", "new", "new", "base"] * rounds


def ab_samples(runs: list[dict], metric_kind: str) -> dict[str, list[list[float]]]:
    """Per case: for every run of one side, in order, the samples of one metric (Case.rounds: a CPU case's
    timed rounds; else the run's one value)."""
    out: dict[str, list[list[float]]] = {}
    for run in runs:
        for cid, case in cases_of(run).items():
            metric = case.kind if metric_kind == "stat" else metric_kind
            if metric in case.values:
                out.setdefault(cid, []).append(list(case.rounds.get(metric) or [case.values[metric]]))
    return out


def ab_threshold(noise: dict | None, case: Case, metric: str, base_s: float) -> float:
    """The smallest change an interleaved comparison reports: the relative and absolute floors only. The A/A
    spreads of the noise file describe two runs far apart in time (what `pcvr diff` must allow for); in
    A-B-B-A runs the interval measures the noise of this session, so adding them again would
    hide any slowdown below 2x the stored-run spread (21-37% on the 2-core machine, notes/comparison.md)."""
    floors_only = {**noise, "cases": {}, "groups": {}} if noise else None
    return threshold(floors_only, case, metric, base_s)[0]


@dataclass
class AbRow:
    case: str
    metric: str
    base_us: float
    new_us: float
    ratio: float
    low: float
    high: float
    threshold: float
    verdict: str  # REGRESSED | faster | ok | unclear | informational


def ab_verdict(ratio: float, low: float, high: float, limit: float, gated: bool) -> str:
    """REGRESSED: slower by more than the threshold, and the interval excludes no change. ok: not that, and
    the interval excludes a slowdown of twice the threshold (what the comparison promises to catch: 10% on
    CPU cases with the 5% floor). faster: the mirror of REGRESSED. Otherwise unclear: more pairs would tell
    (`pcvr compare --until-clear`), and a comparison left unclear is inconclusive, never a pass."""
    if not gated:
        return "informational"
    if ratio > 1 + limit and low > 1:
        return "REGRESSED"
    if ratio < 1 - limit and high < 1:
        return "faster"
    if high <= 1 + 2 * limit:
        return "ok"
    return "unclear"


def ab_compare(base_runs: list[dict], new_runs: list[dict], noise: dict | None) -> tuple[list[AbRow], list[str]]:
    """Per case and metric (the gated statistic, host time, per-call time): the ratio new/base over pairs of
    runs (base run i with candidate run i) with its 95% interval (`paired_interval`), and the verdict
    (`ab_verdict`). The threshold is the floors alone (`ab_threshold`): the interval already carries this
    session's noise."""
    rows = []
    base_cases = cases_of(base_runs[0])
    new_ids = set.intersection(*(set(cases_of(r)) for r in new_runs))
    missing = sorted(set(base_cases) - new_ids)
    for metric_kind in ("stat", "host", "per_call"):
        a, b = ab_samples(base_runs, metric_kind), ab_samples(new_runs, metric_kind)
        for cid in sorted(a.keys() & b.keys()):
            case = base_cases[cid]
            metric = case.kind if metric_kind == "stat" else metric_kind
            ratio, low, high = paired_interval(a[cid], b[cid])
            base_s = statistics.median(statistics.median(r) for r in a[cid])
            new_s = statistics.median(statistics.median(r) for r in b[cid])
            limit = ab_threshold(noise, case, metric, base_s)
            rows.append(AbRow(cid, metric, base_s * 1e6, new_s * 1e6, ratio, low, high, limit,
                              ab_verdict(ratio, low, high, limit, case.gated)))
    return rows, missing


def ab_table(rows: list[AbRow], missing: list[str], everything: bool = False) -> str:
    shown = rows if everything else [r for r in rows if r.verdict not in ("ok", "informational")]
    lines = [format_table(
        ["case", "metric", "base us", "new us", "change", "95% interval", "threshold", "verdict"],
        [[short_id(r.case), r.metric, f"{r.base_us:.3f}", f"{r.new_us:.3f}", _pct(r.ratio - 1),
          f"{_pct(r.low - 1)} .. {_pct(r.high - 1)}", f"{100 * r.threshold:.1f}%", r.verdict] for r in shown],
    ) if shown else "(every case within its threshold)"]
    lines += [f"MISSING in the candidate: {short_id(c)}" for c in missing]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    lines.append(", ".join(f"{v}: {n}" for v, n in sorted(counts.items())) + f", missing: {len(missing)}")
    return "\n".join(lines)


def base_checkout(base: str, work: Path) -> tuple[Path, bool]:
    """(directory holding the base tree, whether we made a worktree to remove afterwards): `base` is a
    directory (used as it is: on a GPU host without git history) or a git revision."""
    path = Path(base)
    if path.is_dir():
        if not (path / "perf_tests").is_dir():
            raise ReportError(f"--base {base}: a directory without perf_tests/, not a checkout of this project")
        return path.resolve(), False
    probe = subprocess.run(["git", "rev-parse", "--verify", f"{base}^{{commit}}"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ReportError(f"--base {base}: neither a directory nor a git revision here ({probe.stderr.strip()})")
    target = work / f"base-{probe.stdout.strip()[:10]}"
    if target.exists():
        shutil.rmtree(target)
    work.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["git", "worktree", "add", "--detach", str(target), probe.stdout.strip()],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise ReportError(f"git worktree add for {base} failed: {made.stderr.strip()}")
    return target.resolve(), True


def add_compare_arguments(parser) -> None:
    parser.add_argument("--base", help="git revision or directory of the base tree")
    parser.add_argument("--replay", metavar="DIR", help="run nothing: compare the NN_base/NN_new runs an earlier "
                        "`pcvr compare` left in DIR (its --work), e.g. with another noise file")
    parser.add_argument("--new", default=".", help="directory of the candidate tree (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2, help="A-B-B-A rounds (default 2: 4 runs per side); "
                        "with --side-by-side, pairs of runs")
    parser.add_argument("--side-by-side", action="store_true",
                        help="CPU cases: run base and candidate at the same time, each timed round alone "
                        "(the other process paused), so both sides see the same outside load")
    parser.add_argument("--until-clear", type=int, metavar="N",
                        help="after --rounds, add rounds (pairs) one at a time while a gated case is unclear, up "
                        "to N in all; still unclear then: exit 3 (inconclusive), never a pass")
    parser.add_argument("--noise", help="noise file (default .benchmarks/<machine>/noise.json of the candidate)")
    parser.add_argument("--work", default="results/compare", help="where the runs' JSON and the report go")
    parser.add_argument("--all", action="store_true", help="list every case, not only those outside threshold")
    parser.add_argument("--candidate-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set this variable in the candidate's runs only (repeatable); e.g. a planted "
                        "slowdown (PCVR_PLANTED_CPU_SLOWDOWN=0.10) to measure what the comparison catches")
    parser.add_argument("tests", nargs=argparse.REMAINDER,
                        help="last: test paths and pytest args, e.g. perf_tests -k x "
                        "(default perf_tests)")


def parse_env_assignments(items: list[str], option: str) -> dict[str, str]:
    """NAME=VALUE strings -> dict; a malformed one is an error naming it."""
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ReportError(f"{option} {item!r}: expected NAME=VALUE with NAME a variable name")
        env[name] = value
    return env


def replay_runs(folder: Path) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
    """The runs of an earlier `pcvr compare` (its NN_base.json / NN_new.json files), in run order."""
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    files: dict[str, list[str]] = {"base": [], "new": []}
    if not folder.is_dir():
        raise ReportError(f"--replay {folder}: not a directory")
    for path in sorted(folder.glob("[0-9][0-9]_*.json")):
        side = path.stem.split("_", 1)[1]
        if side in runs:
            runs[side].append(load_run(path))
            files[side].append(str(path))
    if not runs["base"] or not runs["new"]:
        raise ReportError(f"--replay {folder}: needs NN_base.json and NN_new.json runs of `pcvr compare` "
                          f"(found {len(files['base'])} base, {len(files['new'])} candidate)")
    return runs, files


def unclear(rows: list[AbRow]) -> list[AbRow]:
    """Rows whose verdict more pairs could still change: the gated statistic and host time (per-call time
    is shown, its verdict never holds a comparison open)."""
    return [r for r in rows if r.verdict == "unclear" and r.metric != "per_call"]


def ab_exit_code(rows: list[AbRow], missing: list[str]) -> int:
    """1 when a case regressed or went missing, else 3 when a gated case is still unclear, else 0."""
    if missing or any(r.verdict == "REGRESSED" for r in rows):
        return EXIT_REGRESSED
    return EXIT_INCONCLUSIVE if unclear(rows) else EXIT_OK


def run_compare(args) -> int:
    work = Path(args.work)
    made_worktree = False
    base_dir = None
    side_env: dict[str, dict[str, str]] = {"base": {}, "new": {}}
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    files: dict[str, list[str]] = {"base": [], "new": []}
    try:
        if args.replay:
            runs, files = replay_runs(Path(args.replay))
            new_dir = Path(".").resolve()
        else:
            if not args.base:
                raise ReportError("--base REV_OR_DIR is needed (or --replay DIR of an earlier comparison)")
            if args.rounds < 1:
                raise ReportError(f"--rounds {args.rounds}: at least one A-B-B-A round (or side-by-side pair)")
            if args.until_clear is not None and args.until_clear < args.rounds:
                raise ReportError(f"--until-clear {args.until_clear}: a cap below --rounds {args.rounds}")
            args.tests = args.tests or ["perf_tests"]
            side_env["new"] = parse_env_assignments(args.candidate_env, "--candidate-env")
            base_dir, made_worktree = base_checkout(args.base, Path(tempfile.gettempdir()) / "pcvr-compare")
            new_dir = Path(args.new).resolve()
            unit = run_side_by_side_pair if args.side_by_side else run_abba_round
            dirs, t0 = {"base": base_dir, "new": new_dir}, time.time()
            for i in range(args.rounds):
                unit(i, args, dirs, side_env, work, runs, files, t0)
        check_same_machine(runs["base"][0], runs["new"][0], "base", "candidate")
        noise_path = Path(args.noise) if args.noise else default_noise_path(runs["new"][0], new_dir / ".benchmarks")
        noise = load_noise(noise_path)
        if noise is not None and noise.get("machine") != machine_of(runs["new"][0]):
            if args.noise:
                raise ReportError(f"{noise_path}: noise measured on {noise.get('machine')}, not on this machine")
            noise = None  # the default noise file is another machine's: the floors only
        rows, missing = ab_compare(runs["base"], runs["new"], noise)
        done = args.rounds
        while not args.replay and args.until_clear and done < args.until_clear and unclear(rows) and not missing:
            print(f"pcvr compare: {len(unclear(rows))} case(s) unclear after {done}: one more "
                  f"({done + 1} of at most {args.until_clear})", flush=True)
            unit(done, args, dirs, side_env, work, runs, files, t0)
            done += 1
            rows, missing = ab_compare(runs["base"], runs["new"], noise)
    except ReportError as exc:
        print(f"pcvr compare: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        if made_worktree and base_dir is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], capture_output=True)
    print(ab_table(rows, missing, args.all))
    code = ab_exit_code(rows, missing)
    regressed, inconclusive = code == EXIT_REGRESSED, code == EXIT_INCONCLUSIVE
    if inconclusive:
        print(f"pcvr compare: INCONCLUSIVE: {len(unclear(rows))} gated case(s) neither within nor beyond the "
              "threshold with this many pairs (more: --rounds, or --until-clear N)")
    if not args.replay:  # a replay writes nothing (its folder may be committed fixtures)
        report = {"base": args.base, "new": str(args.new), "rounds": args.rounds, "units_run": done,
                  "side_by_side": args.side_by_side, "files": files, "candidate_env": side_env["new"],
                  "tests": args.tests, "noise": str(noise_path) if noise else None, "failed": regressed,
                  "inconclusive": inconclusive, "missing": missing, "rows": [asdict(r) for r in rows]}
        (work / "compare.json").write_text(json.dumps(report, indent=1))
        print(f"pcvr compare: runs and compare.json under {work}")
    return code


def _keep(out: Path, side: str, runs: dict[str, list[dict]], files: dict[str, list[str]]) -> None:
    runs[side].append(load_run(out))
    files[side].append(str(out))


def run_abba_round(i: int, args, dirs: dict[str, Path], side_env: dict[str, dict[str, str]], work: Path,
                   runs: dict[str, list[dict]], files: dict[str, list[str]], t0: float) -> None:
    """A-B-B-A round i: four pytest processes, one after the other; each run's JSON is work/NN_side.json.
    Pairs for the comparison: base and candidate runs in order (01-02, 04-03, 05-06, 08-07: neighbours)."""
    for j, side in enumerate(abba_order(1)):
        n = 4 * i + j + 1
        out = work / f"{n:02d}_{side}.json"
        print(f"pcvr compare: run {n} ({side}, {dirs[side]}) [{time.time() - t0:.0f}s]", flush=True)
        run_suite(out, args.tests, cwd=dirs[side], extra_env=side_env[side])
        _keep(out, side, runs, files)


def run_side_by_side_pair(i: int, args, dirs: dict[str, Path], side_env: dict[str, dict[str, str]], work: Path,
                          runs: dict[str, list[dict]], files: dict[str, list[str]], t0: float) -> None:
    """`--side-by-side` pair i: one base and one candidate pytest process at the same time, each timed CPU
    round run alone (timing.ExclusiveRound: a shared lock, the other process stopped meanwhile), so the two
    sides' rounds interleave within seconds under the same outside load. Which side starts first alternates
    between pairs. The JSON of pair i is work/ii_base.json and work/ii_new.json."""
    from pcvr_lib.timing import EXCLUSIVE_ENV

    pair = work / f".pair{i + 1:02d}"
    if pair.exists():
        shutil.rmtree(pair)
    pair.mkdir(parents=True)
    order = ["base", "new"] if i % 2 == 0 else ["new", "base"]
    print(f"pcvr compare: pair {i + 1} side by side ({order[0]} started first) [{time.time() - t0:.0f}s]", flush=True)
    procs, outs = {}, {}
    try:
        for side in order:
            outs[side] = work / f"{i + 1:02d}_{side}.json"
            procs[side] = start_suite(outs[side], args.tests, cwd=dirs[side],
                                      extra_env={**side_env[side], EXCLUSIVE_ENV: str(pair.resolve())})
        (pair / "pids").write_text(" ".join(str(p.pid) for p in procs.values()))
        codes = _wait_pair(procs)
    finally:
        for proc in procs.values():  # never leave a stopped or orphaned process behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for side in ("base", "new"):
        check_suite(codes[side], outs[side], args.tests, dirs[side])
        run = load_run(outs[side])
        if not all((b.get("extra_info") or {}).get("exclusive_rounds") for b in run["benchmarks"]
                   if stat_kind(b) == "cpu"):
            raise ReportError(f"{outs[side]}: its CPU rounds did not run alone (no exclusive_rounds): the {side} "
                              "tree's timing predates --side-by-side; compare it with A-B-B-A rounds instead")
        if any(stat_kind(b) == "device" for b in run["benchmarks"]):
            raise ReportError(f"{outs[side]}: --side-by-side pauses only CPU cases' rounds; GPU cases share the "
                              "device: compare them with A-B-B-A rounds (without --side-by-side)")
        _keep(outs[side], side, runs, files)
    shutil.rmtree(pair)


def _wait_pair(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """Wait for both processes; when one ends, the other is continued (SIGCONT) in case the first ended
    while holding it stopped (killed in the middle of a round)."""
    import signal

    codes: dict[str, int] = {}
    while len(codes) < len(procs):
        for side, proc in procs.items():
            if side not in codes and proc.poll() is not None:
                codes[side] = proc.returncode
                for other in procs.values():
                    if other.poll() is None:
                        os.kill(other.pid, signal.SIGCONT)
        time.sleep(0.2)
    return codes
