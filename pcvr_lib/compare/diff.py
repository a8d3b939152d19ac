"""`pcvr diff`: two stored runs compared case by case against the noise floor (no running, unless `--run`
runs the suite first)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pcvr_lib.compare.noise import default_noise, load_noise, threshold
from pcvr_lib.compare.runs import (
    EXIT_OK,
    EXIT_REGRESSED,
    Case,
    align_cases,
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
from pcvr_lib.timing.work import COUNTS


@dataclass
class Row:
    case: str
    metric: str
    base: float | None  # us (times) or per call (counted work, unit "per call")
    new: float | None
    change: float | None  # new / base - 1
    threshold: float | None
    # REGRESSED | MISSING | WORKLOAD CHANGED | STAT CHANGED (each: exit 1) | shift | faster | improved | ok |
    # reported | informational | not counted | new
    verdict: str
    why: str = ""
    unit: str = "us"


# Not gated across stored runs: host and per-call time move by tens of percent between two processes on a shared
# host (31-94% per group between two runs minutes apart on the lent H200 host, notes/comparison.md). Each is
# reported per case with its change, and per group as its median shift; host regressions are gated by counts.
REPORTED = ("host", "per_call")
FAILING = ("REGRESSED", "MISSING", "WORKLOAD CHANGED", "STAT CHANGED")
# what counted work depends on besides the code: a new interpreter or library calls a different number of functions
WORK_VERSIONS = ("torch", "triton", "tilelang", "liger_kernel", "numpy")


def _versions(run: dict) -> dict[str, str | None]:
    info = run.get("machine_info") or {}
    libraries = info.get("libraries") or {}
    return {"python": info.get("python_version"), **{name: libraries.get(name) for name in WORK_VERSIONS}}


def work_comparable(base: dict, new: dict) -> str | None:
    """Why the counted work of two runs cannot be compared (another Python or library version), or None."""
    a, b = _versions(base), _versions(new)
    changed = [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k]]
    return f"counts not comparable: {', '.join(changed)}" if changed else None


def _work_missing(case: Case, side: str) -> str | None:
    if not case.work:
        return f"no work counts in the {side} run: host work not gated for this case"
    if case.work.get("error"):
        return f"counting failed in the {side} run ({case.work['error']}): host work not gated for this case"
    return None


def work_rows(old: Case, now: Case, not_comparable: str | None) -> list[Row]:
    """Counted work per call (timing.work), compared exactly: more is REGRESSED, fewer improved. A case without
    counts on one side, or whose count differed between the counted calls, is `not counted` (and says why)."""
    reason = not_comparable or _work_missing(old, "base") or _work_missing(now, "new")
    if reason:
        return [Row(old.id, "work", None, None, None, None, "not counted", reason, "per call")]
    rows = []
    for name in COUNTS:
        b, n = old.work.get(name), now.work.get(name)
        if b is None or n is None:
            unsteady = [(side, c.work["unstable"][name]) for side, c in (("base", old), ("new", now))
                        if name in (c.work.get("unstable") or {})]
            if unsteady:
                rows.append(Row(old.id, name, b, n, None, None, "not counted", "; ".join(
                    f"differed between the counted calls of the {side} run {values}" for side, values in unsteady),
                    "per call"))
            elif (b is None) != (n is None):
                rows.append(Row(old.id, name, b, n, None, None, "not counted",
                                f"counted in the {'new' if b is None else 'base'} run only", "per call"))
            continue
        verdict = "REGRESSED" if n > b else "improved" if n < b else "ok"
        change = n / b - 1 if b else (0.0 if n == b else float("inf"))
        rows.append(Row(old.id, name, b, n, change, 0.0, verdict, f"{n - b:+d} per call (counted, exact)", "per call"))
    return rows


def shift_rows(old_cases: dict[str, Case], new_cases: dict[str, Case], base: dict, new: dict) -> list[Row]:
    """Per group and reported metric (host, per-call time): the median change over the group's gated cases, with
    the runs' host probes beside it (the host-speed probe of each GPU run, timing.host_probe)."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for cid, old in old_cases.items():
        now = new_cases.get(cid)
        if now is None or now.fingerprint != old.fingerprint or not (old.gated and now.gated):
            continue
        for metric in REPORTED:
            if metric in old.values and metric in now.values:
                ratios.setdefault((old.group, metric), []).append(now.values[metric] / old.values[metric])
    probe_base, probe_new = host_probe_us(base), host_probe_us(new)
    probe = (f"; host probe {probe_base:.2f} -> {probe_new:.2f} us ({pct(probe_new / probe_base - 1)})"
             if probe_base and probe_new else "")
    return [Row(f"group {group}", metric, None, None, statistics.median(v) - 1, None, "shift",
                f"median over {len(v)} cases, reported, not gated{probe}")
            for (group, metric), v in sorted(ratios.items())]


