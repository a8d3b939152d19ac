"""`pcvr compare`: interleaved runs of a base tree and the candidate in one session (A-B-B-A rounds, or
CPU cases side by side), each case's ratio with a 95% interval over pairs of runs, and its verdict."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pcvr_lib.compare.noise import default_noise, load_noise, threshold
from pcvr_lib.compare.runs import (
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_REGRESSED,
    Case,
    align_cases,
    cases_of,
    check_same_machine,
    load_run,
    machine_of,
    pct,
    short_id,
    stat_kind,
)
from pcvr_lib.compare.suite import check_suite, run_suite, start_suite
from pcvr_lib.report import EXIT_REFUSED, ReportError, format_table
from pcvr_lib.timing import EXCLUSIVE_ENV


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
    undercovers; resampling the rounds within runs would let single warm-up rounds decide). One pair:
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


def ab_samples(runs: list[dict], metric_kind: str, base: dict[str, Case] | None = None) -> dict[str, list[list[float]]]:
    """Per case: for every run of one side, in order, the samples of one metric (Case.rounds: a CPU case's
    timed rounds; else the run's one value). With `base` (a run's cases), keyed like them (`align_cases`)."""
    out: dict[str, list[list[float]]] = {}
    for run in runs:
        cases = cases_of(run) if base is None else align_cases(base, cases_of(run))[0]
        for cid, case in cases.items():
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
    session's noise. `missing`: the first base run's cases that some run lacks, or holds with another workload
    fingerprint or kind of statistic (not comparable: the comparison fails, `ab_exit_code`)."""
    rows = []
    base_cases = cases_of(base_runs[0], "base run")
    comparable = set(base_cases)
    for run in [*base_runs, *new_runs]:  # a case in every run, with the same workload and kind of statistic
        cases = align_cases(base_cases, cases_of(run, "run"))[0]
        comparable = {cid for cid in comparable if cid in cases and cases[cid].fingerprint ==
                      base_cases[cid].fingerprint and cases[cid].kind == base_cases[cid].kind}
    missing = sorted(set(base_cases) - comparable)
    for metric_kind in ("stat", "host", "per_call"):
        a, b = ab_samples(base_runs, metric_kind, base_cases), ab_samples(new_runs, metric_kind, base_cases)
        for cid in sorted(a.keys() & b.keys() & comparable):
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
        [[short_id(r.case), r.metric, f"{r.base_us:.3f}", f"{r.new_us:.3f}", pct(r.ratio - 1),
          f"{pct(r.low - 1)} .. {pct(r.high - 1)}", f"{100 * r.threshold:.1f}%", r.verdict] for r in shown],
    ) if shown else "(every case within its threshold)"]
    lines += [f"MISSING (absent from a run, or its workload or statistic changed): {short_id(c)}" for c in missing]
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


def add_arguments(parser) -> None:
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
    parser.add_argument("--noise", help="noise file (default: the candidate machine's, "
                        ".benchmarks/<machine>/noise-<cpu>-<n>cpus.json)")
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


def run(args) -> int:
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
        if args.noise:
            noise_path, noise = Path(args.noise), load_noise(Path(args.noise))
            if noise is not None and noise.get("machine") != machine_of(runs["new"][0]):
                raise ReportError(f"{noise_path}: noise measured on {noise.get('machine')}, not on this machine")
        else:
            noise, noise_path, why = default_noise(runs["new"][0], new_dir / ".benchmarks")
            if why:
                print(f"pcvr compare: {why}; thresholds are the floors only", file=sys.stderr)
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
