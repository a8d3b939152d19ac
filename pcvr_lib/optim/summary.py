"""Print the optimizer benchmarks of a pytest-benchmark JSON as one short table.

    python -m pcvr_lib.optim.summary results/optim.json
"""

from __future__ import annotations

import re
import sys

from pcvr_lib.report import ReportError, load_benchmark_json


def rows(data: dict) -> list[tuple]:
    out = []
    for b in data.get("benchmarks", []):
        m = re.search(r"optimizer=([\w]+),device=(\w+),workload=(\w+)", b.get("name", ""))
        if not m:
            continue
        kind = "step" if b["name"].startswith("test_optimizer_step") else "train"
        e = b.get("extra_info", {})
        out.append((m.group(3), m.group(2), kind, m.group(1), b["stats"]["median"] * 1e6,
                    e.get("device_us"), e.get("ratio_to_fused_adamw"), e.get("optimizer_step_us"),
                    e.get("final_loss"), e.get("ns_sigma_min"), e.get("ns_sigma_max")))
    return sorted(out, key=lambda r: (r[0], r[1], r[2], r[4]))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pcvr_lib.optim.summary BENCH.json", file=sys.stderr)
        return 2
    try:
        data = load_benchmark_json(argv[0])
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'workload':10} {'dev':4} {'what':5} {'optimizer':22} {'median us':>10} {'device us':>10} "
          f"{'x fused':>8} {'step us':>9} {'loss':>8} {'NS sigma':>13}")
    for r in rows(data):
        sig = "-" if r[9] is None else f"{r[9]:.2f}-{r[10]:.2f}"
        print(f"{r[0]:10} {r[1]:4} {r[2]:5} {r[3]:22} {r[4]:10.1f} {fmt(r[5], '10.1f'):>10} "
              f"{fmt(r[6], '8.2f'):>8} {fmt(r[7], '9.1f'):>9} {fmt(r[8], '8.4f'):>8} {sig:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
