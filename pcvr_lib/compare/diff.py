"""`pcvr diff`: two stored runs compared case by case against the noise floor (no running, unless `--run`
runs the suite first)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pcvr_lib.compare.noise import default_noise, load_noise, threshold
from pcvr_lib.compare.runs import (
    EXIT_OK,
    EXIT_REGRESSED,
    Case,
    cases_of,
    check_same_machine,
    current_machine,
    host_probe_us,
    load_run,
    machine_of,
    pct,
    short_id,
)
from pcvr_lib.compare.suite import run_suite
from pcvr_lib.errors import check_writable_file
from pcvr_lib.report import EXIT_REFUSED, ReportError, format_table


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
# one tree (the issuing thread waits on a busy GPU; S4096 attention in notes/comparison.md).
HOST_GATED_FRACTION = 0.25


def host_gated(case: Case) -> bool:
    """Whether a case's host time is gated: its host time is >= HOST_GATED_FRACTION x its device time."""
    host, device = case.values.get("host"), case.values.get("device")
    return host is not None and device is not None and host >= HOST_GATED_FRACTION * device


def host_factors(old_cases: dict[str, Case], new_cases: dict[str, Case], base: dict,
                 new: dict) -> tuple[dict[str, float], dict[str, float], str]:
    """How much slower the new run's host issues the same calls, per group: (factor by which host ratios are
    divided, common shift left after that division, where the factor came from).

    Host time follows the host's speed, which differs between hosts of one kind (one H200 host issued the
    same calls about 2x slower than another, notes/comparison.md). With a host probe in both runs the factor is the
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
    each group's common host shift is its own row. `normalise_host=False`: neither (host time of every
    case gated as measured), to show what the two change (tools/validate_comparison.py)."""
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


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def diff_table(rows: list[Row], everything: bool = False) -> str:
    order = {"REGRESSED": 0, "MISSING": 1, "WORKLOAD CHANGED": 2, "STAT CHANGED": 3, "host shift": 4, "faster": 5,
             "ok": 6, "informational": 7, "new": 8}
    shown = rows if everything else [r for r in rows if r.verdict not in ("ok", "informational")]
    shown = sorted(shown, key=lambda r: (order.get(r.verdict, 9), r.case, r.metric))
    table = format_table(
        ["case", "metric", "base us", "new us", "change", "threshold", "verdict", "why"],
        [[short_id(r.case), r.metric, _us(r.base_us), _us(r.new_us), pct(r.change),
          "-" if r.threshold is None else f"{100 * r.threshold:.1f}%", r.verdict, r.why] for r in shown],
    ) if shown else "(no case outside its threshold)"
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return table + "\n" + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], 9)))


def diff_files(base_path: str, new_path: str, noise_path: str | None) -> tuple[list[Row], dict | None]:
    base, new = load_run(base_path), load_run(new_path)
    check_same_machine(base, new, base_path, new_path)
    if not noise_path:
        noise, _, why = default_noise(base)
        if why:  # the floors only, said on stderr (and in the header line)
            print(f"pcvr diff: {why}; thresholds are the floors only (make this machine's with `make noise`)",
                  file=sys.stderr)
        return diff_runs(base, new, noise), noise
    noise = load_noise(Path(noise_path))
    if noise is None:
        raise ReportError(f"{noise_path}: no such noise file")
    if noise.get("machine") != machine_of(base):
        raise ReportError(f"{noise_path}: noise measured on {noise.get('machine')}, the runs on {machine_of(base)}")
    return diff_runs(base, new, noise), noise


def stored_runs(storage: Path) -> list[Path]:
    """Runs `make bench` autosaved under storage/<pytest-benchmark machine id>/, oldest first."""
    return sorted(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json"), key=lambda p: (p.name, str(p)))


def resolve_base(wanted: str, storage: Path) -> Path:
    """The base run: a JSON path, "latest" (the newest autosaved run), a run number (1 is 0001) or an id prefix."""
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
    number = f"{int(wanted):04d}_" if wanted.isdigit() else None  # pytest-benchmark numbers runs 0001, 0002, ...
    matches = [r for r in runs if (r.name.startswith(number) if number else
                                   r.name.startswith(wanted) or r.name[5:].startswith(wanted))]
    if not matches:
        names = ", ".join(r.name for r in runs[-5:])
        raise ReportError(f"nothing to compare with: no stored run matches {wanted!r} (newest: {names})")
    return matches[-1]


def add_arguments(parser) -> None:
    parser.add_argument("base", help="base run: a pytest-benchmark JSON, 'latest' or a stored run number")
    parser.add_argument("new", nargs="?", help="pytest-benchmark JSON of the new run (or use --run)")
    parser.add_argument("--run", metavar="JSON", help="first run the suite here, writing this JSON, then compare it")
    parser.add_argument("--tests", nargs=argparse.REMAINDER, default=["perf_tests"],
                        help="with --run, last: test paths and pytest args (-k ...)")
    parser.add_argument("--storage", default=".benchmarks", help="where 'latest' and run numbers are looked up")
    parser.add_argument("--noise", help="noise file (default: this machine's, .benchmarks/<machine>/"
                        "noise-<cpu>-<n>cpus.json, when it exists)")
    parser.add_argument("--json", dest="json_out", help="also write the comparison rows as JSON here")
    parser.add_argument("--all", action="store_true", help="list every case, not only those outside threshold")


def run(args) -> int:
    if args.json_out:  # before any comparison is printed (or any suite run)
        check_writable_file(args.json_out, "--json")
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
          + (f"the noise floor of {noise['runs']} runs" if noise else "the floors only (no noise file for this "
                                                                            "machine)"))
    print(diff_table(rows, args.all))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"base": args.base, "new": args.new, "failed": failed(rows),
                                                   "rows": [asdict(r) for r in rows]}, indent=1))
    return EXIT_REGRESSED if failed(rows) else EXIT_OK
