"""`pcvr noise`: the noise floor (the suite run N times on one machine, or stored runs), the noise file that
holds it, and the threshold of each case's metric taken from it."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
from pathlib import Path

from pcvr_lib.compare.runs import (
    EXIT_OK,
    Case,
    align_cases,
    cases_of,
    check_same_machine,
    host_probe_us,
    load_run,
    machine_name,
    machine_of,
    pct,
    short_id,
)
from pcvr_lib.compare.suite import run_suite
from pcvr_lib.report import EXIT_REFUSED, ReportError, format_table

NOISE_VERSION = 1
# Thresholds: K x the A/A spread of the case (or its group's 90th percentile, whichever is larger), never
# below the relative floor nor below the absolute floor (a few hundred ns of device time, one us of host
# time cannot be told from nothing however small the spread looked). The spread is the range of a handful of
# runs, which understates what the next pair of runs can show: with K = 2, held-out H200 runs still moved
# past it on a few of 304 cases (notes/comparison.md, "A noise floor that holds out"); K = 3 holds there and
# keeps most thresholds under the 10% a planted slowdown must be caught at.
K = 3.0
REL_FLOOR = {"device": 0.03, "host": 0.10, "cpu": 0.05, "per_call": 0.05, "median": 0.15}
ABS_FLOOR_S = {"device": 0.2e-6, "host": 1e-6, "cpu": 1e-3, "per_call": 1e-6, "median": 1e-6}


def spread(values: list[float]) -> float:
    """Relative spread of one case's A/A values: (max - min) / min, the largest A/A change seen."""
    values = [v for v in values if v > 0]
    return max(values) / min(values) - 1 if len(values) >= 2 else float("nan")


