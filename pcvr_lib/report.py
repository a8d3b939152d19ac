"""Read pytest-benchmark JSON: `pcvr report` (summary table) and `pcvr compare` (regression gate).

`pcvr compare` wraps pytest-benchmark's own `--benchmark-compare` / `--benchmark-compare-fail`, adding
the checks it lacks: a stored run must exist, come from the same kind of accelerator, and share cases
with the current suite; otherwise it refuses with exit code 2 and says why.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# extra_info keys worth a column, in display order, with their header and format.
SUMMARY_FIELDS = [
    ("rows_per_sec", "rows/s", "{:,.0f}"),
    ("ratio_to_pyarrow_read", "vs pyarrow", "{:.2f}"),
    ("ratio_to_copy_floor", "vs copy", "{:.2f}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("speedup_vs_torch", "vs torch", "{:.2f}x"),
    ("device_us", "device us", "{:.1f}"),
    ("gbps", "GB/s", "{:,.0f}"),
    ("fraction_of_copy_ceiling", "% copy", "{:.0%}"),
    ("tflops", "TFLOP/s", "{:.1f}"),
    ("max_abs_error", "max err", "{:.1e}"),
]
EXIT_REFUSED = 2


class ReportError(RuntimeError):
    """A benchmark file or comparison request that cannot be used; the message says why."""


KNOWN_ERRORS = (ReportError,)  # the CLI boundary prints these as one line, exit 2


def load_benchmark_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such benchmark file (make bench writes results/bench.json)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not a pytest-benchmark JSON file ({exc})") from exc
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise ReportError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    return data


def _format_seconds(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _extra_value(extra: dict, key: str):
    """Look a summary field up in extra_info, also one level down (e.g. cache_stats.hit_rate)."""
    if key in extra:
        return extra[key]
    for value in extra.values():
        if isinstance(value, dict) and key in value:
            return value[key]
    return None


def summary_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    benches = data["benchmarks"]
    extras = [b.get("extra_info", {}) for b in benches]
    fields = [f for f in SUMMARY_FIELDS if any(_extra_value(e, f[0]) is not None for e in extras)]
    header = ["group", "case", "median", *[h for _, h, _ in fields]]
    rows = []
    for bench in sorted(benches, key=lambda b: (b.get("group") or "", b["name"])):
        stats = bench.get("stats") or {}
        extra = bench.get("extra_info", {})
        cells = [bench.get("group") or "-", bench.get("param") or bench["name"], _format_seconds(stats.get("median"))]
        for key, _, fmt in fields:
            value = _extra_value(extra, key)
            cells.append(fmt.format(value) if isinstance(value, int | float) else "-")
        rows.append(cells)
    return header, rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
    return "\n".join(lines)


def machine_summary(data: dict) -> str:
    info = data.get("machine_info", {})
    gpu = info.get("gpu") or {}
    libs = info.get("libraries") or {}
    parts = [info.get("node", "?"), info.get("cpu", {}).get("brand_raw", "?"), f"{info.get('cpu_count', '?')} cpus"]
    parts.append(gpu.get("name", "no GPU") if gpu else "no GPU")
    parts += [f"{k} {v}" for k, v in libs.items() if v]
    info = data.get("commit_info", {})
    # measured_tree: set on snapshots whose git metadata is not the code that ran (.benchmarks/README.md)
    measured = info.get("measured_tree")
    commit = measured.split()[0].rstrip(":") if measured else (info.get("id") or "")[:10]
    return " | ".join(str(p) for p in parts) + (f" | commit {commit}" if commit else "")


def add_report_arguments(parser) -> None:
    parser.add_argument("json_file", nargs="?", default="results/bench.json", help="pytest-benchmark JSON")


def run_report(args) -> int:
    try:
        data = load_benchmark_json(args.json_file)
    except ReportError as exc:
        print(f"pcvr report: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if not data["benchmarks"]:
        print(f"pcvr report: {args.json_file} holds no benchmark results", file=sys.stderr)
        return EXIT_REFUSED
    print(machine_summary(data))
    print(format_table(*summary_rows(data)))
    return 0


# ---------------------------------------------------------------- compare


def machine_id() -> str:
    from pytest_benchmark.utils import get_machine_id

    return get_machine_id()


def current_gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def stored_runs(storage: Path) -> list[Path]:
    folder = storage / machine_id()
    return sorted(folder.glob("[0-9][0-9][0-9][0-9]_*.json")) if folder.is_dir() else []


def resolve_baseline(storage: Path, wanted: str | None) -> Path:
    """The stored run to compare with: a JSON path, a run number/id prefix, or the newest stored run."""
    if wanted and (wanted.endswith(".json") or Path(wanted).is_file()):
        path = Path(wanted)
        if not path.is_file():
            raise ReportError(f"nothing to compare with: {path} does not exist")
        return path
    runs = stored_runs(storage)
    if not runs:
        raise ReportError(
            f"nothing to compare with: no stored run under {storage / machine_id()}; run `make bench` first "
            "(it stores each run), or pass --with path/to/run.json (make compare COMPARE_WITH=path/to/run.json)"
        )
    if wanted:
        matches = [r for r in runs if r.name.startswith(wanted) or r.name[5:].startswith(wanted)]
        if not matches:
            names = ", ".join(r.name for r in runs[-5:])
            raise ReportError(f"nothing to compare with: no stored run matches {wanted!r} (newest: {names})")
        return matches[-1]
    return runs[-1]


def check_same_accelerator(baseline: dict, baseline_path: Path, gpu_now: str | None) -> None:
    from pcvr_lib.timing import assert_comparable

    try:
        assert_comparable(baseline.get("machine_info", {}), {"gpu": {"name": gpu_now} if gpu_now else None})
    except ValueError as exc:
        raise ReportError(f"{baseline_path}: {exc}") from exc


def add_compare_arguments(parser) -> None:
    parser.add_argument("--with", dest="baseline", help="stored run number/id prefix or a pytest-benchmark JSON path")
    parser.add_argument("--fail", nargs="+", default=["median:15%"], help="--benchmark-compare-fail expressions")
    parser.add_argument("--storage", default=".benchmarks", help="pytest-benchmark storage folder")
    parser.add_argument("--output", default="results/compare.json", help="where the new run's JSON goes")
    parser.add_argument("tests", nargs="*", default=["perf_tests"], help="test paths / pytest args")


def run_compare(args) -> int:
    try:
        baseline_path = resolve_baseline(Path(args.storage), args.baseline)
        baseline = load_benchmark_json(baseline_path)
        check_same_accelerator(baseline, baseline_path, current_gpu_name())
    except ReportError as exc:
        print(f"pcvr compare: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"pcvr compare: comparing with {baseline_path}")
    # pytest-benchmark compares only against runs in its storage layout, so the baseline is copied into a
    # private storage folder as run 0001 of this machine id.
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / machine_id()
        run_dir.mkdir()
        shutil.copy(baseline_path, run_dir / "0001_baseline.json")
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pytest", *args.tests, "--benchmark-only", "-q",
            f"--benchmark-storage=file://{tmp}", "--benchmark-compare=0001",
            f"--benchmark-json={args.output}", "--benchmark-compare-fail", *args.fail,
        ]  # fmt: skip
        code = subprocess.call(cmd)
    if Path(args.output).is_file():
        now = {b["fullname"] for b in load_benchmark_json(args.output)["benchmarks"]}
        then = {b["fullname"] for b in baseline["benchmarks"]}
        if not now & then:
            print(f"pcvr compare: nothing comparable: {baseline_path} shares no case with this run", file=sys.stderr)
            return EXIT_REFUSED
        print(f"pcvr compare: {len(now & then)} cases compared, {len(now - then)} new, {len(then - now)} not run now")
    return code