def diff_runs(base: dict, new: dict, noise: dict | None) -> list[Row]:
    """Compare two stored runs case by case (no running). The gated statistic (device or CPU time) against its
    noise threshold; host and per-call time reported with their change, never gated (`REPORTED`); GPU cases'
    counted work compared exactly (`work_rows`). A base case the new run lacks, or holds with another workload
    fingerprint or another kind of statistic, is not comparable and fails the comparison like a missing one.
    Cases are matched by full id, else by test id (`align_cases`: a benchmark file renamed)."""
    old_cases = cases_of(base, "base run")
    new_cases, renamed = align_cases(old_cases, cases_of(new, "new run"))
    not_comparable = work_comparable(base, new)
    rows = shift_rows(old_cases, new_cases, base, new)
    for cid, old in old_cases.items():
        now = new_cases.get(cid)
        if now is None:
            rows.append(Row(cid, old.kind, None, None, None, None, "MISSING",
                            "in the base run, not (or skipped) in the new one"))
            continue
        if now.fingerprint != old.fingerprint:
            rows.append(Row(cid, old.kind, None, None, None, None, "WORKLOAD CHANGED",
                            f"fingerprint {old.fingerprint} -> {now.fingerprint}: not compared (counts as missing)"))
            continue
        if now.kind != old.kind:
            rows.append(Row(cid, old.kind, None, None, None, None, "STAT CHANGED",
                            f"stats hold {old.kind} in the base, {now.kind} now: not compared (counts as missing)"))
            continue
        b, n = old.values[old.kind], now.values[old.kind]  # both positive (cases_of refuses anything else)
        change = n / b - 1
        limit, source = threshold(noise, old, old.kind, b)
        if not (old.gated and now.gated):
            verdict = "informational"
        else:
            verdict = "REGRESSED" if change > limit else "faster" if change < -limit else "ok"
        if cid in renamed:
            source += f"; matched by test id in {renamed[cid].split('::')[0]}"
        rows.append(Row(cid, old.kind, b * 1e6, n * 1e6, change, limit, verdict, source))
        for metric in REPORTED:
            if metric in old.values and metric in now.values:
                b, n = old.values[metric], now.values[metric]
                limit, source = threshold(noise, old, metric, b)
                side = "beyond" if abs(n / b - 1) > limit else "within"
                rows.append(Row(cid, metric, b * 1e6, n * 1e6, n / b - 1, limit, "reported",
                                f"{side} {source}; reported, not gated across stored runs"))
        if old.kind == "device" and old.gated and now.gated:
            rows += work_rows(old, now, not_comparable)
    for cid in new_cases.keys() - old_cases.keys():
        rows.append(Row(cid, new_cases[cid].kind, None, None, None, None, "new", "not in the base run"))
    return rows


def failed(rows: list[Row]) -> bool:
    """A gated case regressed, or a base case has no comparison in the new run (missing or not comparable)."""
    return any(r.verdict in FAILING for r in rows)


def _value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if unit == "per call" else f"{x:.3f}"


ORDER = {"REGRESSED": 0, "MISSING": 1, "WORKLOAD CHANGED": 2, "STAT CHANGED": 3, "shift": 4, "faster": 5,
         "improved": 6, "ok": 7, "reported": 8, "informational": 9, "not counted": 10, "new": 11}
QUIET = ("ok", "reported", "informational", "not counted")  # listed with --all only


def diff_table(rows: list[Row], everything: bool = False) -> str:
    shown = rows if everything else [r for r in rows if r.verdict not in QUIET]
    shown = sorted(shown, key=lambda r: (ORDER.get(r.verdict, 99), r.case, r.metric))
    table = format_table(
        ["case", "metric", "base", "new", "change", "threshold", "verdict", "why"],
        [[short_id(r.case), r.metric, _value(r.base, r.unit), _value(r.new, r.unit), pct(r.change),
          "-" if r.threshold is None else ("exact" if r.unit == "per call" else f"{100 * r.threshold:.1f}%"),
          r.verdict, r.why] for r in shown],
    ) if shown else "(no case outside its threshold)"
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    lines = [table, ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=lambda kv: ORDER.get(kv[0], 99)))]
    work = [r for r in rows if r.unit == "per call"]
    if work:  # GPU cases: how many have their host work gated, and why the others have not
        gated = len({r.case for r in work if r.verdict in ("ok", "REGRESSED", "improved")})
        reasons: dict[str, int] = {}
        for r in work:
            if r.verdict == "not counted":
                reason = re.split(r" \(|: | \[", r.why)[0]  # the kind of reason, without its values
                reasons[reason] = reasons.get(reason, 0) + 1
        lines.append(f"host work: {gated} case(s) gated by counted work (exact)" + (
            "; not counted: " + ", ".join(f"{why} ({n})" for why, n in sorted(reasons.items())) if reasons else ""))
    return "\n".join(lines)


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
    parser.add_argument("--json", dest="json_out", help="also write the comparison rows as JSON here (when it "
                        "refuses: the error)")
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
        if args.json_out:  # the refusal is the result: a script that keeps this file keeps why
            _write_json(args.json_out, {"base": args.base, "new": args.new, "failed": None, "error": str(exc)})
        return EXIT_REFUSED
    print(f"pcvr diff: {args.base} -> {args.new}; thresholds from "
          + (f"the noise floor of {noise['runs']} runs" if noise else "the floors only (no noise file for this "
                                                                            "machine)"))
    print(diff_table(rows, args.all))
    if args.json_out:
        _write_json(args.json_out, {"base": args.base, "new": args.new, "failed": failed(rows),
                                    "rows": [asdict(r) for r in rows]})
    return EXIT_REGRESSED if failed(rows) else EXIT_OK


def _write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))