def _percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if math.isfinite(v))
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def run_identity(run: dict) -> str:
    """What tells one stored run from another: pytest-benchmark's session time with the commit, else (a run
    without them) a digest of its cases."""
    when, commit = run.get("datetime"), (run.get("commit_info") or {}).get("id")
    if when:
        return f"datetime {when}, commit {commit or '?'}"
    digest = hashlib.sha256(json.dumps(run["benchmarks"], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"cases digest {digest}"


def check_distinct(runs: list[dict], sources: list[str]) -> None:
    """A noise floor from one run given twice would claim 0% spread: every run must be another run (another
    file, and another session time and commit, or other cases)."""
    seen: dict[str, str] = {}
    for run, src in zip(runs, sources, strict=True):
        path = Path(src)
        keys = [f"file {path.resolve()}"] if path.is_file() else []
        for key in [*keys, run_identity(run)]:
            if key in seen:
                raise ReportError(f"{seen[key]} and {src} are the same run ({key}): a noise floor needs at least 2 "
                                  "distinct runs of the same tree; give each run once")
            seen[key] = src


def _same_job(case: Case, reference: Case) -> bool:
    """The same workload run by the same library code (a peer's case records no digest of ours)."""
    return case.fingerprint == reference.fingerprint and case.sources_digest == reference.sources_digest


def build_noise(runs: list[dict], sources: list[str]) -> dict:
    """Per-case and per-group spread of every metric over runs on one machine, oldest first. A case enters from
    every run that holds it with the workload and the library sources of its last appearance (a run cut before
    it, or of a suite that lacked it, still lends its other cases; a run of other code for it does not: that
    spread would be the change, not noise); it needs at least 2 such runs to have a spread."""
    if len(runs) < 2:
        raise ReportError(f"a noise floor needs at least 2 runs of the same tree, got {len(runs)}")
    check_distinct(runs, sources)
    per_run = [cases_of(runs[0], sources[0])]
    known: dict[str, Case] = dict(per_run[0])  # every case seen so far, keyed like its first appearance
    for run, src in zip(runs[1:], sources[1:], strict=True):
        check_same_machine(runs[0], run, sources[0], src)
        aligned = align_cases(known, cases_of(run, src))[0]
        per_run.append(aligned)
        for cid, case in aligned.items():
            known.setdefault(cid, case)
    latest = {cid: [c[cid] for c in per_run if cid in c][-1] for cid in known}
    holders = {cid: [c[cid] for c in per_run if cid in c and _same_job(c[cid], latest[cid])] for cid in known}
    ids = sorted(cid for cid, held in holders.items() if len(held) >= 2)
    if not ids:
        raise ReportError("no case is in two of the runs with the same workload: " + ", ".join(sources))
    cases: dict[str, dict] = {}
    groups: dict[str, dict[str, list[float]]] = {}
    for cid in ids:
        first = latest[cid]
        entry = {"group": first.group, "kind": first.kind, "gated": first.gated}
        for metric in first.values:
            vals = [c.values[metric] for c in holders[cid] if metric in c.values]
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


def noise_case(noise: dict, cid: str) -> dict | None:
    """A case's entry in a noise file: by full id, else by test id when exactly one entry has it (the noise runs
    may predate a rename of the benchmark file)."""
    if cid in noise["cases"]:
        return noise["cases"][cid]
    test = short_id(cid)
    matches = [entry for other, entry in noise["cases"].items() if short_id(other) == test]
    return matches[0] if len(matches) == 1 else None


def threshold(noise: dict | None, case: Case, metric: str, base_s: float) -> tuple[float, str]:
    """(relative threshold, where it came from) for one metric of one case."""
    k = (noise or {}).get("k", K)
    rel_floor = (noise or {}).get("rel_floor", REL_FLOOR).get(metric, REL_FLOOR.get(metric, 0.15))
    abs_floor = (noise or {}).get("abs_floor_s", ABS_FLOOR_S).get(metric, 0.0)
    candidates = {"rel floor": rel_floor, "abs floor": abs_floor / base_s if base_s > 0 else 0.0}
    if noise:
        observed = ((noise_case(noise, case.id) or {}).get(metric) or {}).get("spread")
        if observed is not None and math.isfinite(observed):
            candidates[f"{k:g}x case spread"] = k * observed
        group = ((noise.get("groups") or {}).get(case.group) or {}).get(metric)
        if group and math.isfinite(group["p90"]):
            candidates[f"{k:g}x group p90"] = k * group["p90"]
    source = max(candidates, key=candidates.get)
    return candidates[source], source


def noise_key(run: dict) -> str:
    """What a noise file is keyed by besides its folder (machine_name): the CPU model and core count, as a
    file-name slug ("intel-xeon-processor-2cpus"). CPU times and host times follow the CPU, so another CPU's
    noise floor is never taken for this one's."""
    machine = machine_of(run)
    cpu = re.sub(r"\((r|tm)\)", " ", machine["cpu"], flags=re.IGNORECASE)
    return f"{re.sub(r'[^a-z0-9]+', '-', cpu.lower()).strip('-')}-{machine['cpus']}cpus"


def default_noise_path(run: dict, storage: Path = Path(".benchmarks")) -> Path:
    """storage/<machine name>/noise-<noise_key>.json: the run's machine's noise file, if it has one."""
    return storage / machine_name(run) / f"noise-{noise_key(run)}.json"


def default_noise(run: dict, storage: Path = Path(".benchmarks")) -> tuple[dict | None, Path, str | None]:
    """(noise, its path, None) for the run's machine, or (None, the path it would have, why there is none:
    which machines the folder holds noise files for)."""
    path = default_noise_path(run, storage)
    noise = load_noise(path)
    if noise is not None and noise.get("machine") == machine_of(run):
        return noise, path, None
    machine = machine_of(run)
    here = f"{machine['cpu']}, {machine['cpus']} CPUs, {machine['gpu']}"
    if noise is not None:
        return None, path, f"{path} holds noise of {noise.get('machine')}, not of this machine ({here})"
    others = []
    for other in sorted(path.parent.glob("noise*.json")):
        try:
            measured = (load_noise(other) or {}).get("machine") or {}
        except ReportError:
            continue
        others.append(f"{measured.get('cpu')}, {measured.get('cpus')} CPUs, {measured.get('gpu')} ({other.name})")
    held = f"{path.parent} holds noise of: {'; '.join(others)}" if others else f"{path.parent} holds no noise file"
    return None, path, f"no noise file for this machine ({here}): no {path}; {held}"


def add_arguments(parser) -> None:
    parser.add_argument("-n", "--runs", type=int, default=3, help="how many times to run the suite (default 3)")
    parser.add_argument("--from", dest="sources", nargs="+", metavar="JSON",
                        help="build the noise file from these stored runs instead of running anything")
    parser.add_argument("--out", help="noise file (default .benchmarks/<machine>/noise-<cpu>-<n>cpus.json)")
    parser.add_argument("--work", default="results/noise", help="where the runs' JSON goes")
    parser.add_argument("tests", nargs=argparse.REMAINDER,
                        help="last: test paths and pytest args, e.g. perf_tests -k x "
                        "(default perf_tests)")


def noise_summary(noise: dict) -> str:
    rows = []
    for group, metrics in noise["groups"].items():
        for metric, s in metrics.items():
            rows.append([group, metric, str(s["cases"]), pct(s["p50"]), pct(s["p90"]), pct(s["max"])])
    return format_table(["group", "metric", "cases", "spread p50", "p90", "max"], rows)


def run(args) -> int:
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
    out = Path(args.out) if args.out else default_noise_path(load_run(sources[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(noise, indent=1) + "\n")
    print(noise_summary(noise))
    probes = [host_probe_us(load_run(src)) for src in sources]
    if any(probes):  # the host's speed per run (GPU runs): what `pcvr diff` divides host ratios by
        print("host probe per run (us): " + ", ".join(f"{Path(src).name} {'-' if p is None else f'{p:.2f}'}"
                                                      for src, p in zip(sources, probes, strict=True)))
    print(f"pcvr noise: {len(noise['cases'])} cases over {noise['runs']} runs -> {out}")
    return EXIT_OK
