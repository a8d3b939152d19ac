"""Two smokes of the same models and seeds, run on different operator backends (e.g. torch against triton):
does the other backend give the same AUC within seed noise, and what does it cost?

    python3 tools/smoke_compare.py BASE_DIR OTHER_DIR [--json OUT.json]

Each DIR is a `pcvr smoke --out DIR` folder; every <model>_seed<N>/ run in it with an evaluation.json counts, so
a smoke cut short still compares the runs it finished (a run in only one of the two is listed, not compared).
Per model, over the seeds both ran:
- AUC of each seed in both, the paired difference (same seed, data and steps: only the numerics differ) and
  the seed noise: the sample SD of BASE's AUC over those seeds.
- Verdict (the target: "same AUC as the torch backend within seed noise"): `same` when every paired |difference|
  is below the seed noise, `differs` otherwise, `unclear` with fewer than two seeds (no noise estimate).
- The training losses step by step: the largest |difference| relative to BASE's loss at that step (the first
  steps show numerics before the trajectories are allowed to drift apart).
- Train seconds per run (the trainer's elapsed time, compiles of a first run included) in both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def load_runs(folder: Path) -> dict[tuple[str, int], dict]:
    """(model, seed) -> {auc, losses, train_sec} of every finished run under a smoke output folder."""
    runs = {}
    for evaluation in sorted(folder.glob("*_seed*/evaluation.json")):
        run_dir = evaluation.parent
        ev = json.loads(evaluation.read_text())
        summary_path = run_dir / "training_summary.json"
        if not summary_path.exists():
            raise SystemExit(f"smoke_compare: {run_dir} has evaluation.json but no training_summary.json")
        summary = json.loads(summary_path.read_text())
        runs[(ev["model"], int(ev["seed"]))] = {
            "auc": float(ev["metrics"]["auc"]),
            "losses": [float(x) for x in summary["losses"]],
            "train_sec": float(summary["telemetry"]["elapsed_sec"]),
        }
    return runs


def compare(base: dict, other: dict) -> dict:
    """Per model: seeds, AUCs, paired differences, seed noise, verdict, loss agreement, cost."""
    models = sorted({model for model, _ in base} | {model for model, _ in other})
    out = {}
    for model in models:
        seeds = sorted(s for (m, s) in base if m == model and (m, s) in other)
        only = sorted({f"base seed {s}" for (m, s) in base if m == model and s not in seeds}
                      | {f"other seed {s}" for (m, s) in other if m == model and s not in seeds})
        row: dict = {"seeds": seeds, "unpaired": only}
        if seeds:
            pairs = [(base[(model, s)], other[(model, s)]) for s in seeds]
            for s, (b, o) in zip(seeds, pairs, strict=True):
                if len(b["losses"]) != len(o["losses"]):
                    raise SystemExit(f"smoke_compare: {model} seed {s} trained {len(b['losses'])} steps in one smoke "
                                     f"and {len(o['losses'])} in the other: not the same smoke settings")
            diffs = [o["auc"] - b["auc"] for b, o in pairs]
            noise = statistics.stdev([b["auc"] for b, _ in pairs]) if len(seeds) >= 2 else None
            if noise is None:
                verdict = "unclear"
            else:
                verdict = "same" if max(abs(d) for d in diffs) < noise else "differs"
            loss_rel = [max(abs(o_l - b_l) / max(abs(b_l), 1e-12)
                            for b_l, o_l in zip(b["losses"], o["losses"], strict=True))
                        for b, o in pairs if b["losses"]]
            first_rel = [abs(o["losses"][0] - b["losses"][0]) / max(abs(b["losses"][0]), 1e-12)
                         for b, o in pairs if b["losses"]]
            base_sec = statistics.mean(b["train_sec"] for b, _ in pairs)
            other_sec = statistics.mean(o["train_sec"] for _, o in pairs)
            row.update(base_auc=[b["auc"] for b, _ in pairs], other_auc=[o["auc"] for _, o in pairs],
                       auc_diff=diffs, max_abs_auc_diff=max(abs(d) for d in diffs), seed_noise=noise,
                       verdict=verdict, first_loss_rel_diff=max(first_rel, default=None),
                       max_loss_rel_diff=max(loss_rel, default=None), base_train_sec=base_sec,
                       other_train_sec=other_sec, train_sec_ratio=other_sec / base_sec if base_sec > 0 else None)
        out[model] = row
    return out


def table(result: dict, base_name: str, other_name: str) -> str:
    def fmt(x, spec=".4f"):
        return "-" if x is None else format(x, spec)

    lines = [f"| model | seeds | AUC {base_name} | AUC {other_name} | max abs diff | seed noise (SD) | verdict | "
             f"loss rel diff step 1 / max | train s {base_name} / {other_name} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, row in result.items():
        if not row["seeds"]:
            lines.append(f"| {model} | none paired ({', '.join(row['unpaired'])}) | | | | | | | |")
            continue
        lines.append(
            f"| {model} | {','.join(map(str, row['seeds']))} | {' / '.join(fmt(a) for a in row['base_auc'])} | "
            f"{' / '.join(fmt(a) for a in row['other_auc'])} | {fmt(row['max_abs_auc_diff'])} | "
            f"{fmt(row['seed_noise'])} | {row['verdict']} | {fmt(row['first_loss_rel_diff'], '.1e')} / "
            f"{fmt(row['max_loss_rel_diff'], '.1e')} | {fmt(row['base_train_sec'], '.1f')} / "
            f"{fmt(row['other_train_sec'], '.1f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the reference smoke's --out folder (e.g. the torch backend's)")
    parser.add_argument("other", type=Path, help="the smoke to check against it (e.g. every switch on triton)")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    for folder in (args.base, args.other):
        if not folder.is_dir():
            parser.error(f"{folder}: not a folder")
    base, other = load_runs(args.base), load_runs(args.other)
    if not base or not other:
        parser.error(f"no finished runs (<model>_seed<N>/evaluation.json) in {args.base if not base else args.other}")
    result = compare(base, other)
    print(table(result, args.base.name, args.other.name))
    if args.json:
        args.json.write_text(json.dumps({"base": str(args.base), "other": str(args.other), "models": result},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
