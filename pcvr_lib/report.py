"""`pcvr report FILE [--view summary|cases|optim|data|models|status] [--json OUT]`: the one printer of
pytest-benchmark JSON.

Views: `summary` (every case, the extra_info columns it has, whether its sources are still this tree's),
`cases` (kernels: one row per case with every backend's per-call [device] time and the ratios), `optim`
(optimizers), `data` (data pipeline), `models` (model x backend x phase), `status` (the header lines only).
Every view starts with the machine, whether the run was cut (perf_tests/bench_plugin.py) and the state of
the cases' sources (pcvr_lib.sources: fresh, stale, unknown, third-party); a stale case's cells say `stale`.
`--json OUT` writes each case's id, median, sources state and changed files.
Comparisons of runs live in pcvr_lib/compare/ (`pcvr diff`, `pcvr compare`, `pcvr noise`).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

from pcvr_lib import sources

# extra_info keys worth a column, in display order, with their header and format.
SUMMARY_FIELDS = [
    ("rows_per_sec", "rows/s", "{:,.0f}"),
    ("ratio_to_pyarrow_read", "vs pyarrow", "{:.2f}"),
    ("ratio_to_copy_floor", "vs copy", "{:.2f}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("speedup_vs_torch", "vs torch", "{:.2f}x"),
    ("per_call_us", "per-call us", "{:.1f}"),
    ("device_us", "device us", "{:.1f}"),
    ("host_us", "host us", "{:.1f}"),
    ("gbps", "GB/s", "{:,.0f}"),
    ("fraction_of_copy_ceiling", "% copy", "{:.0%}"),
    ("tflops", "TFLOP/s", "{:.1f}"),
    ("max_abs_error", "max err", "{:.1e}"),
]
EXIT_REFUSED = 2


class ReportError(RuntimeError):
    """A benchmark file or comparison request that cannot be used; the message says why."""


KNOWN_ERRORS = (ReportError,)  # the CLI boundary prints these as one line, exit 2


def run_label(path: str | Path) -> str:
    """A stored run's name without its suffixes: "aa_run1" for aa_run1.json and for aa_run1.json.gz."""
    name = Path(path).name
    return name.removesuffix(".gz").removesuffix(".json")


def load_benchmark_json(path: str | Path) -> dict:
    """A pytest-benchmark JSON file, or one gzip-compressed (name ending .gz: archived runs are kept so)."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such benchmark file (make bench writes results/bench.json)")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        data = json.loads(raw)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise ReportError(f"{path}: not a gzip file ({exc}); name a plain JSON file without .gz") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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
    header = ["group", "case", "stat", "median", "sources", *[h for _, h, _ in fields]]
    rows = []
    for bench in sorted(benches, key=lambda b: (b.get("group") or "", b["name"])):
        stats = bench.get("stats") or {}
        extra = bench.get("extra_info", {})
        cells = [bench.get("group") or "-", bench.get("param") or bench["name"], extra.get("stat", "median"),
                 _format_seconds(stats.get("median")), source_state(data, bench)["state"]]
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


def source_state(data: dict, bench: dict) -> dict:
    """pcvr_lib.sources.case_state of one case of a run (fresh, stale, unknown, third-party)."""
    return sources.case_state(bench.get("extra_info") or {}, data.get("source_files") or {})


def sources_summary(data: dict) -> str:
    """One line: how many cases ran code that is still this tree's, and which files changed."""
    states = [source_state(data, b) for b in data["benchmarks"]]
    counts = {state: sum(s["state"] == state for s in states)
              for state in (sources.FRESH, sources.STALE, sources.UNKNOWN, sources.THIRD_PARTY)}
    notes = {sources.UNKNOWN: "no digest recorded: a run from before source digests",
             sources.THIRD_PARTY: "peers: a library's code, its version in machine_info.libraries"}
    changed = sorted({path for s in states for path in s["changed"]})
    if changed:
        notes[sources.STALE] = "changed: " + ", ".join(changed)
    parts = [f"{n} {state}" + (f" ({notes[state]})" if state in notes else "") for state, n in counts.items() if n]
    return "sources: " + ", ".join(parts)


