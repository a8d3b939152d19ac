"""Check `pcvr diff` on real runs: A/A pairs must raise no alarm, planted slowdowns must be flagged.

From stored pytest-benchmark JSON only (nothing is run):

    python tools/validate_comparison.py --noise .benchmarks/cpu/noise-intel-xeon-processor-2cpus.json \
        --aa results/val/aa1.json results/val/aa2.json \
        --planted 0.05=results/val/p05.json 0.10=results/val/p10.json \
        [--fixtures fixtures/comparison/cpu] [--json results/val/validation.json]

Or, for interleaved comparisons (`pcvr compare` folders of NN_base.json / NN_new.json runs; "DIR1+DIR2"
joins the pairs of two folders into one comparison):

    python tools/validate_comparison.py --interleaved --noise .benchmarks/cpu/noise-intel-xeon-processor-2cpus.json \
        --aa results/c10s/aa1 results/c10s/aa2+results/c10s/aa3 --planted 0.10=results/c10s/p10_1 \
        [--start 4] [--fixtures fixtures/comparison/cpu/sbs]

replays each as `pcvr compare --rounds START --until-clear ALL` would have run it: the verdicts after the
first START pairs, then one pair more while a gated case is unclear, up to all the folder holds; prints the
A/A alarms (REGRESSED), the inconclusive comparisons, and per group how many planted cases were flagged.

Prints, for every pair of --aa runs, the alarms of `pcvr diff` (REGRESSED or MISSING: false alarms), and
for every planted run against every A/A run, which of the gated cases it ran were flagged; per group, the
detection limit: the smallest planted size that was flagged in every case and every pair. With
--fixtures, writes the first A/A pair and each planted pair (the base cut to the cases the planted run
has) as JSON fixtures for the CI tests (smoke_tests/test_comparison_fixtures.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pcvr_lib.compare import FAILING, cases_of, diff_runs, load_noise, load_run  # noqa: E402
from pcvr_lib.report import format_table, run_label  # noqa: E402


def only_cases(run: dict, ids: set[str]) -> dict:
    return {**run, "benchmarks": [b for b in run["benchmarks"] if b["fullname"] in ids]}


def by_metric(rows) -> str:
    return ", ".join(f"{m} {sum(r.metric == m for r in rows)}" for m in sorted({r.metric for r in rows}))


def alarms(rows) -> list:
    return [r for r in rows if r.verdict in FAILING]


def median_values(runs: list[dict]) -> dict[tuple[str, str], float]:
    """Per (case, gated metric): the median over the A/A runs."""
    import statistics

    values: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for cid, case in cases_of(run).items():
            if case.kind in case.values:
                values.setdefault((cid, case.kind), []).append(case.values[case.kind])
    return {k: statistics.median(v) for k, v in values.items()}


def write_fixtures(out: Path, aa: dict[str, dict], planted_specs: list[str], noise: str, must: float) -> None:
    """The first A/A pair (must pass) and each planted run against the first A/A run cut to its cases (must
    fail; `planted_cases`: the gated cases slower than the A/A median by `must` or more, which must be flagged),
    plus expected.json for smoke_tests/test_comparison_fixtures.py."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(aa)
    medians = median_values(list(aa.values()))
    (out / "aa_base.json").write_text(json.dumps(aa[names[0]]))
    (out / "aa_new.json").write_text(json.dumps(aa[names[1]]))
    pairs = [{"base": "aa_base.json", "new": "aa_new.json", "expect": "pass"}]
    for spec in planted_specs:
        size_text, _, path = spec.partition("=")
        planted = load_run(path)
        tag = f"{round(100 * float(size_text)):02d}"
        must_flag = sorted(cid for cid, case in cases_of(planted).items()
                           if case.gated and (cid, case.kind) in medians
                           and case.values[case.kind] >= (1 + must) * medians[(cid, case.kind)])
        if not must_flag:
            print(f"planted {size_text}: no case {must:.0%} over the A/A median: not a fixture")
            continue
        (out / f"planted{tag}_base.json").write_text(json.dumps(only_cases(aa[names[0]], set(cases_of(planted)))))
        (out / f"planted{tag}_new.json").write_text(json.dumps(planted))
        pairs.append({"base": f"planted{tag}_base.json", "new": f"planted{tag}_new.json", "expect": "fail",
                      "planted": float(size_text), "planted_cases": must_flag})
    manifest = {"noise": noise, "must_catch": must, "aa_runs": names, "pairs": pairs}
    (out / "expected.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"fixtures written under {out}")


def interleaved_runs(spec: str) -> tuple[dict[str, list[dict]], list[Path]]:
    """The runs of one or more `pcvr compare` folders ("DIR" or "DIR1+DIR2"), their pairs in order."""
    from pcvr_lib.compare import replay_runs

    runs: dict[str, list[dict]] = {"base": [], "new": []}
    folders = [Path(part) for part in spec.split("+")]
    for folder in folders:
        part, _ = replay_runs(folder)
        pairs = min(len(part["base"]), len(part["new"]))
        for side in runs:
            runs[side] += part[side][:pairs]
    return runs, folders


def until_clear(runs: dict[str, list[dict]], noise: dict | None, start: int):
    """Replay `pcvr compare --rounds START --until-clear ALL`: (pairs used, rows, missing)."""
    from pcvr_lib.compare import ab_compare, unclear

    total = min(len(runs["base"]), len(runs["new"]))
    used = min(start, total)
    while True:
        rows, missing = ab_compare(runs["base"][:used], runs["new"][:used], noise)
        if used >= total or not unclear(rows) or missing:
            return used, rows, missing
        used += 1


def compact(run: dict) -> dict:
    """A run without what the comparison never reads (the data file's generation record, per-column list
    orders, pytest-benchmark's calibrated per-round list): fixtures stay small."""
    drop = ("data_file", "list_order_rows", "list_order_detected", "ratio_to_pyarrow_read_per_round")
    benches = []
    for bench in run["benchmarks"]:
        extra = {k: v for k, v in (bench.get("extra_info") or {}).items() if k not in drop}
        stats = {k: v for k, v in (bench.get("stats") or {}).items() if k != "data"}
        benches.append({**{k: v for k, v in bench.items() if k != "options"}, "extra_info": extra, "stats": stats})
    info = run.get("machine_info") or {}
    cpu = {k: v for k, v in (info.get("cpu") or {}).items() if k != "flags"}
    return {**run, "machine_info": {**info, "cpu": cpu}, "benchmarks": benches}


def validate_interleaved(args, noise: dict | None) -> int:
    from pcvr_lib.compare import cases_of, short_id, unclear

    result: dict = {"noise": args.noise, "start": args.start, "comparisons": []}
    table, caught_by_group, alarms_aa, inconclusive = [], {}, 0, 0
    specs = [(0.0, spec) for spec in args.aa] + [(float(s.partition("=")[0]), s.partition("=")[2])
                                                 for s in args.planted]
    fixtures = Path(args.fixtures) if args.fixtures else None
    for size, spec in specs:
        runs, folders = interleaved_runs(spec)
        used, rows, missing = until_clear(runs, noise, args.start)
        gated = [r for r in rows if r.metric in ("cpu", "device") and r.verdict != "informational"]
        flagged = sorted(r.case for r in rows if r.verdict == "REGRESSED")
        open_rows = unclear(rows)
        inconclusive += bool(open_rows and not flagged)
        if size == 0:
            alarms_aa += len(flagged) + len(missing)
        groups = {cid: c.group for cid, c in cases_of(runs["base"][0]).items()}
        for r in gated:
            if size:
                caught_by_group.setdefault((groups[r.case], size), []).append(r.verdict == "REGRESSED")
            table.append([spec, f"{size:.0%}", str(used), short_id(r.case), f"{100 * (r.ratio - 1):+.1f}%",
                          f"{100 * (r.low - 1):+.1f} .. {100 * (r.high - 1):+.1f}", r.verdict])
        name = "+".join(f.name for f in folders)
        entry = {"name": name, "folders": [f.name for f in folders], "planted": size, "pairs_used": used,
                 "flagged": flagged, "missing": missing, "unclear": sorted(r.case for r in open_rows),
                 "verdicts": {short_id(r.case): [round(100 * (r.ratio - 1), 1), round(100 * (r.low - 1), 1),
                                                 round(100 * (r.high - 1), 1), r.verdict] for r in gated}}
        result["comparisons"].append(entry)
        if fixtures:  # every folder once, all its pairs, compacted; the manifest says which ones a comparison joins
            for folder in folders:
                dst = fixtures / folder.name
                if dst.exists():
                    shutil.rmtree(dst)
                dst.mkdir(parents=True)
                for path in sorted(folder.glob("[0-9][0-9]_*.json")):
                    (dst / path.name).write_text(json.dumps(compact(json.loads(path.read_text()))))
    print(format_table(["comparison", "planted", "pairs", "case", "change", "95% interval", "verdict"], table))
    print(f"\nA/A: {sum(1 for c in result['comparisons'] if not c['planted'])} comparisons, {alarms_aa} alarm(s); "
          f"inconclusive comparisons (a case still unclear, none flagged): {inconclusive}")
    for (group, size), flags in sorted(caught_by_group.items()):
        print(f"  {group:28s} planted {size:4.0%}: flagged {sum(flags)}/{len(flags)}")
    result["detection_limit"] = detection_limits(caught_by_group)
    result["aa_alarms"] = alarms_aa
    result["inconclusive"] = inconclusive
    if fixtures:
        manifest = {"noise": args.noise, "start": args.start, "comparisons": [
            {k: c[k] for k in ("name", "folders", "planted", "pairs_used", "flagged", "unclear", "verdicts")}
            for c in result["comparisons"]]}
        (fixtures / "expected.json").write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"fixtures written under {fixtures}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


def detection_limits(caught_by_group: dict[tuple[str, float], list[bool]]) -> dict[str, float | None]:
    """Per group, the smallest planted size flagged in every comparison (None: no size always flagged)."""
    limits: dict[str, float | None] = {}
    for (group, size), flags in sorted(caught_by_group.items()):
        limits.setdefault(group, None)
        if all(flags) and (limits[group] is None or size < limits[group]):
            limits[group] = size
    return limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", required=True, help="noise file (measured on other runs than --aa)")
    parser.add_argument("--interleaved", action="store_true",
                        help="--aa and --planted name `pcvr compare` folders (DIR or DIR1+DIR2), not runs")
    parser.add_argument("--start", type=int, default=4, help="--interleaved: pairs before the first verdict (4)")
    parser.add_argument("--aa", nargs="+", required=True, help="runs of one tree (A/A)")
    parser.add_argument("--planted", nargs="*", default=[], metavar="SIZE=JSON",
                        help="runs with a planted slowdown of SIZE (e.g. 0.10=p10.json)")
    parser.add_argument("--fixtures", help="write the A/A and planted pairs here")
    parser.add_argument("--json", dest="json_out", help="write the results as JSON here")
    parser.add_argument("--must-catch", type=float, default=0.10,
                        help="fixtures: a case slower than the A/A median by this much must be flagged (0.10)")
    args = parser.parse_args(argv)

    noise = load_noise(Path(args.noise))
    if noise is None:
        parser.error(f"--noise {args.noise}: no such file")
    if args.interleaved:
        return validate_interleaved(args, noise)
    aa = {run_label(p): load_run(p) for p in args.aa}
    result: dict = {"noise": args.noise, "aa_pairs": [], "planted": []}

    common = set.intersection(*(set(cases_of(run)) for run in aa.values()))
    aa = {name: only_cases(run, common) for name, run in aa.items()}
    print(f"A/A: {len(aa)} runs, the {len(common)} cases all of them ran, every ordered pair compared with "
          f"{args.noise}; host and per-call time are reported (their median shift per group), never alarms")
    for (na, a), (nb, b) in itertools.permutations(aa.items(), 2):
        rows = diff_runs(a, b, noise)
        bad = alarms(rows)
        shifts = ", ".join(f"{r.case[6:]} {r.metric} {100 * r.change:+.0f}%" for r in rows if r.verdict == "shift")
        result["aa_pairs"].append({"base": na, "new": nb, "alarms": [(r.case, r.metric, r.change) for r in bad]})
        print(f"  {na} -> {nb}: {len(bad)} alarm(s) [{by_metric(bad) or '-'}]"
              + (f"; shift per group: {shifts}" if shifts else "") + "".join(
            f"\n      {r.case.split('::')[-1]} {r.metric} {100 * (r.change or 0):+.1f}% ({r.verdict})" for r in bad))

    table = []
    caught_by_group: dict[tuple[str, float], list[bool]] = {}
    for spec in args.planted:
        size_text, _, path = spec.partition("=")
        size = float(size_text)
        planted = load_run(path)
        ids = set(cases_of(planted))
        for name, base in aa.items():
            rows = diff_runs(only_cases(base, ids), planted, noise)
            base_cases = cases_of(base)  # a planted case the base did not run is no comparison: left out
            gated = {(r.case, r.metric): r for r in rows
                     if r.metric in ("device", "cpu") and r.verdict != "informational" and r.case in base_cases}
            for (cid, metric), r in sorted(gated.items()):
                caught = r.verdict == "REGRESSED"
                caught_by_group.setdefault((base_cases[cid].group, size), []).append(caught)
                table.append([f"{size:.0%}", name, cid.split("::")[-1], metric, f"{100 * r.change:+.1f}%",
                              f"{100 * r.threshold:.1f}%", r.verdict])
            result["planted"].append({"size": size, "file": path, "base": name,
                                      "rows": [[cid, m, r.change, r.threshold, r.verdict]
                                               for (cid, m), r in sorted(gated.items())]})
    if table:
        print(format_table(["planted", "base", "case", "metric", "change", "threshold", "verdict"], table))
        print("\ndetection per group (flagged / compared):")
        for (group, size), flags in sorted(caught_by_group.items()):
            print(f"  {group:28s} {size:5.0%}: {sum(flags)}/{len(flags)}")
        limits = result["detection_limit"] = detection_limits(caught_by_group)
        print("detection limit (smallest planted size flagged every time): " + ", ".join(
            f"{g} {'-' if s is None else f'{s:.0%}'}" for g, s in limits.items()))

    if args.fixtures:
        write_fixtures(Path(args.fixtures), aa, args.planted, args.noise, args.must_catch)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
