"""Does a noise floor built from some A/A runs hold for a run it has not seen? Leave-one-run-out over A/A runs of
one machine (a case counts only between runs that ran it on the same library sources): each run in turn is held
out, the noise file is built from the others (`build_noise`), and the held-out run is diffed against every other
run in both directions with the thresholds at each K asked for. Every gated REGRESSED row there is a false alarm.
Also, with the same K values, optional planted-slowdown pairs (a base and a new run where the new one is known to
be slower): how many of their gated cases are caught.

    python3 tools/noise_holdout.py .benchmarks/h200/aa_lease*.json.gz --k 2 2.5 3 \
        --planted fixtures/comparison/h200/planted10_base.json fixtures/comparison/h200/planted10_new.json

The noise file's K is the one `pcvr diff` uses (pcvr_lib/compare/noise.py); this tool picks it
(notes/comparison.md, "A noise floor that holds out").
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

from pcvr_lib.compare.diff import diff_runs
from pcvr_lib.compare.noise import build_noise, load_noise
from pcvr_lib.compare.runs import cases_of
from pcvr_lib.report import load_benchmark_json, run_label


def regressed(base: dict, new: dict, noise: dict) -> list[tuple[str, float, float]]:
    """(case, change, threshold) of every gated case the new run regressed on against the base, among the cases
    both runs ran on the same library sources (a case whose code changed between them is no A/A)."""
    before, after = cases_of(base), cases_of(new)

    def same_sources(cid: str) -> bool:
        return cid in before and cid in after and before[cid].sources_digest == after[cid].sources_digest

    return [(r.case, r.change, r.threshold) for r in diff_runs(base, new, noise)
            if r.verdict == "REGRESSED" and same_sources(r.case)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="A/A runs (pytest-benchmark JSON), at least 3")
    parser.add_argument("--k", type=float, nargs="+", default=[2.0, 2.5, 3.0])
    parser.add_argument("--planted", nargs=2, action="append", default=[], metavar=("BASE", "NEW"),
                        help="a pair whose new run carries a planted slowdown (repeatable)")
    parser.add_argument("--noise", help="the noise file the planted pairs are judged with (default: built from "
                        "all the A/A runs)")
    args = parser.parse_args(argv)
    if len(args.runs) < 3:
        parser.error("leave-one-out needs at least 3 runs (2 to build the noise floor from, 1 held out)")
    runs = [load_benchmark_json(p) for p in args.runs]
    names = [run_label(p) for p in args.runs]

    for k in args.k:
        alarms: Counter[str] = Counter()
        pairs = 0
        for held in range(len(runs)):
            rest = [i for i in range(len(runs)) if i != held]
            noise = build_noise([runs[i] for i in rest], [args.runs[i] for i in rest])
            noise["k"] = k
            for other in rest:
                for base, new in ((other, held), (held, other)):
                    pairs += 1
                    for case, change, limit in regressed(runs[base], runs[new], noise):
                        alarms[case] += 1
                        print(f"  K={k:g} {names[base]} -> {names[new]}: {case} {change:+.1%} > {limit:.1%}")
        print(f"K={k:g}: {sum(alarms.values())} false alarm(s) over {pairs} held-out pairs, "
              f"{len(alarms)} distinct case(s)")

    noise = load_noise(Path(args.noise)) if args.noise else build_noise(runs, list(args.runs))
    for base_path, new_path in args.planted:
        base, new = (load_benchmark_json(p) for p in (base_path, new_path))
        for k in args.k:
            noise["k"] = k
            rows = [r for r in diff_runs(base, new, noise) if r.change is not None and r.verdict != "informational"
                    and r.metric in ("device", "cpu")]
            caught = sum(r.verdict == "REGRESSED" for r in rows)
            print(f"planted {run_label(new_path)} K={k:g}: {caught} of {len(rows)} gated case(s) caught")
    noise["k"] = args.k[-1]
    limits = sorted(r.threshold for r in diff_runs(runs[0], runs[1], noise)
                    if r.metric == "device" and r.verdict in ("ok", "faster", "REGRESSED"))
    if limits:
        p90 = limits[min(len(limits) - 1, int(0.9 * len(limits)))]
        print(f"device thresholds at K={args.k[-1]:g} ({len(limits)} cases of {names[0]} -> {names[1]}): "
              f"median {statistics.median(limits):.1%}, p90 {p90:.1%}, {sum(t >= 0.10 for t in limits)} >= 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