def cut_summary(data: dict) -> str | None:
    """The line of a run that a signal, a timeout or -x cut short (the `cut` field bench_plugin writes)."""
    cut = data.get("cut")
    if not cut:
        return None
    return (f"cut ({cut.get('reason')}): {len(data['benchmarks'])} case(s) kept, {cut.get('finished')} of "
            f"{cut.get('collected')} finished, {len(cut.get('interrupted') or [])} interrupted (dropped), "
            f"{cut.get('not_run')} not run")


def skipped_summary(data: dict) -> str | None:
    """The skipped cases by reason (the `skipped` field bench_plugin writes: a peer not installed, a backend
    that cannot run there), most common first."""
    skipped = data.get("skipped") or {}
    if not skipped:
        return None
    counts = Counter(skipped.values())
    parts = [f"{n} x {reason}" for reason, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    return f"skipped {len(skipped)} case(s): " + "; ".join(parts)


def _stale_mark(data: dict, bench: dict) -> str:
    return " stale" if source_state(data, bench)["state"] == sources.STALE else ""


def report_json(data: dict) -> dict:
    """What `--json` writes: per case its id, statistic, median and sources state."""
    cases = [{"id": b.get("fullname") or b.get("name"), "stat": (b.get("extra_info") or {}).get("stat", "median"),
              "median": (b.get("stats") or {}).get("median"), **source_state(data, b)}
             for b in data["benchmarks"]]
    return {"cut": data.get("cut"), "skipped": data.get("skipped") or {}, "sources": sources_summary(data),
            "cases": cases}


# ---------------------------------------------------------------- views


def case_times(bench: dict) -> tuple[float, float | None, float | None]:
    """(per-call us, device us, host us) of a GPU case, from new runs (stats = device time) and from
    runs made before the split (stats = per-call time) alike."""
    extra = bench.get("extra_info", {})
    median_us = bench["stats"]["median"] * 1e6
    per_call = extra.get("per_call_us", median_us) if extra.get("stat") == "device" else median_us
    return per_call, extra.get("device_us"), extra.get("host_us")


KERNEL_OURS = ("triton", "tilelang", "cuembed")
# peers in display order; a backend of neither list is shown as a peer after these
KERNEL_PEERS = ("torch", "torch_compile", "liger", "quack", "fbgemm", "sdpa", "sdpa_flash", "sdpa_efficient",
                "sdpa_cudnn", "fa4", "flex")


def _backend_order(backend: str) -> tuple:
    if backend in KERNEL_OURS:
        return (2, KERNEL_OURS.index(backend), backend)
    return (0, KERNEL_PEERS.index(backend), backend) if backend in KERNEL_PEERS else (1, 0, backend)


def cases_view(data: dict) -> str:
    """Markdown, one row per (direction, op, shape, dtype): every backend's per-call us [device us] (peers:
    torch, torch.compile, Liger, the SDPA backends, flex_attention; then ours), the best of ours as a fraction
    of the copy ceiling (and its TFLOP/s when the case counts FLOPs), each of ours against torch and against
    the best peer (per call; the speedups the benchmark recorded, else computed here), and the
    Triton/TileLang device-time ratio."""
    cases: dict = {}
    for bench in data["benchmarks"]:
        e = bench.get("extra_info", {})
        if "op" not in e or "[" in e["op"]:  # tile-sweep variants have their own labels
            continue
        shape = e["shape"] + (f",dist={e['dist']}" if "dist" in e else "")
        per_call, device, _ = case_times(bench)
        cases.setdefault((e["dir"], e["op"], shape, e["dtype"]), {})[e["backend"]] = {
            "per_call": per_call, "device": device, **e, "_stale": _stale_mark(data, bench)}
    backends = sorted({b for by in cases.values() for b in by}, key=_backend_order)
    with_flops = any(by[b].get("tflops") is not None for by in cases.values() for b in by if b in KERNEL_OURS)
    lines = []
    for direction in sorted({k[0] for k in cases}, key=lambda d: (d != "fwd", d)):
        extra = ["best ours % copy", *(["best ours TFLOP/s"] if with_flops else []), "ours vs torch",
                 "ours vs best peer", "triton/tilelang device"]
        lines += [f"\n{direction}: per-call us [device us]\n",
                  "| op | shape | dtype | " + " | ".join(backends) + " | " + " | ".join(extra) + " |",
                  "|---" * (len(backends) + 3 + len(extra)) + "|"]
        for (dr, op, shape, dtype), by in cases.items():
            if dr != direction:
                continue
            cells = [f"{by[b]['per_call']:.1f} [{_fmt(by[b]['device'], '.1f')}]{by[b]['_stale']}" if b in by else "-"
                     for b in backends]
            ours = [b for b in KERNEL_OURS if b in by]
            peers = {b: by[b]["per_call"] for b in by if b not in KERNEL_OURS}
            best = min(ours, key=lambda b: by[b]["per_call"]) if ours else None
            peer = min(peers, key=peers.get) if peers else None
            frac = by[best].get("fraction_of_copy_ceiling") if best else None
            cols = [f"{100 * frac:.1f}% ({best})" if frac is not None else "-"]
            if with_flops:
                cols.append(_fmt(by[best].get("tflops") if best else None, ".1f"))
            cols.append(", ".join(f"{b} {_speedup(by, b, 'torch', by.get('torch', {}).get('per_call'))}"
                                  for b in ours) if ours and ("torch" in by or any(
                                      "speedup_vs_torch" in by[b] for b in ours)) else "-")
            named = {by[b].get("best_peer") for b in ours if by[b].get("best_peer")}
            peer_name = named.pop() if len(named) == 1 else peer
            cols.append(", ".join(f"{b} {_speedup(by, b, 'best_peer', peers.get(peer))}" for b in ours)
                        + f" ({peer_name})" if ours and peer else "-")
            cols.append(f"{by['triton']['device'] / by['tilelang']['device']:.2f}"
                        if {"triton", "tilelang"} <= by.keys() and by["tilelang"]["device"]
                        and by["triton"]["device"] is not None else "-")
            lines.append(f"| {op} | {shape} | {dtype} | " + " | ".join(cells) + " | " + " | ".join(cols) + " |")
    return "\n".join(lines) if lines else "(no kernel cases in this file)"


def _speedup(by: dict, backend: str, against: str, against_us: float | None) -> str:
    """`backend`'s recorded speedup_vs_<against> (same-run per-call times, perf_tests/kernel_bench.py), else
    the ratio of the per-call times in this file."""
    recorded = by[backend].get(f"speedup_vs_{against}")
    if recorded is None and against_us:
        recorded = against_us / by[backend]["per_call"]
    return _fmt(recorded, ".2f") + ("x" if recorded is not None else "")


def optim_rows(data: dict) -> list[list]:
    rows = []
    for b in data["benchmarks"]:
        m = re.search(r"optimizer=(\w+),device=(\w+),workload=(\w+)", b.get("name", ""))
        if not m:
            continue
        e = b.get("extra_info", {})
        kind = "step" if b["name"].startswith("test_optimizer_step") else "train"
        per_call, device, _ = case_times(b) if m.group(2) == "cuda" else (b["stats"]["median"] * 1e6, None, None)
        rows.append([m.group(3), m.group(2), kind, m.group(1), per_call, device, e.get("ratio_to_fused_adamw"),
                     e.get("optimizer_step_us"), e.get("final_loss"), e.get("ns_sigma_min"), e.get("ns_sigma_max"),
                     e.get("tensors")])
    return sorted(rows, key=lambda r: (r[0], r[1], r[2], r[4]))


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def optim_view(data: dict) -> str:
    rows = [[r[0], r[1], r[2], r[3], f"{r[4]:.1f}", _fmt(r[5], ".1f"), _fmt(r[6], ".2f"), _fmt(r[7], ".1f"),
             _fmt(r[8], ".4f"), "-" if r[9] is None else f"{r[9]:.2f}-{r[10]:.2f}", _fmt(r[11], "d")]
            for r in optim_rows(data)]
    header = ["workload", "dev", "what", "optimizer", "us (cpu: cpu time)", "device us", "x fused", "step us",
              "loss", "NS sigma", "tensors"]
    return format_table(header, rows) if rows else "(no optimizer cases in this file)"


def data_view(data: dict) -> str:
    rows = []
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if "rows_per_sec" not in e:
            continue
        rows.append([b.get("param") or b["name"], e.get("stat", "wall"), f"{e['rows_per_sec']:,.0f}",
                     _fmt(e.get("ratio_to_pyarrow_read"), ".2f"), _fmt(e.get("ratio_to_copy_floor"), ".2f"),
                     _fmt(e.get("cache_hit_rate"), ".1%"), _fmt(e.get("wall_s"), ".3f")])
    header = ["case", "timer", "rows/s", "vs pyarrow", "vs copy", "hit", "wall s"]
    return format_table(header, sorted(rows)) if rows else "(no data cases in this file)"


def models_view(data: dict) -> str:
    """Markdown, one row per (model, phase) of perf_tests/test_models.py: per-call us [device us] of each
    backend x mode the file holds, and the fastest of triton/tilelang (any mode) per call against eager torch
    and against torch.compile of torch (the faster of its modes compile and graph: the peer the targets
    name)."""
    cases: dict = {}
    notes: dict = {}
    columns = set()
    for b in data["benchmarks"]:
        m = re.search(r"model=(\w+),backend=(\w+)(?:,mode=(\w+))?,phase=(\w+)(?:,precision=(\w+))?",
                      b.get("name", ""))
        if not m:
            continue
        name, backend, mode, phase, precision = m.groups()
        mode = mode or "eager"  # files from before the mode axis ran eagerly
        phase = f"{phase} {precision}" if precision else phase  # fp32 ids name no precision
        gpu = b.get("extra_info", {}).get("stat") == "device"
        per_call, device, _ = case_times(b) if gpu else (b["stats"]["median"] * 1e6, None, None)
        cases.setdefault((name, phase), {})[backend, mode] = (per_call, device, _stale_mark(data, b))
        notes.setdefault((name, phase), set()).update(b.get("extra_info", {}).get("torch_ops", []))
        columns.add((backend, mode))
    order = [(b, m) for b in ("torch", "triton", "tilelang") for m in ("eager", "compile", "graph", "captured")]
    columns = [c for c in order if c in columns]
    rows = []
    for (name, phase), by in cases.items():
        cells = [f"{by[k][0]:.0f} [{_fmt(by[k][1], '.0f')}]{by[k][2]}" if k in by else "-" for k in columns]
        ours = [k for k in by if k[0] != "torch"]
        best = min(ours, key=lambda k: by[k][0]) if ours else None
        compiled = [k for k in (("torch", "compile"), ("torch", "graph")) if k in by]
        peers = [("torch", "eager") if ("torch", "eager") in by else None,
                 min(compiled, key=lambda k: by[k][0]) if compiled else None]
        vs = [f"{by[peer][0] / by[best][0]:.2f}x ({'/'.join(best)})" if best and peer else "-" for peer in peers]
        rows.append([name, phase, *cells, *vs, "; ".join(sorted(notes[(name, phase)])) or "-"])
    header = ["model", "phase", *(f"{b} {m} us [device]" for b, m in columns), "best ours vs torch eager",
              "vs torch compile", "on torch"]
    return format_table(header, rows) if rows else "(no model cases in this file)"


VIEWS = {
    "models": models_view,
    "summary": lambda data: format_table(*summary_rows(data)),
    "cases": cases_view,
    "optim": optim_view,
    "data": data_view,
    "status": lambda data: f"{len(data['benchmarks'])} case(s)",
}


def add_report_arguments(parser) -> None:
    parser.add_argument("json_file", nargs="?", default="results/bench.json", help="pytest-benchmark JSON")
    parser.add_argument("--view", choices=sorted(VIEWS), default="summary", help="which table (default summary)")
    parser.add_argument("--json", metavar="OUT", help="also write each case's median and sources state to OUT")


def run_report(args) -> int:
    try:
        data = load_benchmark_json(args.json_file)
    except ReportError as exc:
        print(f"pcvr report: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if not data["benchmarks"]:
        print(f"pcvr report: error: {args.json_file} holds no benchmark results", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(data), indent=1) + "\n")
    print(machine_summary(data))
    cut = cut_summary(data)
    if cut:
        print(cut)
    skipped = skipped_summary(data)
    if skipped:
        print(skipped)
    print(sources_summary(data))
    print(VIEWS[args.view](data))
    return 0
